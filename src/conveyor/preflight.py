"""Start-up checks of a training run: settings and data that cannot work are refused or named
before the run directory is created, with the numbers.

- :func:`check_prompt_lengths`: prompts that fill the model's context are dropped and counted
  (the run is refused when none is left); ``rollout.max_new_tokens`` beyond what the context
  leaves after a prompt is reported (responses would be cut silently otherwise).
- :func:`config_warnings`: settings that are legal but probably not what the user meant (a
  changed ``data.train`` evaluated on the default held-out set; greedy single-response
  sampling).

The refusals for settings that can never learn (``rollout.temperature=0`` with groups) are
config validation (:mod:`conveyor.config`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from conveyor.config import STYLE_REWARD_FNS, DataConfig, TrainConfig
from conveyor.data import DatasetError
from conveyor.prompts import build_messages, build_prompt_ids
from conveyor.types import Sample

_SENTINEL = "\x00conveyor-question\x00"


@dataclass
class PromptLengthReport:
    """What :func:`check_prompt_lengths` found.

    Attributes:
        context: The model's context length (``max_position_embeddings``, tokens); None if the
            model does not say (then nothing is checked).
        max_new_tokens: The response budget checked (tokens).
        samples: Samples checked.
        too_long: ``(sample id, prompt tokens)`` of the prompts dropped (``>= context``).
        cut: Kept samples whose ``prompt + max_new_tokens > context``: their responses can be at
            most ``context - prompt`` tokens.
        min_room: The smallest ``context - prompt`` among them (tokens), None when ``cut == 0``.
        tokenized: Prompts tokenized exactly (the others are provably short, see
            :func:`check_prompt_lengths`).
    """

    context: int | None
    max_new_tokens: int
    samples: int
    too_long: list[tuple[str, int]] = field(default_factory=list)
    cut: int = 0
    min_room: int | None = None
    tokenized: int = 0

    def messages(self, what: str, budget_key: str = "rollout.max_new_tokens") -> list[str]:
        """Human-readable warnings (empty when everything fits); ``what`` names the data set,
        ``budget_key`` the config key of :attr:`max_new_tokens`."""
        out = []
        if self.too_long:
            ids = ", ".join(f"{sid} ({n} tokens)" for sid, n in self.too_long[:3])
            more = f" and {len(self.too_long) - 3} more" if len(self.too_long) > 3 else ""
            out.append(
                f"{what}: {len(self.too_long)} of {self.samples} prompts are longer than the "
                f"model's context of {self.context} tokens and are skipped: {ids}{more}"
            )
        if self.cut:
            out.append(
                f"{what}: {budget_key}={self.max_new_tokens} does not fit the model's context of "
                f"{self.context} tokens after the prompt for {self.cut} of {self.samples} prompts: "
                f"their responses are cut at context - prompt tokens (as few as {self.min_room})"
            )
        return out


def _bound_fn(tokenizer, instruction: str):
    """An upper bound on a sample's prompt tokens from its question's UTF-8 bytes.

    Every token of a byte-level BPE (and of a byte-fallback SentencePiece) tokenizer covers at
    least one byte of the rendered text, so ``tokens <= bytes(rendered prompt)`` plus the
    special tokens the template adds (counted exactly from a rendering with an empty question).
    """
    rendered = tokenizer.apply_chat_template(
        build_messages(Sample("x", _SENTINEL, "", ""), instruction),
        tokenize=False,
        add_generation_prompt=True,
    )
    overhead = len(rendered.encode("utf-8")) - len(_SENTINEL.encode("utf-8"))
    specials = len(build_prompt_ids(tokenizer, Sample("x", "", "", ""), instruction))
    return lambda s: len(s.question.encode("utf-8")) + overhead + specials


def check_prompt_lengths(
    samples: Sequence[Sample], tokenizer, instruction: str, context: int | None, max_new_tokens: int
) -> tuple[list[Sample], PromptLengthReport]:
    """Drop the samples whose chat-formatted prompt fills the model's context, and count those
    whose response budget the context cuts.

    Only prompts that could be long are tokenized: a byte bound (see :func:`_bound_fn`) proves
    the rest fit, so the check costs nothing for short prompts (tokenizing all 7,473 GSM8K
    questions would take ~10 s on 2 cores).

    Args:
        samples: The data set.
        tokenizer: The policy's tokenizer (chat template).
        instruction: The instruction the workflow appends to each question.
        context: ``max_position_embeddings`` (tokens), or None (nothing is checked).
        max_new_tokens: ``rollout.max_new_tokens`` (tokens).

    Returns:
        ``(kept samples, report)``.
    """
    report = PromptLengthReport(
        context=context, max_new_tokens=max_new_tokens, samples=len(samples)
    )
    if not context or not samples:
        return list(samples), report
    bound = _bound_fn(tokenizer, instruction)
    kept = []
    for s in samples:
        if bound(s) + max_new_tokens <= context:
            kept.append(s)
            continue
        n = len(build_prompt_ids(tokenizer, s, instruction))
        report.tokenized += 1
        if n >= context:
            report.too_long.append((s.id, n))
            continue
        kept.append(s)
        if n + max_new_tokens > context:
            report.cut += 1
            room = context - n
            report.min_room = room if report.min_room is None else min(report.min_room, room)
    return kept, report


def require_samples(
    samples: Sequence[Sample], spec: str, report: PromptLengthReport | None = None
) -> None:
    """Refuse a training set with nothing to train on.

    Raises:
        DatasetError: ``samples`` is empty (the message names ``spec`` and, when prompts were
            dropped for length, how many and the context).
    """
    if samples:
        return
    if report is not None and report.too_long:
        raise DatasetError(
            f"data.train={spec}: all {report.samples} prompts are longer than the model's "
            f"context of {report.context} tokens (the shortest has "
            f"{min(n for _, n in report.too_long)} tokens); nothing to train on"
        )
    raise DatasetError(f"data.train={spec}: the data set has no samples")


def require_answers(samples: Sequence[Sample], spec: str, reward_fn: str) -> None:
    """Refuse a training set whose answers are all empty for a reward that grades the answer
    (the built-in ``math`` / ``correctness``): every reward would be 0 (fresh-user trial 5: the
    preference-shift prompts, which have no answers, trained with ``reward.fn=correctness``).

    Raises:
        DatasetError: naming ``data.train`` and ``reward.fn``.
    """
    if reward_fn.strip() not in ("math", "correctness") or not samples:
        return
    if all(not str(s.answer).strip() for s in samples):
        hint = " (a style set: reward.fn=style, configs/preference_shift.yaml)" if _family(spec) == "styles" else ""
        raise DatasetError(f"data.train={spec}: every sample's answer is empty, and reward.fn={reward_fn} grades the "
                           f"answer: every reward would be 0, nothing could be learned; choose a reward that fits "
                           f"the data{hint}")


def _family(spec: str) -> str:
    """A data spec's source, e.g. ``guess`` of ``guess:train?high=10``, ``mawps`` of ``mawps:singleop:train``."""
    return spec.split("?", 1)[0].split(":", 1)[0]


