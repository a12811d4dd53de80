"""Policy-gradient losses as pure functions of padded token tensors.

Conventions (all functions):
    * ``B`` = sequences in the (micro-)batch, ``T`` = padded response tokens. Every per-token
      tensor is ``[B, T]``; ``mask [B, T]`` is bool or numeric, non-zero for the response tokens
      that count (prompt and padding are 0). Values at masked positions are ignored entirely,
      even NaN / inf (they contribute nothing to the loss, the gradient or the metrics).
    * Log-probs are natural-log, per token. Gradient flows only through ``logprobs``
      (pi_theta); every other input (old / proximal / behaviour / reference log-probs,
      advantages) is treated as data and detached.
    * Ratio math runs in float32 even for bf16 / fp16 inputs (float64 stays float64).
      Log-ratios are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp`` so a
      ratio can never overflow (as verl does: ``torch.clamp(negative_approx_kl, -20, 20)`` in
      ``verl/trainer/ppo/core_algos.py``); outside that range the token's gradient is zero.
    * A loss returns a ``LossOutput`` of SUMS: the trainer divides ``loss_sum`` by the GLOBAL
      number of counted tokens of the whole optimiser step (all micro-batches, all ranks), which
      gives an exact global token-mean (DAPO's token-level policy-gradient loss, arXiv 2503.14476
      section 3.3; not a mean of micro-batch means). ``aggregate`` does the same for the metrics.

Adding a loss: compute the per-token loss ``[B, T]`` (reusing ``_clipped_surrogate`` and the
``_masked_*`` reducers), return ``LossOutput(loss_sum, num_tokens, metrics)`` with metric names
that follow the suffix rules of ``LossOutput``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "LOG_RATIO_CLAMP",
    "LossOutput",
    "aggregate",
    "ppo_clip_loss",
    "decoupled_ppo_loss",
    "two_ratio_loss",
    "dis_loss",
    "DIS_PRESETS",
    "kl_penalty",
]

LOG_RATIO_CLAMP = 20.0
"""Log-ratios (and log importance weights) are clamped to +-20 before exp (exp(20) ~ 4.9e8)."""


# --------------------------------------------------------------------------------------------
# Output type and micro-batch aggregation
# --------------------------------------------------------------------------------------------


@dataclass
class LossOutput:
    """What a loss function returns: sums over the counted tokens of one micro-batch.

    Attributes:
        loss_sum: Scalar tensor, the SUM over counted tokens of the per-token loss (weights such
            as behaviour importance weights already applied). Carries the gradient. Divide it
            by the global token count of the optimiser step before ``backward``.
        num_tokens: Scalar float tensor, the number of counted tokens (``mask`` non-zero).
        metrics: Detached scalar tensors, named by suffix so that micro-batches combine
            exactly (see ``aggregate``):

            * ``<name>_sum``: a sum over counted tokens -> ``<name>_mean``.
            * ``<name>_sq_sum``: a sum of squares; with ``<name>_sum`` -> ``<name>_std``.
            * ``<name>_count``: a number of counted tokens -> ``<name>_frac``.
            * ``<name>_max`` / ``<name>_min``: extremes over counted tokens (``-inf`` / ``+inf``
              when the micro-batch counts no token, the identities of max / min).
            * anything else: summed across micro-batches and reported under its own name.
    """

    loss_sum: Tensor
    num_tokens: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


def aggregate(outputs: Sequence[LossOutput]) -> dict[str, float]:
    """Combine the ``LossOutput`` of several micro-batches into loggable means and fractions.

    The result is exactly what the same loss would report on the concatenated batch: sums are
    added and divided once by the total token count (a global token-mean), maxima / minima are
    combined with max / min.

    Args:
        outputs: One ``LossOutput`` per micro-batch (any ``B``, ``T``), all with the same metric
            names.

    Returns:
        ``{"loss": sum(loss_sum) / N, "num_tokens": N, ...}`` with ``N`` the total token count,
        plus, per metric (rules in ``LossOutput``): ``<name>_mean`` = total / N,
        ``<name>_std`` = sqrt(E[x^2] - E[x]^2), ``<name>_frac`` = count / N, ``<name>_max``,
        ``<name>_min``, and totals for other names. When ``N == 0`` every mean, fraction,
        std, max and min is ``0.0`` so that logs never hold NaN or inf.

    Raises:
        ValueError: ``outputs`` is empty, or the outputs do not have the same metric names.
    """
    if len(outputs) == 0:
        raise ValueError("outputs must hold at least one LossOutput")
    keys = set(outputs[0].metrics)
    for i, out in enumerate(outputs):
        if set(out.metrics) != keys:
            raise ValueError(
                f"outputs[{i}] has metric names {sorted(out.metrics)}, expected {sorted(keys)} "
                "(as in outputs[0])"
            )

    n = sum(float(out.num_tokens) for out in outputs)

    def mean(total: float) -> float:
        return total / n if n > 0 else 0.0

    result: dict[str, float] = {
        "loss": mean(sum(float(out.loss_sum.detach()) for out in outputs)),
        "num_tokens": n,
    }
    for key in sorted(keys):
        values = [float(out.metrics[key]) for out in outputs]
        if key.endswith("_sq_sum"):
            base = key[: -len("_sq_sum")]
            if f"{base}_sum" in keys:
                mean_x = mean(sum(float(out.metrics[f"{base}_sum"]) for out in outputs))
                var = mean(sum(values)) - mean_x * mean_x
                result[f"{base}_std"] = math.sqrt(max(var, 0.0))
            else:
                result[f"{base}_sq_mean"] = mean(sum(values))
        elif key.endswith("_sum"):
            result[f"{key[: -len('_sum')]}_mean"] = mean(sum(values))
        elif key.endswith("_count"):
            result[f"{key[: -len('_count')]}_frac"] = mean(sum(values))
        elif key.endswith("_max"):
            result[key] = max(values) if n > 0 else 0.0
        elif key.endswith("_min"):
            result[key] = min(values) if n > 0 else 0.0
        else:
            result[key] = sum(values)
    return result


# --------------------------------------------------------------------------------------------
# Validation and masked reductions (shared by every loss)
# --------------------------------------------------------------------------------------------


def _check_token_tensors(mask: Tensor, **tensors: Tensor) -> Tensor:
    """Validate ``[B, T]`` inputs; return the mask as bool."""
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        shape = list(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a tensor of shape [B, T], got {shape}")
    if mask.is_complex():
        raise ValueError(f"mask must be bool or real, got dtype {mask.dtype}")
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != mask.shape:
            raise ValueError(
                f"{name} must have the shape of mask [B, T] = {list(mask.shape)}, "
                f"got {list(t.shape)}"
            )
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    return mask != 0


def _compute_dtype(t: Tensor) -> torch.dtype:
    """float32 for bf16 / fp16 / fp32 inputs, float64 for float64 inputs."""
    return torch.promote_types(t.dtype, torch.float32)


def _check_clip(eps_low: float, eps_high: float, dual_clip: float | None) -> None:
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low}")
    if not eps_high >= 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (Ye et al. 2020) or None, got {dual_clip}")


def _masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of ``x [B, T]`` over ``mask [B, T]`` (bool); 0 for empty / all-masked input."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()


def _masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Max of ``x`` over ``mask``; ``-inf`` when no token counts."""
    neg_inf = torch.full((), -math.inf, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return neg_inf
    return torch.where(mask, x, neg_inf).amax()


def _masked_min(x: Tensor, mask: Tensor) -> Tensor:
    """Min of ``x`` over ``mask``; ``+inf`` when no token counts."""
    pos_inf = torch.full((), math.inf, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return pos_inf
    return torch.where(mask, x, pos_inf).amin()


def _weighted(loss: Tensor, token_weights: Tensor | None, mask: Tensor) -> Tensor:
    """``loss * token_weights`` (detached, validated ``[B, T]``); ``loss`` when None."""
    if token_weights is None:
        return loss
    _check_token_tensors(mask, token_weights=token_weights)
    w = torch.where(mask, token_weights.detach().to(loss.dtype), torch.zeros((), dtype=loss.dtype, device=loss.device))
    return loss * w  # masked weights zeroed first: a NaN there must not reach the gradient


def _masked_log_ratio(num: Tensor, den: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``log(num / den)`` from log-probs, in ``dtype``, 0 at masked positions, clamped."""
    log_ratio = num.to(dtype) - den.to(dtype)
    log_ratio = torch.where(mask, log_ratio, torch.zeros((), dtype=dtype, device=num.device))
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _ratio_metrics(
    prefix: str, ratio: Tensor, log_ratio: Tensor, mask: Tensor
) -> tuple[dict[str, Tensor], Tensor]:
    """Sum / sum of squares / max / min of a ratio over ``mask``, and the sum of its k3."""
    ratio = ratio.detach()
    k3 = (ratio - 1.0) - log_ratio.detach()                  # Schulman's k3 of KL(q || p)
    return {
        f"{prefix}_sum": _masked_sum(ratio, mask),
        f"{prefix}_sq_sum": _masked_sum(ratio.square(), mask),
        f"{prefix}_max": _masked_max(ratio, mask),
        f"{prefix}_min": _masked_min(ratio, mask),
    }, _masked_sum(k3, mask)


# --------------------------------------------------------------------------------------------
# PPO clipped surrogate
# --------------------------------------------------------------------------------------------


def _clipped_surrogate(
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO-clip loss ``[B, T]`` (unmasked values; reduce with ``_masked_sum``).

    ``log_ratio``, ``advantages``: ``[B, T]`` in the compute dtype, already 0 where masked.
    Returns the per-token loss and the metrics (sums over ``mask``).
    """
    ratio = torch.exp(log_ratio)                                       # r = pi_theta / pi_old
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)         # clip(r, 1-e_l, 1+e_h)
    loss_unclipped = -advantages * ratio                               # -r A
    loss_clipped = -advantages * clipped_ratio                         # -clip(r) A
    loss = torch.maximum(loss_unclipped, loss_clipped)                 # -min(r A, clip(r) A)

    negative = advantages < 0
    if dual_clip is not None:
        bound = -dual_clip * advantages                                # -c A  (> 0 for A < 0)
        dual_active = negative & (loss > bound) & mask
        loss = torch.where(negative, torch.minimum(loss, bound), loss)  # min(., -c A) for A < 0
    else:
        dual_active = torch.zeros_like(mask)

    with torch.no_grad():
        # The clipped branch is the active one (its gradient is zero), by side:
        clip_high = (advantages > 0) & (ratio > 1.0 + eps_high) & mask
        clip_low = negative & (ratio < 1.0 - eps_low) & mask
        stats, approx_kl_sum = _ratio_metrics("ratio", ratio, log_ratio, mask)
        count_dtype = ratio.dtype
        metrics = {
            "clip_low_count": clip_low.sum().to(count_dtype),
            "clip_high_count": clip_high.sum().to(count_dtype),
            "dual_clip_count": dual_active.sum().to(count_dtype),
            **stats,
            "approx_kl_sum": approx_kl_sum,
        }
    return loss, metrics


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    token_weights: Tensor | None = None,
) -> LossOutput:
    """PPO clipped surrogate loss, summed over the counted tokens.

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv 1707.06347, eq. 7
    (L^CLIP), as a loss to minimise, per token ``t``:

        r_t = exp(logprobs_t - old_logprobs_t) = pi_theta / pi_old
        loss_t = -min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t)

    Separate ``eps_low`` / ``eps_high`` is DAPO's clip-higher (Yu et al. 2025, arXiv
    2503.14476, section 3.1 "Clip-Higher"; DAPO uses ``eps_low = 0.2``, ``eps_high = 0.28``). With ``dual_clip = c``
    (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", arXiv 1912.09729,
    dual-clip PPO; c > 1), tokens with ``A_t < 0`` get ``loss_t = min(loss_t, -c * A_t)``: the objective
    ``max(min(r A, clip(r) A), c A)`` bounds the loss of a negative-advantage token whose ratio
    exploded. The clipped policy term matches torchtune's ``PPOLoss``
    (``torchtune/rlhf/loss/ppo.py``, symmetric eps) and AReaL's ``ppo_actor_loss_fn``
    (``areal/utils/functional.py``: ``eps_clip`` / ``eps_clip_higher`` / ``c_clip``).

    Args:
        logprobs: ``[B, T]`` log pi_theta of the sampled tokens, floating (bf16 ok); carries the
            gradient.
        old_logprobs: ``[B, T]`` log pi_old (the policy the ratio is taken against), detached.
        advantages: ``[B, T]`` per-token advantages, detached.
        mask: ``[B, T]`` bool or numeric; non-zero for tokens that count.
        eps_low: Lower clip range, ``0 <= eps_low < 1``.
        eps_high: Upper clip range, ``>= 0``.
        dual_clip: Dual-clip constant ``c > 1``, or None for no dual clip.
        token_weights: Optional ``[B, T]`` detached per-token weights multiplying ``loss_t``
            (mismatch corrections, loss aggregation modes; see ``conveyor.trainer.corrections``).

    Returns:
        ``LossOutput`` with ``loss_sum`` (sum of ``loss_t`` over counted tokens, float32 or
        float64), ``num_tokens`` and metrics: ``clip_low_count`` (A < 0 and r < 1 - eps_low),
        ``clip_high_count`` (A > 0 and r > 1 + eps_high), ``dual_clip_count`` (the dual-clip
        bound is active), ``ratio_sum``, ``ratio_sq_sum``, ``ratio_max``, ``ratio_min`` and
        ``approx_kl_sum`` (Schulman's k3 estimator of KL(pi_old || pi_theta),
        ``(r - 1) - log r``, from "Approximating KL Divergence", joschu.net/blog/kl-approx.html,
        2020). An empty (``B = 0`` or ``T = 0``) or all-masked input gives ``loss_sum = 0``.

    Raises:
        ValueError: a tensor is not ``[B, T]`` like ``mask`` or not floating; ``eps_low``,
            ``eps_high`` or ``dual_clip`` is out of range.
    """
    m = _check_token_tensors(
        mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages
    )
    _check_clip(eps_low, eps_high, dual_clip)
    dtype = _compute_dtype(logprobs)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)

    log_ratio = _masked_log_ratio(logprobs, old_logprobs.detach(), m, dtype)
    adv = torch.where(m, advantages.detach().to(dtype), zero)
    loss, metrics = _clipped_surrogate(log_ratio, adv, m, eps_low, eps_high, dual_clip)
    return LossOutput(
        loss_sum=_masked_sum(_weighted(loss, token_weights, m), m),
        num_tokens=m.sum().to(dtype),
        metrics=metrics,
    )


