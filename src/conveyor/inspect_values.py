"""Value inspection (``conveyor inspect RUN --values``): the critic's values along one held-out
response of a run trained with a critic (``loss.advantage=gae``; issue 45 section 2).

What is shown: for each response token ``k``, ``V_k``, the critic's value of the state in which
token ``k`` is chosen (the prompt and response tokens ``0..k-1``), and its change
``V_k - V_{k-1}``, the move made by reading token ``k - 1``. Position: in the forward pass over
``prompt + response`` (``P + R`` tokens), ``V_k`` sits at position ``P - 1 + k``
(:mod:`conveyor.trainer.critic`, "Value alignment"; :func:`response_values`). The value of the
state after the last response token is not shown: the trainer takes it as terminal (0) and never
trains the critic there.

Where the critic comes from: the export holds the policy alone, so the critic is read from the
newest intact checkpoint (:func:`load_critics`; ``trainer.pt``'s ``critic`` and, for an ensemble,
``critics_more``, written by :meth:`conveyor.trainer.trainer.Trainer.state_dict`), together with
that checkpoint's policy (:func:`conveyor.inspect_attention.policy_from_state`): a ``head``
critic reads the policy's own hidden states, and the two belong to the same step. Each critic is
rebuilt as the trainer built it (:func:`conveyor.trainer.critic.build_value_model` with the
run's ``critic.backbone`` and seed ``i``; LoRA adapters where ``critic_lora_rank`` > 0) and its
saved weights loaded. An ensemble's value is the mean of its critics, with their per-token
population std (:func:`conveyor.trainer.ensemble.ensemble_stats`, as the trainer computes them).

The trajectory is :func:`conveyor.inspect_attention.load_trajectory`'s (a record of the run's
latest evaluation file): an environment's episode keeps its exact ids and action mask
(observation tokens marked), a plain response is re-encoded and every token is an action. Its
reward is the record's ``rewards`` entry, else its verdict (1 correct, 0 wrong, said so); the
return is :func:`conveyor.trainer.value_diagnostics.monte_carlo_returns` with ``critic.gamma``.
Values are shown unclamped (``critic.value_bounds`` is applied by the trainer before GAE, said
so) and computed in float32 on the host.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from conveyor.inspect_attention import InspectError, Policy, Trajectory

__all__ = ["ValuesResult", "critic_settings", "load_critics", "response_values", "value_moves", "inspect_values",
           "format_values"]

_CHECKPOINT_HINT = ("the critic is saved only in checkpoints (the export holds the policy alone): train with "
                    "run.final_checkpoint=full (the default) or run.checkpoint_every=N, and keep one "
                    "(run.keep_checkpoints)")


def critic_settings(run_dir: str | Path) -> dict[str, Any]:
    """The critic settings of a run that value inspection needs, from its ``config.json``.

    Read with :func:`conveyor.train.load_run_config`; a config that no longer validates is read
    as plain JSON, with :class:`conveyor.config.CriticConfig`'s defaults for missing keys.

    Returns:
        ``{"advantage": str, "backbone": str, "num_critics": int, "freeze_attention": bool,
        "lora_alpha": float, "gamma": float, "value_bounds": [lo, hi] or None, "values":
        "token" | "turn"}``.

    Raises:
        FileNotFoundError: no ``config.json`` (not a run directory).
    """
    from conveyor.config import ConfigError, CriticConfig
    from conveyor.train import load_run_config

    keys = ("backbone", "num_critics", "freeze_attention", "lora_alpha", "gamma", "value_bounds", "values")
    try:
        cfg = load_run_config(run_dir)
        return {"advantage": cfg.loss.advantage, **{k: getattr(cfg.critic, k) for k in keys}}
    except ConfigError:
        pass
    raw = json.loads((Path(run_dir) / "config.json").read_text())
    default = CriticConfig()
    critic = raw.get("critic") or {}
    return {"advantage": (raw.get("loss") or {}).get("advantage", "grpo"),
            **{k: critic.get(k, getattr(default, k)) for k in keys}}


def load_critics(run_dir: str | Path, *, warn: Callable[[str], None] | None = None
                 ) -> tuple[Policy, list[torch.nn.Module], Path, dict[str, Any]]:
    """The newest intact checkpoint's policy and critic(s), read-only.

    Checkpoints are tried newest first (:func:`conveyor.checkpoint.verify_checkpoint`; damaged
    ones are skipped with a note, one removed by a live run's rotation is skipped too). The first
    intact one is used: its policy (:func:`conveyor.inspect_attention.policy_from_state`) and
    each critic rebuilt (:func:`conveyor.trainer.critic.build_value_model` of that policy with
    the run's ``critic.backbone`` and seed ``i``, LoRA adapters when the checkpoint's
    ``critic_lora_rank`` > 0) with the saved weights loaded. Everything is in eval mode, float32,
    on the host, without gradients.

    Args:
        run_dir: A ``conveyor train`` run directory.
        warn: Called with each note as well (they are also in ``Policy.notes``).

    Returns:
        ``(policy, critics (N >= 1), checkpoint directory, critic settings)``
        (:func:`critic_settings`).

    Raises:
        FileNotFoundError: not a run directory.
        InspectError: the run trained without a critic (``loss.advantage`` is not ``gae``), has no
            intact checkpoint, or its checkpoint holds no critic; the message says what to do.
        conveyor.models.ModelLoadError: the model cannot be loaded.
        ValueError / RuntimeError / KeyError: the checkpoint's weights do not fit the configured
            model or critic.
    """
    from conveyor.checkpoint import complete_checkpoints, verify_checkpoint
    from conveyor.inspect_attention import (
        _checkpoints_newest_first,
        policy_from_state,
        run_settings,
    )
    from conveyor.runtime_files import holder_name, lock_holder
    from conveyor.trainer import critic as critic_lib

    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir} is not a conveyor run directory (no config.json)")
    cs = critic_settings(run_dir)
    if cs["advantage"] != "gae":
        raise InspectError(f"{run_dir} trained without a critic (loss.advantage={cs['advantage']} in its config.json): "
                           "--values needs a run trained with loss.advantage=gae")
    settings, notes = run_settings(run_dir)
    holder = lock_holder(run_dir)
    if holder is not None:
        notes.append(f"the run is being trained now by {holder_name(holder)}: inspecting its newest checkpoint")
    found = None
    for ckpt in _checkpoints_newest_first(run_dir):
        reason = verify_checkpoint(ckpt)
        if reason is not None:
            notes.append(f"checkpoint {ckpt.name} skipped: {reason}")
            continue
        try:
            state = torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=False, mmap=True)
        except FileNotFoundError:
            notes.append(f"checkpoint {ckpt.name} was removed while being read (the run keeps only the newest ones)")
            continue
        found = ckpt, state
        break
    if found is None:
        damaged = " (every one on disk is damaged: see the notes)" if complete_checkpoints(run_dir) else ""
        for n in notes if warn is not None else ():
            warn(n)
        raise InspectError(f"{run_dir} has no intact checkpoint{damaged}: {_CHECKPOINT_HINT}")
    ckpt, state = found
    if "critic" not in state:
        raise InspectError(f"checkpoint {ckpt} holds no critic (written by a conveyor run without loss.advantage=gae): "
                           "nothing to show for --values")
    saved = [state["critic"], *state.get("critics_more", [])]
    if len(saved) != cs["num_critics"]:
        notes.append(f"config.json says critic.num_critics={cs['num_critics']}, the checkpoint holds {len(saved)} "
                     "critic(s): showing the checkpoint's")
    policy = policy_from_state(state, ckpt, settings, notes)
    policy.model.eval()
    lora_rank = int(state.get("critic_lora_rank", 0))
    critics: list[torch.nn.Module] = []
    for i, st in enumerate(saved):
        critic = critic_lib.build_value_model(policy.model, cs["backbone"], seed=i)  # as the trainer
        if lora_rank > 0:
            critic_lib.apply_lora(critic, lora_rank, cs["lora_alpha"], freeze_attention=cs["freeze_attention"], seed=i)
        critic.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in st["model"].items()})
        critic.eval().requires_grad_(False)
        critics.append(critic)
    del state, saved
    if warn is not None:
        for n in notes:
            warn(n)
    return policy, critics, ckpt, cs


@torch.no_grad()
def response_values(critics: list[torch.nn.Module], ids: list[int], prompt_len: int) -> torch.Tensor:
    """Each critic's value of the state before each response token.

    One forward pass per critic over ``ids`` (no cache); ``V_k`` is position ``P - 1 + k``
    (:mod:`conveyor.trainer.critic`, "Value alignment").

    Args:
        critics: ``N >= 1`` value models (:class:`~conveyor.trainer.critic.ValueModel` or
            :class:`~conveyor.trainer.critic.HeadCritic`), each mapping ``[1, T]`` ids to
            ``[1, T]`` values.
        ids: Prompt and response token ids, ``T = P + R`` tokens.
        prompt_len: ``P``, ``1 <= P < T``.

    Returns:
        ``[N, R]`` float32 on the host: row ``c`` is critic ``c``'s ``V_0 .. V_{R-1}``.

    Raises:
        InspectError: no critics, ``prompt_len`` out of range, or ``T`` beyond the critic's
            context (``max_position_embeddings``).
    """
    if not critics:
        raise InspectError("no critic to compute values with")
    t = len(ids)
    if not 1 <= prompt_len < t:
        raise InspectError(f"prompt length {prompt_len} must be in [1, {t - 1}] for {t} tokens (prompt + response)")
    n_ctx = getattr(critics[0].config, "max_position_embeddings", None)
    if n_ctx is not None and t > n_ctx:
        raise InspectError(f"the trajectory has {t} tokens, more than the critic's context ({n_ctx})")
    rows = []
    for critic in critics:
        device = next(critic.parameters()).device
        v = critic(torch.tensor([list(ids)], dtype=torch.long, device=device))
        rows.append(v[0, prompt_len - 1: t - 1].float().cpu())
    return torch.stack(rows)


def value_moves(values: torch.Tensor, k: int = 3) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """The largest rises and falls of a value trace between consecutive tokens.

    Args:
        values: ``[R]``, ``V_0 .. V_{R-1}``.
        k: How many of each at most.

    Returns:
        ``(rises, falls)``: lists of ``(j, V_{j+1} - V_j)``, the move made by reading response
        token ``j``; rises strictly positive, largest first; falls strictly negative, most
        negative first; ties by the lower ``j``.

    Raises:
        ValueError: ``values`` not 1-D.
    """
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D [R], got shape {list(values.shape)}")
    d = [(j, float(values[j + 1] - values[j])) for j in range(values.numel() - 1)]
    rises = sorted((x for x in d if x[1] > 0), key=lambda x: (-x[1], x[0]))[:k]
    falls = sorted((x for x in d if x[1] < 0), key=lambda x: (x[1], x[0]))[:k]
    return rises, falls


@dataclass
class ValuesResult:
    """What :func:`inspect_values` found.

    Attributes:
        policy: The checkpoint's :class:`~conveyor.inspect_attention.Policy` (its source and notes).
        trajectory: The :class:`~conveyor.inspect_attention.Trajectory` (``P`` prompt, ``R``
            response tokens).
        checkpoint: The checkpoint directory the policy and critic(s) came from.
        step: Its policy version (optimizer steps; None: unknown).
        settings: :func:`critic_settings`.
        per_critic: ``[N, R]`` float32, each critic's values (:func:`response_values`).
        values: ``[R]``, the mean over the critics (the value the trainer uses).
        std: ``[R]``, the critics' population std per token (None with one critic).
        action_mask: ``[R]`` bool, True on tokens the policy generated.
        labels: ``R`` decoded response tokens.
        reward: The episode's reward (None: unknown). reward_source: how it is known.
        returns: ``[R]`` float32 return at each token (None without a reward).
        version_warning: Set when the record was generated by another policy version than the
            checkpoint's, or when either is unknown.
    """

    policy: Policy
    trajectory: Trajectory
    checkpoint: Path
    step: int | None
    settings: dict[str, Any]
    per_critic: torch.Tensor
    values: torch.Tensor
    std: torch.Tensor | None
    action_mask: torch.Tensor
    labels: list[str]
    reward: float | None
    reward_source: str
    returns: torch.Tensor | None
    version_warning: str | None = None
    notes: list[str] = field(default_factory=list)


def _reward(rec: dict) -> tuple[float | None, str]:
    """The first response's reward from an evaluation record, and how it is known."""
    rewards = rec.get("rewards") or []
    if rewards and rewards[0] is not None:
        return float(rewards[0]), "recorded by the evaluation"
    correct = (rec.get("correct") or [None])[0]
    if correct is None:
        return None, "the evaluation recorded neither a reward nor a verdict"
    return (1.0 if correct else 0.0), ("the verdict (1 correct, 0 wrong): the evaluation recorded no reward, "
                                       "the run's reward function may score it differently")


def inspect_values(run_dir: str | Path, *, sample: int = 0, warn: Callable[[str], None] | None = None) -> ValuesResult:
    """The critic's values along one held-out response of a run trained with a critic.

    Args:
        run_dir: A ``conveyor train`` run directory with ``loss.advantage=gae`` (read only).
        sample: Record index in the run's latest evaluation file
            (:func:`conveyor.inspect_attention.load_trajectory`).
        warn: Called with each note (damaged checkpoints skipped, settings read leniently).

    Returns:
        A :class:`ValuesResult`.

    Raises:
        FileNotFoundError: not a run directory, or no evaluation file.
        InspectError: ``sample`` out of range, no critic, no intact checkpoint (the message says
            why and what to do); see also :func:`load_critics` and
            :func:`conveyor.inspect_attention.load_trajectory`.
    """
    from conveyor.inspect_attention import eval_record, load_trajectory
    from conveyor.trainer.ensemble import ensemble_stats
    from conveyor.trainer.value_diagnostics import monte_carlo_returns

    if not (Path(run_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir} is not a conveyor run directory (no config.json)")
    if critic_settings(run_dir)["advantage"] == "gae":  # (else load_critics says why, before the eval file)
        eval_record(run_dir, sample)  # a bad --sample fails before the models are loaded
    policy, critics, ckpt, cs = load_critics(run_dir, warn=warn)
    traj = load_trajectory(run_dir, policy.tokenizer, sample)
    _, _, rec = eval_record(run_dir, sample)
    p, r = len(traj.prompt_ids), len(traj.response_ids)
    mask = (rec.get("episode_ids") or {}).get("action_mask") if traj.exact_ids else None
    if mask is not None and len(mask) != r:
        raise InspectError(f"record {sample} of {traj.eval_file.name}: its action mask has {len(mask)} entries for "
                           f"{r} response tokens")
    action = torch.tensor([bool(m) for m in mask]) if mask is not None else torch.ones(r, dtype=torch.bool)
    per = response_values(critics, traj.ids, p)
    if len(critics) > 1:
        mean, std = ensemble_stats(per.unsqueeze(1), torch.ones(1, r))
        values, std = mean[0], std[0]
    else:
        values, std = per[0], None
    reward, how = _reward(rec)
    returns = None if reward is None else monte_carlo_returns(reward, action, gamma=float(cs["gamma"]))
    labels = [policy.tokenizer.decode([t]) for t in traj.response_ids]
    return ValuesResult(policy, traj, ckpt, policy.version, cs, per, values, std, action, labels, reward, how, returns,
                        _version_warning(traj, policy), list(policy.notes))


def _version_warning(traj: Trajectory, policy: Policy) -> str | None:
    where = f"record {traj.index} of {traj.eval_file.name}"
    if traj.policy_version is None:
        return f"cannot check which policy version generated {where}: {traj.version_source}"
    if policy.version is not None and traj.policy_version != policy.version:
        return (f"version mismatch: {where} was generated by policy version {traj.policy_version}, the critic shown is "
                f"that of step {policy.version} ({policy.source}): it values the states of another policy's response")
    return None


def _tok(label: str, width: int = 24) -> str:
    s = repr(label)
    return s if len(s) <= width else s[: width - 4] + "...'"


def format_values(res: ValuesResult, k: int = 3) -> list[str]:
    """Console lines of a :class:`ValuesResult`: the header, one line per response token, the summary.

    Token line: ``k  V_k  change  [std]  [obs]  'token'``; the change is ``V_k - V_{k-1}`` (``.``
    for ``k = 0``), values with 4 decimals, the token text ``repr``-escaped and cut to 24
    characters; ``obs`` marks an observation token (action mask 0). Summary: the value at the
    first and the last action token, the return, the ``k`` largest rises and falls (the token
    whose reading moved the value).

    Returns:
        The lines, without markup.
    """
    tr, cs = res.trajectory, res.settings
    n = res.per_critic.shape[0]
    verdict = {True: "correct", False: "wrong", None: "verdict unknown"}[tr.correct]
    p, r = len(tr.prompt_ids), len(tr.response_ids)
    step = "unknown" if res.step is None else res.step
    critic = (f"{n} critics (ensemble; the value is their mean, std their per-token spread)" if n > 1 else "1 critic")
    gen = "an unknown policy version" if tr.policy_version is None else f"policy version {tr.policy_version}"
    has_obs = not bool(res.action_mask.all())
    out = [
        f"policy and critic: {res.policy.source} and its critic of the same step {step} ({res.checkpoint}); "
        f"{critic}, critic.backbone={cs['backbone']}",
        f"trajectory: record {tr.index} of {tr.eval_file} ({tr.sample_id}, {verdict}), generated by {gen}; prompt "
        f"tokens 0..{p - 1}, response tokens k = 0..{r - 1} ("
        + ("the episode exactly as generated; obs marks observation tokens" if tr.exact_ids else
           "the response text re-encoded; every token an action") + ")",
    ]
    if res.reward is None:
        out.append(f"reward: unknown ({res.reward_source}); no return")
    else:
        g0 = float(res.returns[int(res.action_mask.nonzero()[0, 0])]) if bool(res.action_mask.any()) else 0.0
        out.append(f"reward: {res.reward:g} ({res.reward_source}); return at the first token {g0:g} "
                   f"(critic.gamma={cs['gamma']:g})")
    out.append("how to read: V = the critic's value of the state in which token k is chosen (the prompt and "
               "response tokens 0..k-1); change = V(k) - V(k-1), the move made by reading token k-1"
               + ("; std = the critics' spread" if n > 1 else ""))
    if cs.get("value_bounds"):
        lo, hi = cs["value_bounds"]
        out.append(f"note: values shown unclamped; the trainer clamps them to critic.value_bounds [{lo:g}, {hi:g}] "
                   "before GAE")
    if cs.get("values") == "turn":
        out.append("note: critic.values=turn: the trainer reads one value per turn (at its first action token)")
    head = f"{'k':>5}  {'V':>8}  {'change':>8}" + (f"  {'std':>7}" if n > 1 else "") + ("  obs" if has_obs else "") \
        + "  token"
    out.append(head)
    v = res.values
    for i in range(r):
        change = "." if i == 0 else f"{float(v[i] - v[i - 1]):+.4f}"
        line = f"{i:>5}  {float(v[i]):+8.4f}  {change:>8}"
        if n > 1:
            line += f"  {float(res.std[i]):7.4f}"
        if has_obs:
            line += "  obs" if not bool(res.action_mask[i]) else "     "
        out.append(f"{line}  {_tok(res.labels[i])}")
    out.append("summary:")
    idx = res.action_mask.nonzero().squeeze(-1)
    if idx.numel():
        first, last = int(idx[0]), int(idx[-1])
        out.append(f"  value at the first token (k={first}): {float(v[first]):+.4f} (the critic's prediction of the "
                   "return from the prompt alone)")
        out.append(f"  value at the last token (k={last}): {float(v[last]):+.4f}")
        if res.returns is not None:
            g = float(res.returns[first])
            out.append(f"  return: {g:g}; error of the first value V - G = {float(v[first]) - g:+.4f}")
    else:
        out.append("  the response has no action token")
    rises, falls = value_moves(v, k)

    def moves(xs):
        return "; ".join(f"token {j} {_tok(res.labels[j], 16)} (V {j} -> {j + 1}) {d:+.4f}" for j, d in xs) or "none"

    out.append(f"  largest rises: {moves(rises)}")
    out.append(f"  largest falls: {moves(falls)}")
    return out
