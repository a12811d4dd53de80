"""Sampling: per-request temperature / min-p / top-k / top-p / greedy, vectorised over the batch
by parameter group, by inverse CDF (one uniform number per token), recording the kept set of every
truncated draw. :func:`sample_from_logits` is the public entry point; the behaviour log-probs it
returns are defined in the :mod:`conveyor.rollout.engine` docstring."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from conveyor.rollout.engine.types import SamplingParams

_GREEDY, _PLAIN, _TRUNC = 0, 1, 2


@dataclass
class _SamplingPlan:
    """Per-batch sampling parameters, grouped so each group is one vectorised computation.

    ``groups`` holds ``(kind, rows, temperature [b, 1], top_k [b, 1], top_p [b, 1],
    min_p [b, 1])``; ``rows`` is None when the group covers the whole batch (no gather /
    scatter needed).
    """

    groups: list[
        tuple[int, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    ]
    needs_uniforms: bool
    on_device: dict = field(default_factory=dict)  # device -> this plan's copy there (_on)


def _make_plan(params: Sequence[SamplingParams]) -> _SamplingPlan:
    kinds = [_GREEDY if p.greedy else (_TRUNC if p.truncated else _PLAIN) for p in params]
    groups = []
    for kind in (_GREEDY, _PLAIN, _TRUNC):
        rows = [i for i, k in enumerate(kinds) if k == kind]
        if not rows:
            continue
        sel = [params[i] for i in rows]
        temp = torch.tensor([[p.temperature if p.temperature > 0 else 1.0] for p in sel])
        top_k = torch.tensor([[p.top_k] for p in sel], dtype=torch.long)
        top_p = torch.tensor([[float(p.top_p)] for p in sel])
        min_p = torch.tensor([[float(p.min_p)] for p in sel])
        idx = None if len(rows) == len(params) else torch.tensor(rows, dtype=torch.long)
        groups.append((kind, idx, temp, top_k, top_p, min_p))
    return _SamplingPlan(groups=groups, needs_uniforms=any(k != _GREEDY for k in kinds))


_CDF_BLOCK = 256  # vocabulary block size of the two-level inverse-CDF search
_TOP_P_CANDIDATES = 64  # first candidate-set size for top-p / min-p (grown x8 to hold the kept set)


def _inverse_cdf(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample one index per row of ``logp [b, V]`` (normalised log-probs, -inf allowed).

    Returns the first index whose cumulative probability reaches ``u * total`` (``u [b]`` in
    (0, 1]); never an index of probability zero. Two-level search to keep it cheap for a large
    vocabulary: float64 cumulative sums over blocks of ``_CDF_BLOCK`` tokens, then a cumulative
    sum inside the chosen block only.
    """
    b, vocab = logp.shape
    p = logp.exp()
    nblocks = -(-vocab // _CDF_BLOCK)
    if nblocks * _CDF_BLOCK != vocab:
        p = torch.nn.functional.pad(p, (0, nblocks * _CDF_BLOCK - vocab))
    blocks = p.view(b, nblocks, _CDF_BLOCK)
    bcdf = blocks.sum(-1, dtype=torch.float64).cumsum_(-1)  # [b, nblocks]
    target = (u.to(torch.float64) * bcdf[:, -1]).unsqueeze(-1)  # [b, 1] in (0, total]
    bi = torch.searchsorted(bcdf, target).clamp_(max=nblocks - 1)  # first block reaching target
    before = torch.where(bi > 0, bcdf.gather(-1, (bi - 1).clamp_(min=0)), 0.0)
    inner = blocks.gather(1, bi.unsqueeze(-1).expand(b, 1, _CDF_BLOCK)).squeeze(1)
    inner = inner.to(torch.float64).cumsum_(-1)  # [b, block]
    # target - before > 0 (the block was found with a strict <); clamp to the block's own total
    # so rounding can never push the search past the block's last token of non-zero mass.
    local = torch.minimum(target - before, inner[:, -1:])
    j = torch.searchsorted(inner, local).clamp_(max=_CDF_BLOCK - 1)
    return (bi * _CDF_BLOCK + j).squeeze(-1)


_Kept = list[torch.Tensor | None] | None  # per row: kept token ids (int32); None: no truncation


def _on(plan: _SamplingPlan, device: torch.device) -> _SamplingPlan:
    """``plan`` with its tensors on ``device`` (the logits' device; the plan itself when it is there:
    plans are built on the host, once per change of the running batch, and cached per device)."""
    if device.type == "cpu":
        return plan
    cached = plan.on_device.get(device)
    if cached is None:
        groups = [(kind, None if rows is None else rows.to(device), *(t.to(device) for t in rest))
                  for kind, rows, *rest in plan.groups]
        cached = plan.on_device[device] = _SamplingPlan(groups=groups, needs_uniforms=plan.needs_uniforms)
    return cached


def _sample_with_plan(
    logits: torch.Tensor, plan: _SamplingPlan, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, _Kept]:
    """Sample one token per row of ``logits [B, V]`` on their device; ``(tokens [B] int64,
    log-probs [B] float32, kept sets)`` on the host (kept sets int32, host)."""
    if logits.device.type != "cpu":
        tok, lp, kept = _sample_with_plan_on(logits, _on(plan, logits.device), u.to(logits.device))
        return tok.cpu(), lp.cpu(), kept  # (kept sets are made on the host)
    return _sample_with_plan_on(logits, plan, u)


def _sample_with_plan_on(
    logits: torch.Tensor, plan: _SamplingPlan, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, _Kept]:
    batch = logits.shape[0]
    if len(plan.groups) == 1 and plan.groups[0][1] is None:
        kind, _, temp, top_k, top_p, min_p = plan.groups[0]
        return _sample_group(logits, kind, temp, top_k, top_p, min_p, u)
    tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    kept_all: _Kept = None
    for kind, rows, temp, top_k, top_p, min_p in plan.groups:
        tok, lp, kept = _sample_group(
            logits.index_select(0, rows), kind, temp, top_k, top_p, min_p, u.index_select(0, rows)
        )
        tokens.index_copy_(0, rows, tok)
        logprobs.index_copy_(0, rows, lp)
        if kept is not None:
            kept_all = kept_all or [None] * batch
            for r, ids in zip(rows.tolist(), kept, strict=True):
                kept_all[r] = ids
    return tokens, logprobs, kept_all


def _min_p_threshold(top: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``[b, 1]`` min-p cut in scaled-logit space: ``p_v >= min_p * p_max`` iff
    ``z_v >= z_max + log(min_p)`` (``-inf`` when ``min_p = 0``: nothing is cut)."""
    return top + torch.log(min_p)


def _sample_group(
    x: torch.Tensor,
    kind: int,
    temp: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, _Kept]:
    x = x.float()
    if kind == _GREEDY:
        tok = x.argmax(-1)
        lp = x.gather(-1, tok.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, -1)
        return tok, lp, None
    s = x if bool((temp == 1.0).all()) else x / temp
    if kind == _PLAIN:
        logp = torch.log_softmax(s, -1)
        tok = _inverse_cdf(logp, u)
        return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1), None
    # vLLM v1 order: temperature, min-p, top-k, top-p (on the renormalised remainder)
    vals, order = _truncation_candidates(s, top_k, top_p, min_p)
    ranks = torch.arange(vals.shape[-1], device=vals.device).unsqueeze(0)
    drop = (top_k > 0) & (ranks >= top_k)
    if bool((min_p > 0).any()):
        drop = drop | (vals < _min_p_threshold(vals[:, :1], min_p))
    vals = vals.masked_fill(drop, -math.inf)
    if bool((top_p < 1.0).any()):
        # nucleus on the min-p / top-k-renormalised distribution; candidates hold the whole nucleus
        logz = _truncated_logz(s, vals, top_k, min_p)
        probs = (vals - logz).exp()
        mass_before = probs.cumsum(-1) - probs
        vals = vals.masked_fill(mass_before >= top_p, -math.inf)  # rank 0 is always kept
    logp = torch.log_softmax(vals, -1)
    pos = _inverse_cdf(logp, u)
    tok = order.gather(-1, pos.unsqueeze(-1)).squeeze(-1)
    # the kept set S_t: every mask above cuts a suffix of the descending order, so S_t is a prefix
    keep = vals > -math.inf
    kept = list(order[keep].to(torch.int32).cpu().split(keep.sum(-1).tolist()))  # (host: one copy)
    return tok, logp.gather(-1, pos.unsqueeze(-1)).squeeze(-1), kept


def _truncated_logz(
    s: torch.Tensor, vals: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """``[b, 1]`` log-normaliser of the min-p / top-k-truncated distribution: over the
    (already masked) candidates ``vals`` for rows with ``0 < top_k <= #candidates``, over the
    min-p-masked vocabulary otherwise."""
    if bool((min_p > 0).any()):
        thr = _min_p_threshold(s.max(-1, keepdim=True).values, min_p)
        full = torch.logsumexp(s.masked_fill(s < thr, -math.inf), -1, keepdim=True)
    else:
        full = torch.logsumexp(s, -1, keepdim=True)
    cand = torch.logsumexp(vals, -1, keepdim=True)
    return torch.where((top_k > 0) & (top_k <= vals.shape[-1]), cand, full)


def _truncation_candidates(
    s: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The most likely tokens of each row, sorted descending: ``(values [b, K], ids [b, K])``.

    ``K`` is large enough to hold every row's kept set (exact, not an approximation): start at
    ``max(top_k)`` (top-k only) or ``max(_TOP_P_CANDIDATES, max(top_k))``, grow 8x until every
    row is covered -- its top-k set is among the candidates, or min-p already cuts inside them,
    or they hold ``top_p`` of its (min-p / top-k-renormalised) mass -- and end with a full sort.
    """
    vocab = s.shape[-1]
    need_p = top_p < 1.0  # [b, 1]
    need_m = min_p > 0.0
    if not bool(need_p.any()) and not bool(need_m.any()):  # top-k only
        k_needed = int(torch.where(top_k > 0, top_k, vocab).max())
        if k_needed >= vocab:
            return s.sort(-1, descending=True)
        return s.topk(k_needed, -1)
    k = max(_TOP_P_CANDIDATES, int(top_k.max()))
    while k < vocab:
        vals, order = s.topk(k, -1)
        ranks = torch.arange(k, device=s.device).unsqueeze(0)
        thr = _min_p_threshold(vals[:, :1], min_p)
        covered = ((top_k > 0) & (top_k <= k)) | (need_m & (vals[:, -1:] < thr))
        if bool(need_p.any()):
            masked = vals.masked_fill(((top_k > 0) & (ranks >= top_k)) | (vals < thr), -math.inf)
            logz = _truncated_logz(s, masked, top_k, min_p)
            mass = (masked - logz).exp().sum(-1, keepdim=True)
            # a top-p row is covered when the candidates already hold top_p of its mass
            covered = covered | (need_p & (mass >= top_p))
        if bool(covered.all()):
            return vals, order
        k *= 8
    return s.sort(-1, descending=True)


def sample_from_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    uniforms: torch.Tensor,
    *,
    with_support: bool = False,
) -> (
    tuple[torch.Tensor, torch.Tensor]
    | tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]
):
    """Sample one token per row exactly as the engine does (exposed for tests and tools).

    Args:
        logits: ``[B, V]`` next-token logits (any float dtype; computed in float32).
        params: ``B`` sampling parameters, one per row (rows may differ).
        uniforms: ``[B]`` random numbers in ``(0, 1]`` (ignored for greedy rows). The token is
            the first index whose cumulative probability reaches ``uniforms * total``, in
            vocabulary order for untruncated rows and in descending-probability order for
            min-p / top-k / top-p rows.
        with_support: Also return each row's kept set.

    Returns:
        ``(tokens [B] int64, logprobs [B] float32)``: the sampled token ids and their natural-log
        probability under the distribution sampled from (see the package docstring). With
        ``with_support``, a third item: ``B`` int32 tensors of kept token ids (descending
        probability; the set the log-prob is normalised over), None for untruncated and greedy
        rows.

    Raises:
        ValueError: when the shapes of ``logits``, ``params`` and ``uniforms`` disagree.
    """
    if logits.ndim != 2 or logits.shape[0] != len(params) or uniforms.shape != (len(params),):
        raise ValueError(
            f"expected logits [B, V], B params and uniforms [B]; got logits "
            f"{tuple(logits.shape)}, {len(params)} params, uniforms {tuple(uniforms.shape)}"
        )
    tokens, logprobs, kept = _sample_with_plan(logits, _make_plan(params), uniforms)
    if not with_support:
        return tokens, logprobs
    return tokens, logprobs, kept if kept is not None else [None] * len(params)