# --------------------------------------------------------------------------------------------
# Decoupled PPO (asynchronous training with a proximal policy)
# --------------------------------------------------------------------------------------------


def decoupled_ppo_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    behaviour_weight_cap: float | None = None,
    cap_mode: Literal["clamp", "mask"] = "clamp",
    token_weights: Tensor | None = None,
    behaviour_weights: Tensor | None = None,
) -> LossOutput:
    """Decoupled PPO loss: PPO clipping against pi_prox, importance-weighted by pi_prox/pi_behav.

    Hilton, Cobbe & Schulman 2021, "Batch size-invariance for policy optimization", arXiv
    2110.00641 (the decoupled PPO objective); AReaL (Fu et al. 2025, arXiv 2505.24298) eq. 5,
    MISSION.md section 1. Per token ``t``:

        w_t = exp(proximal_logprobs_t - behaviour_logprobs_t) = pi_prox / pi_behav  (detached)
        u_t = exp(logprobs_t - proximal_logprobs_t)          = pi_theta / pi_prox
        loss_t = -w_t * min(u_t * A_t, clip(u_t, 1 - eps_low, 1 + eps_high) * A_t)

    ``w`` is computed and clamped in log space (``|log w| <= LOG_RATIO_CLAMP``) and never
    differentiated through. With ``proximal_logprobs == behaviour_logprobs`` (w = 1) this is
    exactly ``ppo_clip_loss(logprobs, behaviour_logprobs, ...)``. ``dual_clip`` applies to the
    clipped term before weighting, as in AReaL.

    Behaviour-weight cap (``behaviour_weight_cap = C``):
        * ``cap_mode="mask"``: AReaL's ``behav_imp_weight_cap`` (``ppo_actor_loss_fn`` in
          ``areal/utils/functional.py``: ``behav_mask = (behav_imp_weight <= cap) & loss_mask``,
          the weight is set to 0 elsewhere; its help text: "we filter out the tokens where
          behav_imp_weight exceeds behav_imp_weight_cap ... must be > 1.0"). Tokens with
          ``w > C`` contribute 0 to the loss and gradient but, as in AReaL, still count in
          ``num_tokens`` (the denominator is the response-token count).
        * ``cap_mode="clamp"``: truncated importance weight ``min(w, C)`` (clamped in log
          space): stale tokens still contribute, with a bounded weight.

    Args:
        logprobs: ``[B, T]`` log pi_theta, floating (bf16 ok); carries the gradient.
        proximal_logprobs: ``[B, T]`` log pi_prox (forward pass with the parameters before this
            update), detached.
        behaviour_logprobs: ``[B, T]`` log pi_behav recorded by the inference engine, detached.
        advantages: ``[B, T]`` per-token advantages, detached.
        mask: ``[B, T]`` bool or numeric; non-zero for tokens that count.
        eps_low: Lower clip range of ``u``, ``0 <= eps_low < 1``.
        eps_high: Upper clip range of ``u``, ``>= 0``.
        dual_clip: Dual-clip constant ``c > 1`` (see ``ppo_clip_loss``), or None.
        behaviour_weight_cap: ``C > 1``, or None for no cap.
        cap_mode: ``"clamp"`` or ``"mask"`` (see above); ignored when no cap is set.
        token_weights: Optional ``[B, T]`` detached weights multiplying ``loss_t`` (aggregation
            modes).
        behaviour_weights: Optional ``[B, T]`` detached weights used INSTEAD of the (capped)
            ``w_t``: a training-inference mismatch correction from
            ``conveyor.trainer.corrections.mismatch_weights`` (TIS / MIS / IcePop / sequence
            filters). The ``behaviour_weight_*`` metrics still describe the raw ``w``.

    Returns:
        ``LossOutput``: ``loss_sum`` (sum of ``loss_t``), ``num_tokens``, the ``ppo_clip_loss``
        metrics computed on ``u`` (``ratio_*`` is ``u``; ``approx_kl_sum`` is k3 of
        KL(pi_prox || pi_theta)), plus ``behaviour_weight_sum`` / ``_sq_sum`` / ``_max`` /
        ``_min`` (the uncapped ``w``), ``behaviour_weight_capped_count`` (tokens with
        ``w > C``: clamped or masked) and ``behaviour_approx_kl_sum`` (k3 of
        KL(pi_behav || pi_prox), ``(w - 1) - log w``). Empty or all-masked input gives 0 loss.

    Raises:
        ValueError: a tensor is not ``[B, T]`` like ``mask`` or not floating; ``eps_low``,
            ``eps_high``, ``dual_clip`` or ``behaviour_weight_cap`` is out of range;
            ``cap_mode`` is not ``"clamp"`` or ``"mask"``.
    """
    m = _check_token_tensors(
        mask,
        logprobs=logprobs,
        proximal_logprobs=proximal_logprobs,
        behaviour_logprobs=behaviour_logprobs,
        advantages=advantages,
    )
    _check_clip(eps_low, eps_high, dual_clip)
    if cap_mode not in ("clamp", "mask"):
        raise ValueError(f"cap_mode must be 'clamp' or 'mask', got {cap_mode!r}")
    if behaviour_weight_cap is not None and not behaviour_weight_cap > 1.0:
        raise ValueError(
            f"behaviour_weight_cap must be > 1 (as AReaL requires) or None, "
            f"got {behaviour_weight_cap}"
        )
    dtype = _compute_dtype(logprobs)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)

    prox = proximal_logprobs.detach()
    log_u = _masked_log_ratio(logprobs, prox, m, dtype)                  # log pi_theta/pi_prox
    adv = torch.where(m, advantages.detach().to(dtype), zero)
    loss, metrics = _clipped_surrogate(log_u, adv, m, eps_low, eps_high, dual_clip)

    log_w = _masked_log_ratio(prox, behaviour_logprobs.detach(), m, dtype)  # log pi_prox/pi_behav
    w = torch.exp(log_w)
    if behaviour_weight_cap is None:
        exceeded = torch.zeros_like(m)
        w_applied = w
    else:
        log_cap = math.log(behaviour_weight_cap)
        exceeded = (log_w > log_cap) & m
        if cap_mode == "clamp":
            w_applied = torch.exp(log_w.clamp(max=log_cap))               # min(w, C)
        else:
            w_applied = torch.where(exceeded, zero, w)                    # drop w > C

    with torch.no_grad():
        w_stats, behaviour_kl_sum = _ratio_metrics("behaviour_weight", w, log_w, m)
        metrics.update(w_stats)
        metrics["behaviour_weight_capped_count"] = exceeded.sum().to(dtype)
        metrics["behaviour_approx_kl_sum"] = behaviour_kl_sum

    if behaviour_weights is not None:
        _check_token_tensors(mask, behaviour_weights=behaviour_weights)
        w_applied = torch.where(m, behaviour_weights.detach().to(dtype), zero)
    return LossOutput(
        loss_sum=_masked_sum(_weighted(w_applied * loss, token_weights, m), m),  # sum_t w_t * loss_t
        num_tokens=m.sum().to(dtype),
        metrics=metrics,
    )


