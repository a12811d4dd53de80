"""Critic-based advantage estimators (MISSION.md section 3, SAO arXiv 2607.07508).

Pure functions of padded token tensors, computed without gradient. ``B`` = sequences, ``T`` =
padded response tokens. ``action_mask [B, T]`` (bool or numeric) is non-zero on tokens the
policy generated and 0 on observation tokens (tool outputs inserted by the environment) and on
padding. Values at positions a function ignores are never read arithmetically (NaN / inf there
change nothing). Computation is float32 (float64 inputs stay float64); rewards are unitless.

Also here: the critic-free ablation (sliding-window mean-reward baseline) and batch whitening.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "gae", "decoupled_gae", "adaptive_lambda", "turn_level_gae", "segments",
    "whiten", "sliding_window_advantages", "SlidingWindowBaseline", "clamp_values",
]


def _check(rewards: Tensor, values: Tensor, action_mask: Tensor) -> Tensor:
    """Validate ``[B, T]`` inputs; return ``action_mask`` as bool."""
    if not isinstance(action_mask, Tensor) or action_mask.dim() != 2:
        shape = list(action_mask.shape) if isinstance(action_mask, Tensor) else type(action_mask)
        raise ValueError(f"action_mask must be a tensor of shape [B, T], got {shape}")
    for name, t in (("rewards", rewards), ("values", values)):
        if not isinstance(t, Tensor) or t.shape != action_mask.shape:
            shape = list(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must have the shape of action_mask [B, T] = "
                             f"{list(action_mask.shape)}, got {shape}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    mask = action_mask != 0
    if bool((torch.where(mask, torch.zeros_like(rewards), rewards) != 0).any()):
        raise ValueError("rewards must be exactly 0 outside action_mask (a reward on an "
                         "observation or padding token would be silently dropped)")
    return mask


def _lam_tensor(lam: float | Tensor, b: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    if isinstance(lam, Tensor):
        if lam.dim() != 1 or lam.shape[0] != b:
            raise ValueError(f"lam tensor must have shape [B] = [{b}], got {list(lam.shape)}")
        lam_t = lam.to(device=device, dtype=dtype)
    else:
        lam_t = torch.full((b,), float(lam), dtype=dtype, device=device)
    if not bool(((lam_t >= 0) & (lam_t <= 1)).all()):
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    return lam_t


def _chain_gae(r: Tensor, v: Tensor, chain: Tensor, gamma: float, lam: Tensor) -> Tensor:
    """Backward GAE recursion over the positions where ``chain [B, K]`` is True.

    A chain position takes its next value / advantage from the next chain position of its row
    (0 after the last: terminal). Off-chain positions are skipped (the carry passes them
    unchanged); their output is garbage for the caller to mask. ``r`` and ``v`` must be 0 there.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    next_v = r.new_zeros(r.shape[0])
    last_a = r.new_zeros(r.shape[0])
    out = torch.zeros_like(r)
    for t in reversed(range(r.shape[1])):
        on = chain[:, t]
        a = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * last_a   # delta_t + g*l*A_next
        next_v = torch.where(on, v[:, t], next_v)
        last_a = torch.where(on, a, last_a)
        out[:, t] = last_a
    return out