def config_warnings(cfg: TrainConfig) -> list[str]:
    """Warnings about legal settings that are probably mistakes (printed, logged to
    ``train.log`` and recorded as ``events.jsonl`` ``warning`` events by the runtime)."""
    out = []
    default = DataConfig()
    if cfg.data.heldout and cfg.data.heldout.strip() == cfg.data.train.strip():
        out.append(
            f"data.heldout={cfg.data.heldout} is the training set itself: the held-out accuracy before / after "
            "measures problems the policy trains on, not generalisation; use another split (e.g. :heldout) or "
            "data.heldout= (empty) to turn it off"
        )
    elif cfg.data.heldout and cfg.data.train != default.train and cfg.data.heldout == default.heldout:
        out.append(
            f"data.train={cfg.data.train} but data.heldout is still the default "
            f"{default.heldout}: the held-out accuracy before / after measures that set, not the "
            "one trained on; set data.heldout (e.g. the :heldout split of your set) or "
            "data.heldout= (empty) to turn it off"
        )
    from conveyor.envs.registry import ENV_DATA

    if cfg.env.name in ENV_DATA and cfg.data.heldout:  # e.g. guess: its own sets are the defaults
        env_train, env_heldout = ENV_DATA[cfg.env.name]
        if _family(cfg.data.train) != _family(env_train) and _family(cfg.data.heldout) == _family(env_heldout):
            out.append(
                f"data.train={cfg.data.train} but data.heldout is still env.name={cfg.env.name}'s default "
                f"{cfg.data.heldout}: the held-out accuracy measures that set, not the one trained on; set "
                "data.heldout, or data.heldout= (empty) to turn it off"
            )
    if cfg.loss.advantage != "gae":
        changed = sorted(_changed(cfg.critic, list(type(cfg.critic).model_fields)))
        if changed:
            out.append(f"critic.{', critic.'.join(changed)} set, but loss.advantage={cfg.loss.advantage} trains no "
                       "critic: they are ignored (loss.advantage=gae uses them)")
    if cfg.env.name == "none":
        changed = sorted(_changed(cfg.env, list(type(cfg.env).model_fields)))
        if changed:
            out.append(f"env.{', env.'.join(changed)} set, but env.name=none (the single-turn workflow): they are "
                       "ignored (set env.name to guess, math_python or package.module:factory)")
    if cfg.data.style_schedule and cfg.reward.fn.strip() not in STYLE_REWARD_FNS:
        out.append(f"data.style_schedule set, but reward.fn={cfg.reward.fn} does not judge styles: the target stamped "
                   "on every prompt is never read (reward.fn=style is the preference-shift task's reward)")
    out.extend(_ignored_settings(cfg))
    if cfg.rollout.temperature == 0 and cfg.rollout.group_size == 1:
        out.append(
            "rollout.temperature=0: the behaviour policy is greedy (deterministic), so training "
            "only re-weights the argmax response by its reward relative to the batch; nothing "
            "explores (temperature > 0 samples)"
        )
    return out