# --------------------------------------------------------------------------------------------
# Two-ratio decomposition (discrepancy filter x staleness clip)
# --------------------------------------------------------------------------------------------


def two_ratio_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    discrepancy_low: float = 0.8,
    discrepancy_high: float = 1.25,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
    token_weights: Tensor | None = None,
) -> LossOutput:
    """Two-ratio loss: a symmetric discrepancy filter and an asymmetric staleness clip.

    arXiv 2605.12070 (MISSION.md section 2). The total ratio factorises as
    ``pi_theta / pi_behav = (pi_old_train / pi_behav) * (pi_theta / pi_old_train)``; per token:

        rho_d = exp(old_logprobs - behaviour_logprobs)   (discrepancy ratio, detached)
        rho_s = exp(logprobs - old_logprobs)             (staleness ratio)
        keep_t = discrepancy_low <= rho_d <= discrepancy_high
        loss_t = -keep_t * min(rho_s A, clip(rho_s, 1 - eps_low, 1 + eps_high) A)

    ``old_logprobs`` must be the TRAINING-side log-probs of the parameters that sampled each
    token (``proximal.method = snapshot`` / ``partial_sync`` / ``dedicated``, or an
    approximation: ``ewma``, ``recompute``), so that ``rho_d`` measures only the
    training-inference discrepancy (same parameters, different kernels / precision): symmetric
    noise, filtered (masked, not weighted) on both sides. Filtered tokens stay in the
    denominator (the trainer divides by all response tokens). The bounds are conveyor's defaults
    (symmetric in log space, ``log 1.25 = -log 0.8``); the paper tunes them per setting.

    Args:
        logprobs: ``[B, T]`` log pi_theta (carries the gradient).
        old_logprobs: ``[B, T]`` log pi_old_train, detached.
        behaviour_logprobs: ``[B, T]`` log pi_behav recorded by the inference engine, detached.
        advantages: ``[B, T]``, detached. mask: ``[B, T]``, non-zero for counted tokens.
        discrepancy_low / discrepancy_high: ``0 < low <= 1 <= high``.
        eps_low / eps_high / dual_clip: the staleness clip (see ``ppo_clip_loss``).
        token_weights: Optional ``[B, T]`` detached weights (aggregation modes).

    Returns:
        ``LossOutput``: the ``ppo_clip_loss`` metrics of ``rho_s`` (``ratio_*``, clip counts,
        ``approx_kl_sum``), ``discrepancy_keep_count`` (-> ``discrepancy_keep_frac``, the
        keep-rate MISSION.md section 2 monitors), ``discrepancy_low_count`` /
        ``discrepancy_high_count`` (filtered below / above) and ``discrepancy_*`` ratio stats.
        Empty or all-masked input gives 0 loss.

    Raises:
        ValueError: bad shapes / dtypes, or bounds out of range.
    """
    m = _check_token_tensors(
        mask, logprobs=logprobs, old_logprobs=old_logprobs, behaviour_logprobs=behaviour_logprobs, advantages=advantages
    )
    _check_clip(eps_low, eps_high, dual_clip)
    if not (0.0 < discrepancy_low <= 1.0 <= discrepancy_high):
        raise ValueError(f"need 0 < discrepancy_low <= 1 <= discrepancy_high, got {discrepancy_low}, {discrepancy_high}")
    dtype = _compute_dtype(logprobs)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    old = old_logprobs.detach()
    log_s = _masked_log_ratio(logprobs, old, m, dtype)
    adv = torch.where(m, advantages.detach().to(dtype), zero)
    loss, metrics = _clipped_surrogate(log_s, adv, m, eps_low, eps_high, dual_clip)
    log_d = _masked_log_ratio(old, behaviour_logprobs.detach(), m, dtype)
    low = (log_d < math.log(discrepancy_low)) & m
    high = (log_d > math.log(discrepancy_high)) & m
    keep = m & ~low & ~high
    with torch.no_grad():
        d_stats, _ = _ratio_metrics("discrepancy", torch.exp(log_d), log_d, m)
        metrics.update(d_stats)
        metrics["discrepancy_keep_count"] = keep.sum().to(dtype)
        metrics["discrepancy_low_count"] = low.sum().to(dtype)
        metrics["discrepancy_high_count"] = high.sum().to(dtype)
    loss = torch.where(keep, loss, zero)
    return LossOutput(
        loss_sum=_masked_sum(_weighted(loss, token_weights, m), m),
        num_tokens=m.sum().to(dtype),
        metrics=metrics,
    )


