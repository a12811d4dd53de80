"""Where the advantage goes: per-response credit by length and by position (diagnostics).

A policy gradient with a token-level aggregation pushes a response's log-probability by the sum
of its tokens' advantages, so a long response that earns nothing can still be reinforced when
its summed advantage is positive: a critic whose values rise along a response, or a lambda near
1 that credits the outcome to every token, gives early tokens positive advantages whatever the
outcome. Length drift toward the response limit is the failure SAO runs showed here (docs/results/
sao.md: truncated share rising to 1.0 while the reward stayed low). These functions turn the
advantages the loss used into the few numbers that make it visible in ``metrics.jsonl``:

- ``advantage/length_corr``: Pearson correlation, over the batch's responses, between a
  response's action-token count ``l_i`` and its summed advantage ``S_i = sum_t A_it``; clearly
  positive means longer responses are pushed up more.
- ``advantage/sum_rewarded`` / ``advantage/sum_unrewarded``: mean ``S_i`` over responses with
  reward ``> 0`` / ``<= 0``; an unrewarded mean above 0 reinforces responses that earned nothing.
- ``advantage/first_half_mean`` / ``advantage/second_half_mean``: token-mean advantage over the
  first half of every response's action tokens (rank ``k`` with ``2k < l``) and over the rest.

Pure functions of detached tensors, no gradient. ``S`` = responses, ``T`` = padded response
tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["per_response_credit", "credit_metrics"]

#: Columns of ``per_response_credit``'s output.
SUM, COUNT, FIRST_SUM, FIRST_COUNT = range(4)


@torch.no_grad()
def per_response_credit(advantages: Tensor, action_mask: Tensor) -> Tensor:
    """Per-response sums of the advantages, whole and over the first half of its action tokens.

    Args:
        advantages: ``[S, T]`` float, each response's token advantages in response order
            (observation and padding positions are ignored).
        action_mask: ``[S, T]`` non-zero on action tokens (the tokens the loss trains on).

    Returns:
        ``[S, 4]`` float64: ``sum_t A_t``, ``l`` (action tokens), the sum over the first half
        (action-token rank ``k``, 0-based, with ``2k < l``: 3 of 5, 1 of 1), that half's count.
        Rows of several responses can be added (every column is a sum), e.g. across processes.

    Raises:
        ValueError: the two tensors are not both ``[S, T]`` of one shape, or ``advantages`` is
            not floating.
    """
    if not isinstance(advantages, Tensor) or not isinstance(action_mask, Tensor) \
            or advantages.dim() != 2 or advantages.shape != action_mask.shape:
        shapes = [list(getattr(x, "shape", [])) for x in (advantages, action_mask)]
        raise ValueError(f"advantages and action_mask must both be [S, T] tensors of one shape, got {shapes}")
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must be a floating tensor, got dtype {advantages.dtype}")
    on = action_mask != 0
    a = torch.where(on, advantages.to(torch.float64), torch.zeros((), dtype=torch.float64))
    n = on.sum(-1, keepdim=True)
    rank = on.long().cumsum(-1) - 1                      # 0-based rank among the row's action tokens
    first = on & (2 * rank < n)
    return torch.stack([a.sum(-1), n.squeeze(-1).double(), torch.where(first, a, 0.0).sum(-1),
                        first.sum(-1).double()], dim=-1)


def _pearson(x: Tensor, y: Tensor) -> float | None:
    if x.numel() < 2:
        return None
    dx, dy = x - x.mean(), y - y.mean()
    den = float(dx.square().sum().sqrt() * dy.square().sum().sqrt())
    return float((dx * dy).sum()) / den if den > 0 else None


def credit_metrics(credit: Tensor, rewards: Tensor) -> dict[str, float]:
    """The ``advantage/*`` diagnostics of one step (see the module docstring) from
    ``per_response_credit``'s rows.

    Args:
        credit: ``[N, 4]`` rows of ``per_response_credit`` (one per response of the step).
        rewards: ``[N]`` the responses' scalar rewards (the ones the advantages were made from).

    Returns:
        ``{"advantage/length_corr", "advantage/sum_rewarded", "advantage/sum_unrewarded",
        "advantage/first_half_mean", "advantage/second_half_mean"}`` as floats; a key is left
        out where it is undefined (fewer than 2 responses with action tokens or no spread in
        length or summed advantage for the correlation; no response of that kind; no token in
        that half), never NaN. Responses without action tokens are left out of every figure.

    Raises:
        ValueError: ``credit`` is not ``[N, 4]`` or ``rewards`` not ``[N]``.
    """
    if not isinstance(credit, Tensor) or credit.dim() != 2 or credit.shape[1] != 4:
        raise ValueError(f"credit must be [N, 4] (per_response_credit), got {list(getattr(credit, 'shape', []))}")
    if not isinstance(rewards, Tensor) or rewards.shape != credit.shape[:1]:
        raise ValueError(f"rewards must be [N] = [{credit.shape[0]}], got {list(getattr(rewards, 'shape', []))}")
    c = credit.double()
    keep = c[:, COUNT] > 0
    c, r = c[keep], rewards.double()[keep]
    out: dict[str, float] = {}
    corr = _pearson(c[:, COUNT], c[:, SUM])
    if corr is not None:
        out["advantage/length_corr"] = corr
    for name, sel in (("sum_rewarded", r > 0), ("sum_unrewarded", r <= 0)):
        if bool(sel.any()):
            out[f"advantage/{name}"] = float(c[sel, SUM].mean())
    first_n, second_n = float(c[:, FIRST_COUNT].sum()), float((c[:, COUNT] - c[:, FIRST_COUNT]).sum())
    if first_n > 0:
        out["advantage/first_half_mean"] = float(c[:, FIRST_SUM].sum()) / first_n
    if second_n > 0:
        out["advantage/second_half_mean"] = float((c[:, SUM] - c[:, FIRST_SUM]).sum()) / second_n
    return out