def _changed(section: object, keys: Sequence[str]) -> list[str]:
    """The keys of ``section`` (a config section) among ``keys`` set away from their default."""
    fresh = type(section)()
    return [k for k in keys if getattr(section, k) != getattr(fresh, k)]


def _ignored_settings(cfg: TrainConfig) -> list[str]:
    """Settings that only take effect under another setting which is off (fresh-user finding:
    e.g. ``lora.rank=32`` without ``lora.enabled`` was silently ignored)."""
    out = []
    rules = [
        ("async", ["eta_max", "ratio_base", "ratio_min", "ratio_max", "ratio_step", "variance_threshold"],
         not cfg.asynchronous.adaptive, "async.adaptive=false (the adaptive controller is off; async.eta is the bound)"),
        ("lora", ["rank", "alpha", "dropout", "target_modules", "sync"], not cfg.lora.enabled,
         "lora.enabled=false (every weight trains)"),
        ("log", ["wandb_project", "wandb_run_name", "wandb_mode", "wandb_dir"], not cfg.log.wandb,
         "log.wandb=false (nothing goes to Weights & Biases)"),
        ("proximal", ["interpolation"], cfg.proximal.method != "interpolate",
         f"proximal.method={cfg.proximal.method} (interpolation is proximal.method=interpolate's)"),
        ("proximal", ["ewma_beta", "ewma_reset_keep_rate"], cfg.proximal.method not in ("ewma", "auto"),
         f"proximal.method={cfg.proximal.method} (these are proximal.method=ewma's, or auto's when it picks ewma)"),
        ("proximal", ["dedicated_threads"], cfg.proximal.method != "dedicated",
         f"proximal.method={cfg.proximal.method} (dedicated_threads is proximal.method=dedicated's)"),
        ("proximal", ["memory_budget_bytes"], cfg.proximal.method != "auto",
         f"proximal.method={cfg.proximal.method} (the memory budget is proximal.method=auto's)"),
        ("runtime", [k for k in type(cfg.runtime).model_fields if k != "name"], cfg.runtime.name != "ray",
         "runtime.name=inline (these are the Ray runtime's: runtime.name=ray)"),
    ]
    for section, keys, off, why in rules:
        changed = _changed(getattr(cfg, "asynchronous" if section == "async" else section), keys)
        if off and changed:
            out.append(f"{section}.{f', {section}.'.join(changed)} set, but {why}: ignored")
    return out