# --------------------------------------------------------------------------------------------
# SAO / DIS: double-sided hard mask on the behaviour ratio
# --------------------------------------------------------------------------------------------

DIS_PRESETS: dict[str, tuple[float, float]] = {"reasoning": (0.3, 5.0), "coding": (0.8, 3.0)}
"""``(eps_low, eps_high)`` of SAO's double-sided mask (arXiv 2607.07508; MISSION.md section 3)."""


def dis_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.3,
    eps_high: float = 5.0,
    token_weights: Tensor | None = None,
) -> LossOutput:
    """SAO's double-sided importance-sampling hard mask (DIS), no proximal policy.

    arXiv 2607.07508 (MISSION.md section 3). Per token, with ``r = pi_theta / pi_behav``:

        keep_t = 1 - eps_low < r_t < 1 + eps_high
        loss_t = -keep_t * r_t * A_t

    Outside the band the token's gradient is zero (masked, not clipped to the bound as in
    PPO); masked tokens stay in the denominator (token-mean over all response tokens). Presets
    (``DIS_PRESETS``): reasoning ``eps_low = 0.3, eps_high = 5.0``; coding ``0.8, 3.0``.

    Args:
        logprobs: ``[B, T]`` log pi_theta (gradient). behaviour_logprobs: ``[B, T]`` detached.
        advantages: ``[B, T]`` detached. mask: ``[B, T]``.
        eps_low: ``0 <= eps_low < 1``. eps_high: ``>= 0``.
        token_weights: Optional ``[B, T]`` detached weights (aggregation modes).

    Returns:
        ``LossOutput`` with ``dis_masked_low_count`` / ``dis_masked_high_count`` (tokens outside
        the band, by side), ``ratio_*`` stats of ``r`` and ``approx_kl_sum`` (k3 of
        KL(pi_behav || pi_theta)). Empty or all-masked input gives 0 loss.

    Raises:
        ValueError: bad shapes / dtypes or eps out of range.
    """
    m = _check_token_tensors(mask, logprobs=logprobs, behaviour_logprobs=behaviour_logprobs, advantages=advantages)
    _check_clip(eps_low, eps_high, None)
    dtype = _compute_dtype(logprobs)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    log_r = _masked_log_ratio(logprobs, behaviour_logprobs.detach(), m, dtype)
    ratio = torch.exp(log_r)
    adv = torch.where(m, advantages.detach().to(dtype), zero)
    with torch.no_grad():
        low = (ratio <= 1.0 - eps_low) & m
        high = (ratio >= 1.0 + eps_high) & m
    keep = m & ~low & ~high
    loss = torch.where(keep, -ratio * adv, zero)
    with torch.no_grad():
        stats, kl_sum = _ratio_metrics("ratio", ratio, log_r, m)
        metrics = {"dis_masked_low_count": low.sum().to(dtype), "dis_masked_high_count": high.sum().to(dtype),
                   **stats, "approx_kl_sum": kl_sum}
    return LossOutput(
        loss_sum=_masked_sum(_weighted(loss, token_weights, m), m),
        num_tokens=m.sum().to(dtype),
        metrics=metrics,
    )