@torch.no_grad()
def gae(
    rewards: Tensor,
    values: Tensor,
    action_mask: Tensor,
    *,
    gamma: float,
    lam: float | Tensor,
    skip_observations: bool = True,
    valid_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation over a padded token batch, skipping observations.

    GAE (Schulman et al. 2015, arXiv 1506.02438, eq. 16): ``delta_t = r_t + gamma V_{n(t)} -
    V_t`` and ``A_t = delta_t + gamma lam A_{n(t)}``, with ``n(t)`` the next step of the chain
    and ``V = A = 0`` after the last step (the episode ends); ``returns_t = A_t + V_t`` (the
    critic's regression target, the lambda-return).

    Which tokens form the chain:
        * ``skip_observations=True`` (SAO's skip-observation GAE, MISSION.md section 3): the
          action tokens only; the TD step from the last token of an action segment goes
          straight to the first token of the next one. Observation values are never read.
          Same recursion as verl ``compute_gae_advantage_return`` (core_algos.py), which
          reports the carried advantage on observation tokens where this one reports 0.
        * ``skip_observations=False`` (naive GAE, SAO's ablation): every ``valid_mask`` token,
          observations included (their values enter the chain; their rewards are 0).

    Args:
        rewards: ``[B, T]`` float per-token rewards (outcome reward on the last action token;
            per-turn rewards on any action token). Must be exactly 0 outside ``action_mask``.
        values: ``[B, T]`` float critic values; ``V_t`` is the value of the state before token
            ``t`` is emitted. Read only on chain tokens.
        action_mask: ``[B, T]`` non-zero on policy-generated tokens.
        gamma: Discount in ``[0, 1]`` (per token; LLM RL uses 1).
        lam: GAE lambda in ``[0, 1]``: a float, or a ``[B]`` tensor with one lambda per
            sequence (``adaptive_lambda``).
        skip_observations: See above.
        valid_mask: ``[B, T]`` non-zero on every token of the trajectory (actions and
            observations), 0 on padding; must cover ``action_mask``. Only used when
            ``skip_observations=False``. Default: every position up to and including the
            last action token of the row (so trailing observations, which the episode ended
            on, are treated like padding; pass ``valid_mask`` to chain them too).

    Returns:
        ``(advantages, returns)``, each ``[B, T]`` float32 (float64 for float64 values),
        exactly 0 outside ``action_mask`` (observations and padding). An all-zero row gives
        zeros. No whitening (see ``whiten``).

    Raises:
        ValueError: a tensor is not ``[B, T]`` like ``action_mask`` or not floating; rewards
            non-zero outside ``action_mask``; ``valid_mask`` does not cover ``action_mask``;
            ``gamma`` or ``lam`` outside ``[0, 1]``; ``lam`` tensor not ``[B]``.
    """
    mask = _check(rewards, values, action_mask)
    b, t = mask.shape
    if valid_mask is None:
        pos = torch.arange(1, t + 1, device=mask.device)
        last = torch.where(mask, pos, torch.zeros_like(pos)).amax(-1) if t else pos.new_zeros(b)
        valid = pos.unsqueeze(0) <= last.unsqueeze(1)
    else:
        if not isinstance(valid_mask, Tensor) or valid_mask.shape != mask.shape:
            shape = list(valid_mask.shape) if isinstance(valid_mask, Tensor) else valid_mask
            raise ValueError(f"valid_mask must have the shape of action_mask [B, T] = "
                             f"{list(mask.shape)}, got {shape}")
        valid = valid_mask != 0
        if bool((mask & ~valid).any()):
            raise ValueError("valid_mask must be non-zero on every action_mask token")
    chain = mask if skip_observations else valid
    dtype = torch.promote_types(values.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    r = torch.where(chain, rewards.to(dtype), zero)
    v = torch.where(chain, values.to(dtype), zero)
    adv = _chain_gae(r, v, chain, gamma, _lam_tensor(lam, b, dtype, mask.device))
    return torch.where(mask, adv, zero), torch.where(mask, adv + v, zero)


@torch.no_grad()
def decoupled_gae(
    rewards: Tensor,
    values: Tensor,
    action_mask: Tensor,
    *,
    gamma: float,
    policy_lam: float | Tensor,
    critic_lam: float = 1.0,
    skip_observations: bool = True,
    valid_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Decoupled GAE: policy advantages with ``policy_lam``, critic returns with ``critic_lam``.

    VAPO (arXiv 2504.05118, "Decoupled-GAE" and "Length-Adaptive GAE"; SAO in
    MISSION.md section 3 uses critic lambda 1 and the length-adaptive policy lambda): the
    critic is trained on unbiased ``lambda = 1`` returns, the policy on lower-variance
    ``lambda < 1`` advantages. Two ``gae`` calls; arguments, dtypes and errors as in ``gae``.

    Returns:
        ``(advantages [B, T], returns [B, T])``: advantages from ``policy_lam``, returns from
        ``critic_lam``; 0 outside ``action_mask``.
    """
    kw = dict(gamma=gamma, skip_observations=skip_observations, valid_mask=valid_mask)
    adv, _ = gae(rewards, values, action_mask, lam=policy_lam, **kw)
    _, ret = gae(rewards, values, action_mask, lam=critic_lam, **kw)
    return adv, ret


def adaptive_lambda(lengths: Tensor, alpha: float) -> Tensor:
    """Length-adaptive GAE lambda: ``lambda = 1 - 1 / (alpha * l)``, clamped to ``[0, 1]``.

    VAPO (arXiv 2504.05118, "Length-Adaptive GAE") with ``alpha = 0.05``;
    SAO (MISSION.md section 3) uses ``alpha = 1.5``. ``l`` is the number of action tokens of
    the sequence (e.g. ``action_mask.sum(-1)``); ``l = 0`` gives ``0`` (no NaN).

    Args:
        lengths: ``[B]`` non-negative lengths in tokens, any real dtype.
        alpha: Positive scale.

    Returns:
        ``[B]`` float32 lambdas in ``[0, 1]`` (pass as ``gae(..., lam=...)``).

    Raises:
        ValueError: ``alpha <= 0``; ``lengths`` not 1-D, negative or not finite.
    """
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if not isinstance(lengths, Tensor) or lengths.dim() != 1:
        shape = list(lengths.shape) if isinstance(lengths, Tensor) else type(lengths).__name__
        raise ValueError(f"lengths must be a tensor of shape [B], got {shape}")
    length = lengths.to(torch.float32)
    if not bool(((length >= 0) & torch.isfinite(length)).all()):
        raise ValueError("lengths must be finite and >= 0")
    lam = 1.0 - 1.0 / (alpha * length.clamp(min=1e-30))
    return torch.where(length > 0, lam.clamp(0.0, 1.0), torch.zeros_like(length))


def segments(action_mask_row: Tensor) -> list[tuple[int, int]]:
    """Maximal runs of action tokens of one sequence, as half-open ``(start, end)`` pairs.

    Args:
        action_mask_row: ``[T]`` mask, non-zero on action tokens.

    Returns:
        ``[(start, end), ...]`` in order; e.g. ``[1, 1, 0, 0, 1]`` -> ``[(0, 2), (4, 5)]``.

    Raises:
        ValueError: ``action_mask_row`` is not 1-D.
    """
    if not isinstance(action_mask_row, Tensor) or action_mask_row.dim() != 1:
        raise ValueError("action_mask_row must be a tensor of shape [T]")
    out: list[tuple[int, int]] = []
    start = None
    for i, on in enumerate((action_mask_row != 0).tolist() + [False]):
        if on and start is None:
            start = i
        elif not on and start is not None:
            out.append((start, i))
            start = None
    return out


@torch.no_grad()
def turn_level_gae(
    rewards: Tensor, values: Tensor, action_mask: Tensor, *, gamma: float, lam: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Turn-level ("step") GAE, the ablation SAO compares token-level values against.

    A turn is a maximal run of action tokens (``segments``). Turn ``k`` has value ``V_k`` =
    the value at its first token and reward ``R_k`` = the sum of its tokens' rewards; GAE
    (arXiv 1506.02438 eq. 16) runs over turns with ``gamma`` per turn: ``delta_k = R_k +
    gamma V_{k+1} - V_k``, ``A_k = delta_k + gamma lam A_{k+1}`` (0 after the last turn).
    Every token of turn ``k`` gets ``A_k`` and return ``A_k + V_k`` (so the value loss trains
    every token of a turn towards the turn's return). MISSION.md section 3: token-level wins.

    Args / errors: as ``gae`` (``skip_observations`` is implicit; values are read only at the
    first token of each turn).

    Returns:
        ``(advantages [B, T], returns [B, T])`` float32 (float64 for float64 values), 0
        outside ``action_mask``.
    """
    mask = _check(rewards, values, action_mask)
    b, t = mask.shape
    dtype = torch.promote_types(values.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    lam_t = _lam_tensor(lam, b, dtype, mask.device)
    prev = torch.cat([mask.new_zeros(b, 1), mask[:, :-1]], dim=1) if t else mask
    start = mask & ~prev
    n_turns = start.sum(-1)
    k = int(n_turns.max()) if n_turns.numel() else 0
    if k == 0:
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {gamma}")
        out = torch.zeros(b, t, dtype=dtype, device=mask.device)
        return out, out.clone()
    turn = (start.long().cumsum(-1) - 1).clamp(min=0)                     # [B, T] turn index
    empty = torch.zeros(b, k, dtype=dtype, device=mask.device)
    r_turn = empty.scatter_add(1, turn, torch.where(mask, rewards.to(dtype), zero))    # R_k
    v_turn = empty.scatter_add(1, turn, torch.where(start, values.to(dtype), zero))    # V_k
    chain = torch.arange(k, device=mask.device).unsqueeze(0) < n_turns.unsqueeze(1)
    adv = _chain_gae(r_turn, v_turn, chain, gamma, lam_t)
    return (torch.where(mask, adv.gather(1, turn), zero),
            torch.where(mask, (adv + v_turn).gather(1, turn), zero))


@torch.no_grad()
def clamp_values(values: Tensor, bounds: tuple[float, float] | None) -> Tensor:
    """The critic's values clamped to the range the returns can take, for the advantages.

    With outcome rewards in ``[r_lo, r_hi]`` and ``gamma = 1`` every return lies in that range, so
    a value outside it is an error of the critic. It matters for the policy: with lambda near 1 a
    token's advantage is about ``R - V_t``, so on a response that earned ``R = r_lo`` a value
    below ``r_lo`` gives every token a positive advantage, and the summed advantage grows with
    the response's length (``advantage/sum_unrewarded`` > 0 in ``metrics.jsonl``;
    docs/results/sao.md, the length drift). Clamping ``V`` to the bounds removes that case; the
    value loss keeps training the unclamped values. Off by default (``critic.value_bounds``).

    Args:
        values: ``[B, T]`` (any shape) float values.
        bounds: ``(lo, hi)`` with ``lo < hi``, or None (values returned unchanged).

    Returns:
        ``values`` clamped elementwise to ``[lo, hi]`` (a new tensor), or ``values`` itself.

    Raises:
        ValueError: ``bounds`` not two finite numbers with ``lo < hi``.
    """
    if bounds is None:
        return values
    lo, hi = (float(b) for b in bounds)
    if not (torch.isfinite(torch.tensor([lo, hi])).all() and lo < hi):
        raise ValueError(f"bounds must be (lo, hi) with finite lo < hi, got {bounds!r}")
    return values.clamp(lo, hi)


@torch.no_grad()
def whiten(
    advantages: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """Whiten advantages over the masked tokens of the batch: ``(A - mean) / sqrt(var + eps)``.

    As verl ``masked_whiten`` (verl/utils/torch_functional.py), applied by verl after GAE: mean
    and unbiased (Bessel) variance over ``mask`` tokens. Explicit, never applied by ``gae``.

    Args:
        advantages: ``[B, T]`` float.
        mask: ``[B, T]`` non-zero on tokens that count.
        shift_mean: ``False`` adds the mean back (scale only).
        eps: Added to the variance; must be >= 0.

    Returns:
        ``[B, T]`` in the computation dtype (float32 / float64); 0 outside ``mask``. With fewer
        than 2 tokens (or constant advantages) every token gets ``0`` (or the mean).

    Raises:
        ValueError: shapes differ or are not 2-D; advantages not floating; ``eps < 0``.
    """
    a_shape, m_shape = getattr(advantages, "shape", None), getattr(mask, "shape", None)
    if not isinstance(advantages, Tensor) or not isinstance(mask, Tensor) \
            or advantages.dim() != 2 or a_shape != m_shape:
        raise ValueError(f"advantages and mask must both be tensors of shape [B, T], got "
                         f"{list(a_shape or [])} and {list(m_shape or [])}")
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must be a floating tensor, got dtype {advantages.dtype}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    m = mask != 0
    x = advantages.to(torch.promote_types(advantages.dtype, torch.float32))
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    n = m.sum()
    mean = torch.where(m, x, zero).sum() / n.clamp(min=1)
    var = torch.where(m, (x - mean).square(), zero).sum() / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, zero)


def sliding_window_advantages(
    rewards: Tensor, history: Sequence[float], window: int
) -> tuple[Tensor, list[float]]:
    """Critic-free baseline (SAO's ablation, MISSION.md section 3): ``A_i = r_i - b``.

    ``b`` = mean of the last ``window`` rewards of ``history`` (rewards of earlier steps, in
    order; never this step's), ``0`` when ``history`` is empty; every reward of this step gets
    the same ``b`` (REINFORCE with a baseline, Williams 1992). ``window`` counts rewards
    (responses), not steps.

    Args:
        rewards: ``[N]`` this step's scalar rewards, real, finite.
        history: Earlier rewards, oldest first.
        window: Baseline window in rewards, ``>= 1``.

    Returns:
        ``(advantages [N] float32, new_history)`` with ``new_history`` = the last ``window``
        entries of ``history + rewards`` (pass it back on the next step).

    Raises:
        ValueError: ``window < 1``; ``rewards`` not 1-D, complex or not finite.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    if not isinstance(rewards, Tensor) or rewards.dim() != 1 or rewards.is_complex():
        raise ValueError(f"rewards must be a real tensor of shape [N], got {rewards!r}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite (no NaN or inf)")
    recent = [float(h) for h in list(history)[-window:]]
    baseline = sum(recent) / len(recent) if recent else 0.0
    adv = (rewards.to(torch.float64) - baseline).to(torch.float32)
    return adv, (recent + rewards.double().tolist())[-window:]


class SlidingWindowBaseline:
    """Stateful wrapper of ``sliding_window_advantages`` with checkpointable state.

    Args:
        window: Baseline window in rewards, ``>= 1`` (ValueError otherwise).
    """

    def __init__(self, window: int) -> None:
        sliding_window_advantages(torch.zeros(0), [], window)       # validates window
        self.window = window
        self.history: list[float] = []

    def advantages(self, rewards: Tensor) -> Tensor:
        """``[N]`` float32 advantages of this step's ``rewards [N]``; then records them."""
        adv, self.history = sliding_window_advantages(rewards, self.history, self.window)
        return adv

    def state_dict(self) -> dict:
        """``{"window": int, "history": list[float]}`` (a copy)."""
        return {"window": self.window, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``; ValueError if keys are missing or the window differs."""
        if not isinstance(state, dict) or {"window", "history"} - set(state):
            raise ValueError("state must be a dict with keys 'window' and 'history'")
        if state["window"] != self.window:
            raise ValueError(f"state window {state['window']} != this baseline's {self.window}")
        self.history = [float(h) for h in state["history"]][-self.window:]
