"""Off-policy corrections as pure tensor functions: training-inference mismatch weights, k1 / k2 /
k3 rejection statistics, loss-aggregation weights and the interpolated proximal policies.

Conventions follow :mod:`conveyor.trainer.losses`: per-token tensors are ``[B, T]`` with a
``mask``; packed rows hold several sequences, told apart by ``seq_index [B, T]`` (int64, the
sequence each position belongs to, -1 on padding; ``None`` = one sequence per row). Every weight
returned here is detached (never differentiated through) and computed in log space with
``|log w| <= LOG_RATIO_CLAMP`` before ``exp``. Masked positions get weight 0 and never produce
NaN.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from conveyor.trainer.losses import LOG_RATIO_CLAMP, _check_token_tensors

__all__ = [
    "CORRECTIONS",
    "AGGREGATIONS",
    "mismatch_weights",
    "rejection_stats",
    "aggregation_weights",
    "interpolated_proximal",
    "interpolation_alpha",
    "effective_clip_bounds",
]

CORRECTIONS = ("none", "tis_token", "tis_sequence", "mis_token", "mis_sequence", "geo_mask")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")


def _seq_ids(mask: Tensor, seq_index: Tensor | None) -> tuple[Tensor, int]:
    """Dense sequence ids ``[B, T]`` in ``0..S-1`` (``-1`` where masked) and ``S``."""
    m = mask != 0
    if seq_index is None:
        B, T = mask.shape
        raw = torch.arange(B, device=mask.device).unsqueeze(1).expand(B, T)
    else:
        if seq_index.shape != mask.shape:
            raise ValueError(f"seq_index must have the shape of mask {list(mask.shape)}, got {list(seq_index.shape)}")
        raw = seq_index.long()
    raw = torch.where(m, raw, torch.full_like(raw, -1))
    uniq, inv = torch.unique(raw[m], return_inverse=True)
    ids = torch.full_like(raw, -1)
    ids[m] = inv
    return ids, int(uniq.numel())


def _per_seq_sum(x: Tensor, ids: Tensor, S: int) -> Tensor:
    """``[S]`` sums of ``x [B, T]`` per sequence id (positions with id -1 ignored)."""
    out = torch.zeros(S, dtype=x.dtype, device=x.device)
    sel = ids >= 0
    return out.index_add_(0, ids[sel], x[sel])


def _broadcast(per_seq: Tensor, ids: Tensor, fill: float = 0.0) -> Tensor:
    """``[S]`` values back to ``[B, T]`` (``fill`` where id is -1)."""
    out = torch.full(ids.shape, fill, dtype=per_seq.dtype, device=per_seq.device)
    sel = ids >= 0
    out[sel] = per_seq[ids[sel]]
    return out


def mismatch_weights(
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    *,
    method: Literal["none", "tis_token", "tis_sequence", "mis_token", "mis_sequence", "geo_mask"] = "tis_token",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
    seq_index: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Importance weights correcting the training-inference mismatch ``pi_prox / pi_behav``.

    MISSION.md section 5 ("Training-inference mismatch corrections"). With the per-token
    log-ratio ``l_t = log pi_prox - log pi_behav`` (clamped to +-LOG_RATIO_CLAMP) and, per
    sequence ``s``, ``L_s = sum_t l_t`` and ``g_s = L_s / n_s`` (log of the geometric mean):

    * ``none``: ``w_t = 1``.
    * ``tis_token`` (truncated IS, token level; Ionides 2008, used by verl / Fengyao's TIS):
      ``w_t = min(exp(l_t), cap)``, default ``cap = 2``.
    * ``tis_sequence``: ``w_t = min(exp(L_s), cap)`` for every token of the sequence.
    * ``mis_token`` (masked IS / IcePop): ``w_t = exp(l_t)`` if ``low <= exp(l_t) <= high`` else
      0 (default band ``[0.5, 2]``).
    * ``mis_sequence``: ``w_t = exp(L_s)`` if ``low <= exp(L_s) <= high`` else 0.
    * ``geo_mask``: geometric-mean sequence filter: ``w_t = 1`` if ``low <= exp(g_s) <= high``
      else 0. The geometric mean avoids the length trap of the product (1.1^100 = 13,780).
      ``g_s`` is the mean of the token-clamped ``l_t``, never of a clamped ``L_s`` (which would
      cap ``|g_s|`` at ``20 / n_s`` and keep every long sequence whatever its mismatch), as in
      verl's ``rollout_rs="geometric"`` (``verl/trainer/ppo/rollout_corr_helper.py``:
      ``compute_rollout_rejection_mask``, clamp after the mean; today ``seq_mean_k1``) and
      AReaL's ``apply_rejection_sampling`` (``level="sequence", metric="ratio", agg="mean"``).

    ``L_s`` is clamped to ``+-LOG_RATIO_CLAMP`` before ``exp`` in the two product-weight
    methods (verl clamps the sequence log-ratio sum the same way, ``SAFETY_BOUND = 20``).

    Args:
        proximal_logprobs: ``[B, T]`` training-side log-probs (pi_prox / pi_old_train).
        behaviour_logprobs: ``[B, T]`` inference-engine log-probs.
        mask: ``[B, T]`` non-zero for counted tokens.
        method: One of ``CORRECTIONS``.
        cap: TIS truncation ``C > 0``. low / high: MIS / geometric band, ``0 <= low <= 1 <= high``.
        seq_index: ``[B, T]`` sequence of each position (packed rows), or None.

    Returns:
        ``(weights [B, T] float32 detached, 0 where masked; metrics)`` with
        ``correction/weight_mean`` (over counted tokens), ``correction/masked_token_frac``
        (counted tokens given weight 0), ``correction/truncated_token_frac`` (TIS weights that
        hit the cap) and ``correction/masked_seq_frac``.

    Raises:
        ValueError: unknown method, bad bounds or shapes.
    """
    m = _check_token_tensors(mask, proximal_logprobs=proximal_logprobs, behaviour_logprobs=behaviour_logprobs)
    if method not in CORRECTIONS:
        raise ValueError(f"unknown mismatch correction {method!r}; choose one of {CORRECTIONS}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if not (0.0 <= low <= 1.0 <= high):
        raise ValueError(f"need 0 <= low <= 1 <= high, got {low}, {high}")
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    lr = torch.where(m, proximal_logprobs.detach().float() - behaviour_logprobs.detach().float(), zero)
    lr = torch.nan_to_num(lr, nan=0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ids, S = _seq_ids(mask, seq_index)
    n_tok = max(1, int(m.sum()))
    truncated = torch.zeros_like(m)
    log_hi, log_lo = math.log(high), (math.log(low) if low > 0 else -math.inf)
    if method == "none":
        w = m.float()
    elif method == "tis_token":
        truncated = (lr > math.log(cap)) & m
        w = torch.exp(lr.clamp(max=math.log(cap)))
    elif method == "mis_token":
        keep = (lr >= log_lo) & (lr <= log_hi)
        w = torch.where(keep, torch.exp(lr), zero)
    else:
        L_raw = _per_seq_sum(lr, ids, S)
        L = L_raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # product weights: exp must not overflow
        if method == "tis_sequence":
            per = torch.exp(L.clamp(max=math.log(cap)))
            truncated = _broadcast((L > math.log(cap)).float(), ids).bool() & m
        elif method == "mis_sequence":
            per = torch.where((L >= log_lo) & (L <= log_hi), torch.exp(L), torch.zeros_like(L))
        else:  # geo_mask
            # the mean of the (token-clamped) log-ratios, so |g| <= LOG_RATIO_CLAMP already; the
            # clamped sum L would cap g at 20 / n and keep every sequence of 29+ tokens
            n = _per_seq_sum(m.float(), ids, S).clamp(min=1.0)
            g = L_raw / n
            per = ((g >= log_lo) & (g <= log_hi)).float()
        w = _broadcast(per, ids)
    w = torch.where(m, w, zero)
    masked = (w == 0) & m
    seq_masked = 0.0
    if S:
        per_seq_kept = _per_seq_sum((~masked & m).float(), ids, S)
        seq_masked = float((per_seq_kept == 0).float().mean())
    metrics = {
        "correction/weight_mean": float(w[m].mean()) if m.any() else 0.0,
        "correction/masked_token_frac": float(masked.sum()) / n_tok,
        "correction/truncated_token_frac": float(truncated.sum()) / n_tok,
        "correction/masked_seq_frac": seq_masked,
    }
    return w.detach(), metrics


def rejection_stats(
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    *,
    seq_index: Tensor | None = None,
    reject: Literal["k1", "k2", "k3"] | None = None,
    threshold: float = 0.01,
) -> tuple[Tensor, dict[str, float]]:
    """Per-sequence KL estimators of the mismatch and an optional rejection mask.

    Schulman, "Approximating KL Divergence" (2020): with samples from pi_behav and
    ``log r = log pi_prox - log pi_behav`` per token, ``k1 = -log r``, ``k2 = (log r)^2 / 2``,
    ``k3 = (r - 1) - log r`` estimate KL(pi_behav || pi_prox); each is averaged over a
    sequence's tokens. With ``reject = "k"`` a sequence whose mean estimator exceeds
    ``threshold`` is rejected (weight 0 for all its tokens).

    Args:
        proximal_logprobs / behaviour_logprobs / mask: ``[B, T]``.
        seq_index: ``[B, T]`` or None (one sequence per row).
        reject: Which estimator rejects, or None (statistics only). threshold: nats per token.

    Returns:
        ``(keep [B, T] float32 (1 kept, 0 rejected or masked), metrics)`` with
        ``mismatch/k1_mean``, ``mismatch/k2_mean``, ``mismatch/k3_mean`` (means over
        sequences), ``mismatch/k3_max`` and ``mismatch/rejected_seq_frac``.

    Raises:
        ValueError: bad shapes or an unknown estimator.
    """
    m = _check_token_tensors(mask, proximal_logprobs=proximal_logprobs, behaviour_logprobs=behaviour_logprobs)
    if reject not in (None, "k1", "k2", "k3"):
        raise ValueError(f"reject must be None, 'k1', 'k2' or 'k3', got {reject!r}")
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    lr = torch.where(m, proximal_logprobs.detach().float() - behaviour_logprobs.detach().float(), zero)
    lr = torch.nan_to_num(lr, nan=0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ids, S = _seq_ids(mask, seq_index)
    if S == 0:
        return torch.zeros_like(lr), {"mismatch/k1_mean": 0.0, "mismatch/k2_mean": 0.0, "mismatch/k3_mean": 0.0,
                                      "mismatch/k3_max": 0.0, "mismatch/rejected_seq_frac": 0.0}
    n = _per_seq_sum(m.float(), ids, S).clamp(min=1.0)
    ks = {
        "k1": _per_seq_sum(torch.where(m, -lr, zero), ids, S) / n,
        "k2": _per_seq_sum(torch.where(m, 0.5 * lr * lr, zero), ids, S) / n,
        "k3": _per_seq_sum(torch.where(m, torch.expm1(lr) - lr, zero), ids, S) / n,
    }
    rejected = ks[reject] > threshold if reject else torch.zeros(S, dtype=torch.bool)
    keep = torch.where(m, _broadcast((~rejected).float(), ids), zero)
    metrics = {f"mismatch/{k}_mean": float(v.mean()) for k, v in ks.items()}
    metrics["mismatch/k3_max"] = float(ks["k3"].max())
    metrics["mismatch/rejected_seq_frac"] = float(rejected.float().mean())
    return keep, metrics


def aggregation_weights(
    mask: Tensor,
    mode: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"] = "token_mean",
    *,
    seq_index: Tensor | None = None,
    constant: float | None = None,
) -> tuple[Tensor, float]:
    """Per-token weights and this micro-batch's share of the normaliser for a loss-aggregation mode.

    The trainer sums ``weight_t * loss_t`` over all micro-batches of an optimiser step and
    divides by the sum of the normaliser shares, which gives exactly:

    * ``token_mean`` (DAPO, arXiv 2503.14476 sec. 3.3): ``sum_t loss_t / N_tokens``; weights 1,
      share = counted tokens.
    * ``seq_mean_token_mean`` (original GRPO, arXiv 2402.03300 eq. 3): ``mean_s (mean_{t in s}
      loss_t)``; weights ``1 / n_s``, share = sequences.
    * ``seq_mean_token_sum``: ``mean_s (sum_{t in s} loss_t)``; weights 1, share = sequences.
    * ``constant`` (Dr. GRPO, arXiv 2503.20783: no ``1/|o|`` normalisation):
      ``sum_t loss_t / (S * constant)`` with ``constant`` in tokens (e.g. max new tokens);
      weights 1, share = sequences x constant.

    Tokens masked out by a loss (clipping, DIS, discrepancy filter) stay in these
    denominators; only ``mask`` (prompt / padding) leaves them.

    Args:
        mask: ``[B, T]``. mode: One of ``AGGREGATIONS``.
        seq_index: ``[B, T]`` sequence of each position, or None (one sequence per row).
        constant: Tokens, required (> 0) for ``constant``.

    Returns:
        ``(weights [B, T] float32, 0 where masked; normaliser share float)``.

    Raises:
        ValueError: unknown mode or a missing / non-positive constant.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {AGGREGATIONS}")
    m = mask != 0
    ids, S = _seq_ids(mask, seq_index)
    ones = m.float()
    if mode == "token_mean":
        return ones, float(m.sum())
    if mode == "seq_mean_token_mean":
        n = _per_seq_sum(ones, ids, S).clamp(min=1.0)
        return torch.where(m, _broadcast(1.0 / n, ids), torch.zeros(())), float(S)
    if mode == "seq_mean_token_sum":
        return ones, float(S)
    if constant is None or not constant > 0:
        raise ValueError(f"loss aggregation 'constant' needs a constant > 0 (tokens), got {constant}")
    return ones, float(S) * float(constant)


def interpolation_alpha(versions: Tensor, current_version: int) -> Tensor:
    """AReaL's per-token interpolation weight ``alpha = (v_prox - v_behav) / (v_theta - v_behav)``.

    MISSION.md section 2. The update from ``current_version`` (parameters theta at version v)
    produces v + 1, the proximal policy is the one before it: ``v_prox = v``, ``v_theta = v + 1``,
    ``v_behav`` = the token's version. So ``alpha = k / (k + 1)`` for a token ``k`` versions old
    (0 for fresh data, 1/2, 2/3, 3/4 for gaps 1, 2, 3).

    Args:
        versions: ``[B, T]`` int64 policy version of each token (negative = not a response token,
            alpha 0). current_version: The trainer's version v.

    Returns:
        ``[B, T]`` float32 alpha in ``[0, 1)``.
    """
    v = versions.long()
    k = (current_version - v).clamp(min=0).float()
    return torch.where(v >= 0, k / (k + 1.0), torch.zeros((), dtype=torch.float32))


def interpolated_proximal(
    theta_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    alpha: Tensor,
    mask: Tensor,
    *,
    kind: Literal["loglinear", "linear"] = "loglinear",
) -> Tensor:
    """Interpolated proxy of the proximal policy's log-probs (no extra forward pass).

    MISSION.md section 2; AReaL ``prox_logp_method`` ``loglinear`` / ``linear``:

    * ``loglinear``: ``log pi_prox = log pi_behav + alpha (log pi_theta - log pi_behav)``
    * ``linear``: ``log pi_prox = log((1 - alpha) pi_behav + alpha pi_theta)`` (via logaddexp)

    These only rescale the clip bounds of the total ratio ``pi_theta / pi_behav`` (see
    :func:`effective_clip_bounds`); they recover no information about the true proximal policy.

    Args:
        theta_logprobs: ``[B, T]`` log pi_theta at the current parameters (detached here).
        behaviour_logprobs: ``[B, T]``. alpha: ``[B, T]`` in ``[0, 1]``. mask: ``[B, T]``.
        kind: ``loglinear`` or ``linear``.

    Returns:
        ``[B, T]`` float32 detached proximal log-probs (0 where masked).

    Raises:
        ValueError: unknown kind or bad shapes.
    """
    m = _check_token_tensors(mask, theta_logprobs=theta_logprobs, behaviour_logprobs=behaviour_logprobs, alpha=alpha)
    if kind not in ("loglinear", "linear"):
        raise ValueError(f"interpolation kind must be 'loglinear' or 'linear', got {kind!r}")
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    th = torch.where(m, theta_logprobs.detach().float(), zero)
    b = torch.where(m, behaviour_logprobs.detach().float(), zero)
    a = torch.where(m, alpha.float().clamp(0.0, 1.0), zero)
    if kind == "loglinear":
        out = b + a * (th - b)
    else:
        # log((1-a) e^b + a e^th); a = 0 or 1 handled by log(0) = -inf in logaddexp
        out = torch.logaddexp(torch.log1p(-a) + b, torch.log(a) + th)
    return torch.where(m, out, zero).detach()


def effective_clip_bounds(alpha: float, eps_low: float, eps_high: float, kind: Literal["loglinear", "linear"] = "loglinear") -> tuple[float, float]:
    """The bounds on the TOTAL ratio ``r = pi_theta / pi_behav`` at which decoupled PPO with an
    interpolated proximal policy clips (MISSION.md section 2).

    With ``u = pi_theta / pi_prox`` clipped to ``[1 - eps_low, 1 + eps_high]``:

    * loglinear: ``u = r^(1 - alpha)``, so ``r`` is clipped at ``(1 - eps_low)^(1/(1-alpha))`` and
      ``(1 + eps_high)^(1/(1-alpha))``;
    * linear: ``u = r / ((1 - alpha) + alpha r)``, so ``r = (1 - alpha) b / (1 - alpha b)`` at
      ``u = b`` (``+inf`` when ``alpha b >= 1``: that side never clips).

    Args:
        alpha: In ``[0, 1)``. eps_low / eps_high: PPO clip ranges. kind: interpolation kind.

    Returns:
        ``(low, high)`` bounds on ``r``.

    Raises:
        ValueError: alpha out of range or unknown kind.
    """
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha must be in [0, 1), got {alpha}")
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    if kind == "loglinear":
        return lo ** (1.0 / (1.0 - alpha)), hi ** (1.0 / (1.0 - alpha))
    if kind == "linear":
        def inv(b: float) -> float:
            return math.inf if alpha * b >= 1.0 else (1.0 - alpha) * b / (1.0 - alpha * b)
        return inv(lo), inv(hi)
    raise ValueError(f"interpolation kind must be 'loglinear' or 'linear', got {kind!r}")