# --------------------------------------------------------------------------------------------
# KL penalty to a reference policy
# --------------------------------------------------------------------------------------------


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kind: Literal["k1", "k2", "k3"] = "k3",
    *,
    token_weights: Tensor | None = None,
) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref), summed over the counted tokens.

    Schulman 2020, "Approximating KL Divergence" (joschu.net/blog/kl-approx.html): with the
    token sampled from pi_theta and ``log r = log pi_ref - log pi_theta``,

        k1 = -log r                  (unbiased, high variance, can be negative)
        k2 = (log r)^2 / 2           (biased, low variance, >= 0)
        k3 = (r - 1) - log r         (unbiased, low variance, >= 0)

    k3 is the estimator of GRPO (Shao et al. 2024, arXiv 2402.03300, eq. 4:
    ``pi_ref/pi_theta - log(pi_ref/pi_theta) - 1``). In off-policy training the tokens come
    from pi_behav, not pi_theta, so the estimate is approximate (as in GRPO). ``log r`` is
    clamped to ``+-LOG_RATIO_CLAMP`` before ``exp``.

    Aggregation: the penalty is aggregated exactly like the policy loss (verl
    ``verl/workers/utils/losses.py::ppo_loss``: ``agg_loss(kld, response_mask, loss_agg_mode)``;
    TRL ``GRPOTrainer._compute_loss`` adds ``beta * per_token_kl`` to the per-token loss before
    its aggregation): pass the aggregation mode's ``token_weights`` (see
    ``conveyor.trainer.corrections.aggregation_weights``), divide the weighted sum by the same
    normaliser as ``LossOutput.loss_sum`` and multiply by the KL coefficient.

    Args:
        logprobs: ``[B, T]`` log pi_theta, floating (bf16 ok); carries the gradient.
        ref_logprobs: ``[B, T]`` log pi_ref of the same tokens, detached.
        mask: ``[B, T]`` bool or numeric; non-zero for tokens that count.
        kind: ``"k1"``, ``"k2"`` or ``"k3"``.
        token_weights: Optional ``[B, T]`` detached per-token weights (e.g. ``1 / n_s`` for
            ``seq_mean_token_mean``); None = weight 1.

    Returns:
        Scalar tensor (float32, float64 for float64 inputs): the (weighted) sum of the estimator
        over the counted tokens; 0 for empty or all-masked input.

    Raises:
        ValueError: a tensor is not ``[B, T]`` like ``mask`` or not floating; unknown ``kind``.
    """
    if kind not in ("k1", "k2", "k3"):
        raise ValueError(f"kind must be 'k1', 'k2' or 'k3', got {kind!r}")
    m = _check_token_tensors(mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
    dtype = _compute_dtype(logprobs)
    log_r = _masked_log_ratio(ref_logprobs.detach(), logprobs, m, dtype)  # log pi_ref/pi_theta
    if kind == "k1":
        kl = -log_r
    elif kind == "k2":
        kl = 0.5 * log_r.square()
    else:
        kl = (torch.exp(log_r) - 1.0) - log_r
    return _masked_sum(_weighted(kl, token_weights, m), m)


def entropy_bonus(entropy: Tensor, mask: Tensor, *, token_weights: Tensor | None = None) -> Tensor:
    """The entropy bonus's sum ``sum_t w_t * H_t`` over the counted tokens, to be subtracted from
    the policy loss as ``coef * entropy_bonus / denominator`` (aggregated like the loss: same
    token weights and denominator; PPO's entropy bonus, arXiv 1707.06347 eq. 9; AsyPPO removes
    tokens from it through ``token_weights``, MISSION.md section 4).

    Args:
        entropy: ``[B, T]`` per-token entropy of the policy (nats), with gradient.
        mask: ``[B, T]`` bool or numeric; non-zero for tokens that count.
        token_weights: Optional ``[B, T]`` detached weights (aggregation, masking); None = 1.

    Returns:
        Scalar tensor: the weighted sum (nats); 0 for an all-masked input.

    Raises:
        ValueError: a tensor is not ``[B, T]`` like ``mask`` or not floating.
    """
    m = _check_token_tensors(mask, entropy=entropy)
    e = torch.where(m, entropy.to(_compute_dtype(entropy)), torch.zeros((), dtype=_compute_dtype(entropy)))
    return _weighted(e, token_weights, m).sum()
