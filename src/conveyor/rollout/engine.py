"""Embedded inference engine: continuous batching with interruptible weight updates.

This is the rollout worker's generator (MISSION.md section 1, AReaL arXiv 2505.24298). One
background thread owns the model and runs a loop of forward passes over a *running batch*:

* **Continuous batching.** Requests join and leave the running batch between decode steps. New
  requests (and, after a weight update, every in-flight request) are *prefilled* in a separate
  forward pass over ``prompt + response-so-far`` and then merged into the running batch; finished
  requests are removed. The KV cache is kept across steps in preallocated per-layer buffers
  ``[B, H_kv, capacity, head_dim]`` that grow in chunks, so a decode step writes one column in
  place instead of re-concatenating the whole cache. Rows are *left padded*: the real tokens of
  row ``b`` occupy cache columns ``[pad[b], length)``; the engine passes its own 4-D boolean
  attention mask and per-row ``position_ids`` (= number of real tokens before the token), so
  results do not depend on which other requests share the batch. Merging (left-padding both
  caches to a common length) and removing rows (index-select plus trimming columns that are
  padding in every remaining row) copy the cache only when the batch composition changes.
* **Interruptible rollout.** :meth:`InferenceEngine.update_weights` hands new weights to the
  decode thread, which applies them *between* two steps: the tensors are copied into the model,
  the version is bumped, the KV cache of every in-flight request (computed with the old weights)
  is dropped, and ``prompt + partial response`` is re-encoded with the new weights before decoding
  continues. Each generated token records the policy version that produced it, so one response
  may span several versions; :attr:`GenerationOutput.num_interruptions` counts the updates a
  request lived through.
* **Sampling.** Per-request temperature / min-p / top-k / top-p / greedy, vectorised over the
  batch by parameter group. Every request draws its random numbers from its own ``torch.Generator``
  seeded from ``(engine seed, submission index)`` (or :attr:`SamplingParams.seed`), so the sampled
  tokens are reproducible for the same submission order no matter how requests were batched
  (log-probs agree up to float rounding, ~1e-6: padding and batch shapes change the arithmetic).
  Sampling is by inverse CDF: one uniform number per token.

Behaviour log-probs (``GenerationOutput.logprobs``) are natural-log probabilities of the sampled
token under the distribution actually sampled from: ``z = logits / T``, then min-p, top-k and
top-p truncation (in vLLM v1's order, ``vllm/v1/sample/sampler.py``) and renormalisation over
the kept set ``S_t``: ``log pi^S(a_t) = z_a - logsumexp_{v in S_t} z_v``. With any truncation
the engine also records ``S_t`` of every sampled token (``GenerationOutput.sampling_mask``, CSR
of token ids, :class:`~conveyor.types.SamplingMask`); the trainer replays it, renormalising the
proximal, current and reference log-probs over the same set
(:func:`conveyor.trainer.logprobs.token_logprobs`), so engine and trainer log-probs agree for
every sampling setting (sampling-mask replay, DeepSeek-V3.2 arXiv 2512.02556 section 3.1;
docs/design.md, "Truncated sampling: which log-probs"). Untruncated sampling (``top_p = 1``,
``top_k = 0``, ``min_p = 0``) stores no set (full vocabulary). Greedy decoding
(``temperature == 0``) records ``log_softmax(logits)`` of the argmax (i.e. at ``T = 1``) and no
set.

Threading: every public method is thread-safe. ``async generate`` may be awaited from any asyncio
event loop (the decode thread resolves the future with ``loop.call_soon_threadsafe``); results of
``generate_batch`` are delivered through :class:`concurrent.futures.Future`.

The engine supports full-attention decoder-only models from ``transformers`` whose attention
layers call ``cache.update(key, value, layer_idx)`` (the Llama family, e.g. SmolLM2).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from conveyor.faults import fault_point
from conveyor.sync import WeightUpdate
from conveyor.types import SamplingMask

log = logging.getLogger(__name__)

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"

_KV_GROWTH = 64  # extra cache columns allocated whenever a KV buffer is (re)allocated
_PREFILL_MAX_TOKENS = 8192  # padded tokens (rows x longest sequence) per prefill forward pass


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------------------------
# Public value types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's response.

    Attributes:
        max_new_tokens: Maximum number of generated tokens (>= 1). Generation also stops when
            ``len(prompt) + len(response)`` reaches the model's ``max_position_embeddings``
            (finish reason ``"length"`` in both cases).
        temperature: Softmax temperature (>= 0, finite). ``0`` means greedy decoding.
        top_p: Nucleus sampling mass in ``(0, 1]``; ``1`` disables it. Applied last, on the
            distribution renormalised after min-p and top-k; the smallest set of most likely
            tokens whose mass reaches ``top_p`` is kept.
        top_k: Keep only the ``top_k`` most likely tokens (>= 0); ``0`` disables it.
        min_p: Keep only tokens with ``p >= min_p * p_max`` under ``softmax(logits / T)``
            (vLLM / Nguyen et al. arXiv 2407.01082), in ``[0, 1]``; ``0`` disables it. Applied
            after temperature and before top-k / top-p, as vLLM v1 does (its min-p is an
            argmax-invariant logits processor run before ``apply_top_k_top_p``). The test is
            a probability ratio, so it commutes with top-k; it changes what top-p sees.
        stop: Stop strings. After every generated token the decoded response (special tokens
            skipped) is searched; when one occurs, generation stops with finish reason
            ``"stop"``. The stop string is *kept*: ``token_ids`` ends with the token that
            completed it and ``text`` is the decoding of all tokens, so it contains the stop
            string (plus any characters the last token adds after it). Checking decodes the
            whole response each step, O(response length) per token; use stop strings only
            when needed. A list is accepted and stored as a tuple.
        stop_token_ids: Token ids that end generation (finish reason ``"stop"``, the token is
            kept), in addition to the tokenizer's ``eos_token_id`` and the ids in the model's
            ``generation_config.eos_token_id``. A list is accepted and stored as a tuple.
        seed: Optional seed of this request's random stream. ``None`` derives it from the
            engine seed and the request's submission index.
        ignore_eos: Do not stop at the tokenizer's / model's end-of-sequence ids (vLLM's
            ``ignore_eos``): the response then has exactly ``max_new_tokens`` tokens unless a stop
            string or ``stop_token_ids`` ends it. For benchmarks that need controlled lengths.

    Raises:
        ValueError: on an invalid field; the message names the field.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, int | float)
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if (
            isinstance(self.top_p, bool)
            or not isinstance(self.top_p, int | float)
            or not (0.0 < self.top_p <= 1.0)
        ):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if (
            isinstance(self.min_p, bool)
            or not isinstance(self.min_p, int | float)
            or not (0.0 <= self.min_p <= 1.0)
        ):
            raise ValueError(
                f"min_p must be a number in [0, 1] (0 disables it), got {self.min_p!r}"
            )
        if isinstance(self.stop, str):
            raise ValueError(f"stop must be a tuple of strings, not a single string: {self.stop!r}")
        stop = tuple(self.stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain non-empty strings, got {s!r}")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids)
        for t in ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must contain ints >= 0, got {t!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0`` (argmax decoding)."""
        return self.temperature == 0

    @property
    def truncated(self) -> bool:
        """True when sampling is random and min-p, top-k or top-p removes tokens (a kept set is
        then recorded for every sampled token)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


@dataclass(frozen=True)
class GenerationOutput:
    """One finished request.

    Attributes:
        prompt_ids: The prompt token ids, length ``P``.
        token_ids: Generated token ids, length ``R`` (the eos / stop token is included when it
            was generated).
        logprobs: ``log pi_behav`` of each generated token (natural log, length ``R``) under the
            distribution actually sampled from (temperature, then min-p / top-k / top-p
            truncation and renormalisation over the kept set; greedy: ``log_softmax`` of the
            logits at ``T = 1``).
        versions: Policy version that produced each generated token, length ``R``
            (non-decreasing; several values when weights were updated mid-request).
        finish_reason: ``"stop"`` (eos, stop token or stop string), ``"length"``
            (``max_new_tokens`` or the model's context length) or ``"abort"`` (engine stopped).
        text: Decoded response (special tokens skipped).
        num_interruptions: Number of weight updates applied while this request was in the
            running batch (each one dropped its KV cache and re-encoded it).
        old_logprobs: Training-side log-probs of a prefix of ``token_ids`` under the version that
            sampled each token, filled by partial-rollout sync (``track_partials``; see
            :meth:`InferenceEngine.partial_requests`). The list object is shared with the
            engine's bookkeeping and may still grow after delivery (at the next weight update)
            until :meth:`InferenceEngine.partial_requests` stops returning the request. Empty
            otherwise.
        sampling_mask: The kept set of every generated token (length ``R``,
            :class:`~conveyor.types.SamplingMask`) when the request's sampling truncates
            (:attr:`SamplingParams.truncated`); None otherwise (full vocabulary).
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    text: str
    num_interruptions: int
    old_logprobs: list[float] = field(default_factory=list)
    sampling_mask: SamplingMask | None = None


@dataclass(frozen=True)
class PartialRequest:
    """A request's state at a pause, for partial-rollout sync (MISSION.md section 2, recovery 3).

    Attributes:
        rid: Request id. prompt_ids / token_ids / versions: copies (``R`` generated tokens).
        old_logprobs: The request's shared old-log-prob list (length <= R): extend it in place
            with the log-probs of ``token_ids[len(old_logprobs):]``.
        finished: True for a request that finished since the previous call.
        sampling_mask: The kept sets of ``token_ids`` (length ``R``) under truncated sampling,
            None otherwise; scoring renormalises over them like the trainer.
    """

    rid: int
    prompt_ids: list[int]
    token_ids: list[int]
    versions: list[int]
    old_logprobs: list[float]
    finished: bool
    sampling_mask: SamplingMask | None = None


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------

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


def _sample_with_plan(
    logits: torch.Tensor, plan: _SamplingPlan, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, _Kept]:
    batch = logits.shape[0]
    if len(plan.groups) == 1 and plan.groups[0][1] is None:
        kind, _, temp, top_k, top_p, min_p = plan.groups[0]
        return _sample_group(logits, kind, temp, top_k, top_p, min_p, u)
    tokens = torch.empty(batch, dtype=torch.long)
    logprobs = torch.empty(batch, dtype=torch.float32)
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
    ranks = torch.arange(vals.shape[-1]).unsqueeze(0)
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
    kept = list(order[keep].to(torch.int32).split(keep.sum(-1).tolist()))
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
        ranks = torch.arange(k).unsqueeze(0)
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
        probability under the distribution sampled from (see the module docstring). With
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


# --------------------------------------------------------------------------------------------
# KV cache with preallocated, left-padded rows
# --------------------------------------------------------------------------------------------


class _KVLayer(DynamicLayer):
    """One layer's KV cache: buffers ``[B, H_kv, capacity, D]`` filled up to ``length``.

    ``update`` writes the new keys / values in place and returns views of the filled part; the
    buffer grows by ``_KV_GROWTH`` columns (plus what is needed) when full. Columns outside
    ``[0, length)`` are never read; left-padding columns inside it hold zeros (finite values, so
    masked attention weights of exactly 0 never multiply a NaN).
    """

    def __init__(
        self, kbuf: torch.Tensor | None = None, vbuf: torch.Tensor | None = None, length: int = 0
    ):
        super().__init__()
        self.kbuf, self.vbuf, self.length = kbuf, vbuf, length
        if kbuf is not None:
            self.device = kbuf.device
            self.is_initialized = True
            self.keys = kbuf[:, :, :length]
            self.values = vbuf[:, :, :length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if self.kbuf is None or end > self.kbuf.shape[-2]:
            self.kbuf = _grow(self.kbuf, self.length, key_states, end + _KV_GROWTH)
            self.vbuf = _grow(self.vbuf, self.length, value_states, end + _KV_GROWTH)
        self.kbuf[:, :, self.length : end].copy_(key_states)
        self.vbuf[:, :, self.length : end].copy_(value_states)
        self.length = end
        self.keys = self.kbuf[:, :, :end]
        self.values = self.vbuf[:, :, :end]
        return self.keys, self.values


def _grow(buf: torch.Tensor | None, length: int, like: torch.Tensor, capacity: int) -> torch.Tensor:
    b, h, _, d = like.shape
    new = torch.zeros(b, h, capacity, d, dtype=like.dtype, device=like.device)
    if buf is not None and length:
        new[:, :, :length].copy_(buf[:, :, :length])
    return new


@dataclass
class _Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    deliver: Callable[[GenerationOutput | BaseException], None]
    max_new: int  # max_new_tokens clipped to the context length
    stop_ids: frozenset[int]
    uniforms: list[float]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    num_interruptions: int = 0
    finish_reason: str | None = None
    text: str | None = None
    cancelled: bool = False
    old_logprobs: list[float] = field(default_factory=list)
    # kept set of each sampled token (truncated sampling only); appended before token_ids, so a
    # concurrent snapshot of token_ids never has more tokens than support
    support: list[torch.Tensor] = field(default_factory=list)

    def sampling_mask(self, n: int) -> SamplingMask | None:
        """The kept sets of the first ``n`` tokens as CSR; None without truncation."""
        parts = self.support[:n]
        if not parts:
            return None
        sizes = torch.tensor([len(p) for p in parts], dtype=torch.int64)
        return SamplingMask(torch.cat(parts), torch.cat([sizes.new_zeros(1), sizes.cumsum(0)]))


@dataclass
class _Batch:
    """The running batch: requests, their KV cache, left padding and the next input token."""

    reqs: list[_Request]
    layers: list[_KVLayer]
    pad: torch.Tensor  # [B] int64: cache columns [pad[b], length) are row b's real tokens
    length: int  # filled cache columns
    pending: torch.Tensor  # [B] int64: last sampled token of each row, not yet in the cache
    plan: _SamplingPlan

    def cache(self) -> Cache:
        return Cache(layers=self.layers)


def _merge(a: _Batch | None, b: _Batch) -> _Batch:
    """Concatenate two batches along the batch dimension, left-padding to a common length."""
    if a is None or not a.reqs:
        return b
    length = max(a.length, b.length)
    oa, ob = length - a.length, length - b.length
    na = len(a.reqs)
    layers = []
    for la, lb in zip(a.layers, b.layers, strict=True):
        bufs = []
        for xa, xb in ((la.kbuf, lb.kbuf), (la.vbuf, lb.vbuf)):
            _, h, _, d = xa.shape
            new = torch.zeros(
                na + len(b.reqs), h, length + _KV_GROWTH, d, dtype=xa.dtype, device=xa.device
            )
            new[:na, :, oa:length].copy_(xa[:, :, : a.length])
            new[na:, :, ob:length].copy_(xb[:, :, : b.length])
            bufs.append(new)
        layers.append(_KVLayer(bufs[0], bufs[1], length))
    reqs = a.reqs + b.reqs
    return _Batch(
        reqs=reqs,
        layers=layers,
        pad=torch.cat([a.pad + oa, b.pad + ob]),
        length=length,
        pending=torch.cat([a.pending, b.pending]),
        plan=_make_plan([r.params for r in reqs]),
    )


def _select(batch: _Batch, keep: list[int]) -> _Batch | None:
    """Keep only rows ``keep`` and drop leading columns that are padding in all of them."""
    if not keep:
        return None
    if len(keep) == len(batch.reqs):
        return batch
    idx = torch.tensor(keep, dtype=torch.long)
    pad = batch.pad.index_select(0, idx)
    trim = int(pad.min())
    length = batch.length - trim
    layers = []
    for layer in batch.layers:
        bufs = []
        for x in (layer.kbuf, layer.vbuf):
            _, h, _, d = x.shape
            new = torch.empty(len(keep), h, length + _KV_GROWTH, d, dtype=x.dtype, device=x.device)
            new[:, :, :length].copy_(x[:, :, trim : batch.length].index_select(0, idx))
            bufs.append(new)
        layers.append(_KVLayer(bufs[0], bufs[1], length))
    reqs = [batch.reqs[i] for i in keep]
    return _Batch(
        reqs=reqs,
        layers=layers,
        pad=pad - trim,
        length=length,
        pending=batch.pending.index_select(0, idx),
        plan=_make_plan([r.params for r in reqs]),
    )


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------


@dataclass
class _PendingUpdate:
    update: WeightUpdate
    future: concurrent.futures.Future


class PromptTooLongError(ValueError):
    """A prompt fills the model's context (``len(prompt) >= max_position_embeddings``): nothing
    can be generated. Retrying cannot help; the rollout controller skips such a sample."""


class InferenceEngine:
    """Continuous-batching generator with interruptible weight updates (see the module docstring).

    Args:
        model: A ``transformers`` causal LM (full attention, e.g. Llama / SmolLM2). The engine
            owns it from now on: it is put in eval mode, cast to ``dtype`` in place when given,
            and its weights are overwritten by :meth:`update_weights`.
        tokenizer: The matching tokenizer (used for eos, padding and decoding).
        version: Policy version of the initial weights (stamped on generated tokens).
        max_batch_size: Maximum number of requests in the running batch (>= 1); further
            requests wait in a FIFO queue.
        seed: Engine seed; request ``i`` (0-based submission index) samples from a
            ``torch.Generator`` seeded with ``seed * 1_000_003 + i`` unless its
            :attr:`SamplingParams.seed` is set.
        num_threads: If given, the decode thread's intra-op thread count
            (``torch.set_num_threads`` inside that thread). torch's OpenMP setting is per
            thread but ``set_num_threads`` also changes a process-wide default read by threads
            created later; the engine restores that default, so only the decode thread is
            affected. None: the process default. On a CPU shared with a trainer, 1 avoids
            OpenMP spin-waiting against the other process (or set ``OMP_WAIT_POLICY=PASSIVE``).
        dtype: If given, the model is cast to this dtype (e.g. ``torch.bfloat16``); logits are
            always upcast to float32 before sampling. Weight updates are cast to the model dtype.
        track_partials: Remember finished requests until the next :meth:`partial_requests`
            call (partial-rollout sync needs them; off by default so nothing accumulates).
        reencode_on_update: After a weight update, drop the in-flight requests' KV caches and
            re-encode prompt + partial response with the new weights (AReaL; default). False
            keeps the caches computed with the old weights and continues decoding on top of
            them (PipelineRL's in-flight update): generation pauses only for the weight copy,
            but the new tokens attend to keys / values of the previous version.

    Attributes:
        model: The model (read it only while the engine is paused or stopped; the decode thread
            runs forward passes on it and :meth:`update_weights` overwrites its weights).
        tokenizer: The tokenizer passed in.

    Raises:
        ValueError: invalid arguments, or a model with non-full-attention (sliding / linear)
            layers.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        version: int = 0,
        max_batch_size: int = 32,
        seed: int = 0,
        num_threads: int | None = None,
        dtype: torch.dtype | None = None,
        track_partials: bool = False,
        reencode_on_update: bool = True,
    ) -> None:
        if not _is_int(version) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        if not _is_int(max_batch_size) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if not _is_int(seed):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if num_threads is not None and (not _is_int(num_threads) or num_threads < 1):
            raise ValueError(f"num_threads must be an int >= 1 or None, got {num_threads!r}")
        config = (
            model.config.get_text_config(decoder=True)
            if hasattr(model.config, "get_text_config")
            else model.config
        )
        layer_types = getattr(config, "layer_types", None)
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"InferenceEngine supports full-attention models only; layer_types={sorted(set(layer_types))}"
            )
        if dtype is not None:
            model.to(dtype)
        model.eval()
        self.model = model
        self.tokenizer = tokenizer
        self._num_layers = int(config.num_hidden_layers)
        self._max_positions = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        self._vocab_size = int(model.get_input_embeddings().num_embeddings)
        eos: set[int] = set()
        for source in (
            getattr(tokenizer, "eos_token_id", None),
            getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        ):
            if source is None:
                continue
            eos.update([source] if _is_int(source) else [int(t) for t in source])
        self._eos_ids = frozenset(eos)
        pad = getattr(tokenizer, "pad_token_id", None)
        self._pad_id = pad if _is_int(pad) else (min(eos) if eos else 0)
        self._targets = dict(model.state_dict())
        self._version = version
        self._accepted_version = version
        self._max_batch_size = max_batch_size
        self._seed = seed
        self._num_threads = num_threads

        self._cond = threading.Condition()
        self._model_lock = threading.Lock()
        self._waiting: deque[_Request] = deque()
        self._live: dict[int, _Request] = {}  # every submitted, unfinished, uncancelled request
        self._updates: list[_PendingUpdate] = []
        self._reencode: list[_Request] = []  # in flight, KV cache dropped by a weight update
        self._batch: _Batch | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stopped = False
        self._paused = False
        self._in_step = False
        self._failure: BaseException | None = None
        self._next_rid = 0
        self._stats = dict(
            busy_seconds=0.0,
            prefill_seconds=0.0,
            sample_seconds=0.0,
            generated_tokens=0,
            prefill_tokens=0,
            reencoded_tokens=0,
            decode_steps=0,
            num_requests=0,
            num_finished=0,
            num_aborted=0,
            num_weight_updates=0,
            weight_load_seconds=0.0,
            pause_seconds_total=0.0,
            num_threads=0,
        )
        self._track_partials = track_partials
        self._reencode_on_update = reencode_on_update
        self._finished_unscored: dict[int, _Request] = {}
        # batch size -> [decode steps, forward seconds]: the simulator's calibration
        self._decode_profile: dict[int, list[float]] = {}
        self._running_count = 0

    # ---------------------------------------------------------------- lifecycle

    @property
    def version(self) -> int:
        """Policy version of the weights currently loaded (tokens generated now carry it)."""
        return self._version

    @property
    def max_batch_size(self) -> int:
        """Maximum number of requests in the running batch."""
        return self._max_batch_size

    def start(self) -> None:
        """Start the background decode thread (idempotent while running).

        Requests submitted before ``start`` wait in the queue. After :meth:`stop`, ``start``
        may be called again.

        Raises:
            RuntimeError: the decode thread previously crashed (see the chained exception).
        """
        with self._cond:
            if self._failure is not None:
                raise RuntimeError("InferenceEngine decode thread failed") from self._failure
            if self._thread is not None:
                return
            self._stopping = False
            self._stopped = False
            self._thread = threading.Thread(target=self._loop, name="conveyor-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the decode thread and abort every unfinished request.

        In-flight and queued requests are resolved with ``finish_reason="abort"`` and whatever
        tokens they had; weight updates accepted before the call are still applied. New
        submissions raise ``RuntimeError`` until :meth:`start` is called again. Idempotent.
        """
        with self._cond:
            thread = self._thread
            self._stopping = True
            self._stopped = True
            self._cond.notify_all()
        if thread is not None:
            thread.join()
        with self._cond:
            self._thread = None
            updates, self._updates = self._updates, []
            leftover = [r for r in self._live.values() if not r.cancelled]
            self._live.clear()
            self._waiting.clear()
            self._reencode = []
            self._batch = None
            self._running_count = 0
            self._paused = False
            self._cond.notify_all()
        if updates:
            with self._model_lock:
                self._apply_updates(updates, leftover)
        for req in leftover:
            self._finish(req, FINISH_ABORT)

    def __enter__(self) -> InferenceEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def pause(self) -> None:
        """Stop scheduling forward passes after the current one; blocks until it has finished.

        Requests stay in the engine (queued or in flight, KV cache kept) and new ones may be
        submitted; weight updates are still applied while paused (the re-encoding of in-flight
        requests then happens at :meth:`resume`). Idempotent.
        """
        with self._cond:
            self._paused = True
            while (
                self._in_step
                and self._thread is not None
                and self._thread is not threading.current_thread()
            ):
                self._cond.wait()

    def resume(self) -> None:
        """Resume scheduling after :meth:`pause` (idempotent)."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        """True between :meth:`pause` and :meth:`resume`."""
        return self._paused

    def partial_requests(self, *, require_pause: bool = True) -> list[PartialRequest]:
        """Every request with generated tokens: in flight (running batch or awaiting
        re-encoding) and, with ``track_partials``, finished since the previous call (then
        forgotten). For partial-rollout sync: between :meth:`pause` and the next weight update,
        the caller scores each request's tokens not yet in ``old_logprobs`` with the outgoing
        parameters (still in :attr:`model`) and extends ``old_logprobs`` in place.

        With ``require_pause=False`` (a dedicated old-logit worker) the snapshot is taken under
        the engine's lock while it runs: the copies are consistent, and every token of a version
        the engine has already replaced is in them; newer tokens appear in later calls.

        Returns:
            A list of :class:`PartialRequest` (copies of the token lists, the shared
            ``old_logprobs`` list).

        Raises:
            RuntimeError: ``require_pause`` and the engine is running (not paused).
        """
        with self._cond:
            if require_pause and self._thread is not None and not self._stopped and not self._paused:
                raise RuntimeError("partial_requests() needs a paused engine: call pause() first")
            live = [r for r in self._live.values() if r.token_ids and not r.cancelled]
            done, self._finished_unscored = list(self._finished_unscored.values()), {}
            out = []
            for r, finished in [(r, False) for r in live] + [(r, True) for r in done]:
                tokens = list(r.token_ids)
                out.append(PartialRequest(r.rid, list(r.prompt_ids), tokens, list(r.versions),
                                          r.old_logprobs, finished,
                                          r.sampling_mask(len(tokens))))
        return out

    def stats(self) -> dict[str, Any]:
        """Counters since construction.

        Returns:
            A dict with ``busy_seconds`` (s of forward passes, prefill and decode),
            ``prefill_seconds`` (s, the prefill / re-encode part of it), ``sample_seconds``
            (s spent sampling), ``generated_tokens``, ``prefill_tokens`` (real tokens encoded
            by prefills, re-encodes included), ``reencoded_tokens`` (tokens re-encoded after
            weight updates), ``decode_steps``, ``num_requests`` (submitted), ``num_finished``
            (resolved with stop / length / abort), ``num_aborted``, ``num_weight_updates``,
            ``weight_load_seconds`` (s copying weights), ``pause_seconds_total`` (s generation
            was paused by weight updates: loading plus re-encoding), ``running`` (requests in
            the running batch, including those awaiting re-encoding), ``waiting`` (queued),
            ``version``, ``paused``, ``num_threads`` (intra-op threads of the decode thread,
            0 before it started) and ``decode_profile`` (``{batch size: [decode steps,
            seconds]}``, seconds of the decode forward passes, used with ``sample_seconds`` to
            calibrate ``conveyor simulate``).
        """
        with self._cond:
            out = dict(self._stats)
            out["decode_profile"] = {b: list(v) for b, v in self._decode_profile.items()}
            out["running"] = self._running_count
            out["waiting"] = len(self._waiting)
            out["version"] = self._version
            out["paused"] = self._paused
        return out

    # ---------------------------------------------------------------- submission

    def _make_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, deliver: Callable
    ) -> _Request:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.tolist()
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("prompt_ids must not be empty")
        for t in prompt:
            if not _is_int(t) or not (0 <= t < self._vocab_size):
                raise ValueError(f"prompt_ids must be ints in [0, {self._vocab_size}), got {t!r}")
        max_new = params.max_new_tokens
        if self._max_positions is not None:
            room = self._max_positions - len(prompt)
            if room < 1:
                raise PromptTooLongError(
                    f"prompt has {len(prompt)} tokens; the model's max_position_embeddings is "
                    f"{self._max_positions}, leaving no room to generate"
                )
            max_new = min(max_new, room)
        with self._cond:
            if self._failure is not None:
                raise RuntimeError("InferenceEngine decode thread failed") from self._failure
            if self._stopped:
                raise RuntimeError("InferenceEngine is stopped; call start() before submitting")
            rid = self._next_rid
            self._next_rid += 1
        uniforms: list[float] = []
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._seed * 1_000_003 + rid
            gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
            # (0, 1]: 1 - U[0, 1), so the inverse-CDF search never lands on a zero-mass token.
            uniforms = (1.0 - torch.rand(max_new, generator=gen, dtype=torch.float64)).tolist()
        return _Request(
            rid=rid,
            prompt_ids=prompt,
            params=params,
            deliver=deliver,
            max_new=max_new,
            stop_ids=(frozenset() if params.ignore_eos else self._eos_ids) | frozenset(params.stop_token_ids),
            uniforms=uniforms,
        )

    def _enqueue(self, req: _Request) -> None:
        with self._cond:
            if self._stopped:
                raise RuntimeError("InferenceEngine is stopped; call start() before submitting")
            self._waiting.append(req)
            self._live[req.rid] = req
            self._stats["num_requests"] += 1
            self._cond.notify_all()

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None
    ) -> GenerationOutput:
        """Generate one response; awaitable from any asyncio event loop in any thread.

        Args:
            prompt_ids: Prompt token ids (length ``P >= 1``, each in ``[0, vocab_size)``, chat
                template already applied).
            params: Sampling parameters (default ``SamplingParams()``).

        Returns:
            The finished :class:`GenerationOutput`. If the engine is not started yet the request
            waits in the queue until :meth:`start`.

        Raises:
            ValueError: empty / out-of-range prompt; PromptTooLongError (a ValueError): a
                prompt that fills the context.
            TypeError: ``params`` is not a :class:`SamplingParams`.
            RuntimeError: the engine is stopped, or its decode thread crashed.
            asyncio.CancelledError: when the awaiting task is cancelled; the request is then
                dropped from the engine at the next step boundary.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def deliver(result: GenerationOutput | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(_set_future, fut, result)
            except RuntimeError:  # the loop was closed meanwhile: nobody is waiting
                pass

        req = self._make_request(prompt_ids, params or SamplingParams(), deliver)
        self._enqueue(req)
        try:
            return await fut
        except asyncio.CancelledError:
            req.cancelled = True
            with self._cond:
                self._cond.notify_all()
            raise

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None
    ) -> concurrent.futures.Future:
        """Submit one request without asyncio.

        Args / errors: as :meth:`generate` (validation errors are raised here).

        Returns:
            A :class:`concurrent.futures.Future` resolving to the :class:`GenerationOutput`
            (or to the decode thread's exception). Cancelling it drops the request.
        """
        cfut: concurrent.futures.Future = concurrent.futures.Future()

        def deliver(result: GenerationOutput | BaseException) -> None:
            if not cfut.set_running_or_notify_cancel():
                return
            if isinstance(result, BaseException):
                cfut.set_exception(result)
            else:
                cfut.set_result(result)

        req = self._make_request(prompt_ids, params or SamplingParams(), deliver)

        def on_done(f: concurrent.futures.Future) -> None:
            if f.cancelled():
                req.cancelled = True
                with self._cond:
                    self._cond.notify_all()

        cfut.add_done_callback(on_done)
        self._enqueue(req)
        return cfut

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        timeout: float | None = None,
    ) -> list[GenerationOutput]:
        """Generate responses for several prompts, blocking the calling thread.

        The prompts are submitted in order (so request ``i`` gets submission index
        ``first + i``) and run concurrently under continuous batching.

        Args:
            prompts: ``N`` prompts of token ids.
            params: One :class:`SamplingParams` for all prompts, or ``N`` of them (default
                ``SamplingParams()``).
            timeout: Seconds to wait for all results (None: no limit).

        Returns:
            ``N`` outputs in prompt order.

        Raises:
            RuntimeError: the engine is not started (waiting would never end) or stopped.
            ValueError: ``len(params) != len(prompts)`` or an invalid prompt.
            TimeoutError: ``timeout`` elapsed (the requests keep running).
        """
        with self._cond:
            if self._thread is None:
                raise RuntimeError(
                    "InferenceEngine.generate_batch needs a started engine; call start()"
                )
        if params is None or isinstance(params, SamplingParams):
            plist = [params or SamplingParams()] * len(prompts)
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise ValueError(f"got {len(plist)} params for {len(prompts)} prompts")
        futures = [self.submit(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for f in futures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            out.append(f.result(timeout=left))
        return out

    # ---------------------------------------------------------------- weight updates

    def _validate_update(self, update: WeightUpdate) -> None:
        if not isinstance(update, WeightUpdate):
            raise TypeError(f"update must be a WeightUpdate, got {type(update).__name__}")
        if not _is_int(update.version):
            raise ValueError(f"WeightUpdate.version must be an int, got {update.version!r}")
        for name, t in update.tensors.items():
            target = self._targets.get(name)
            if target is None:
                raise KeyError(
                    f"WeightUpdate tensor {name!r} is not a parameter/buffer of the engine's model "
                    f"(expected names like {next(iter(self._targets))!r})"
                )
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"WeightUpdate tensor {name!r} is a {type(t).__name__}, not a torch.Tensor"
                )
            if tuple(t.shape) != tuple(target.shape):
                raise ValueError(
                    f"WeightUpdate tensor {name!r} has shape {tuple(t.shape)}, the model expects "
                    f"{tuple(target.shape)}"
                )
            if target.is_floating_point() and not t.is_floating_point():
                raise ValueError(
                    f"WeightUpdate tensor {name!r} has dtype {t.dtype}, the model expects a "
                    f"floating-point tensor ({target.dtype})"
                )
        for name, src in update.aliases.items():
            if name not in self._targets:
                raise KeyError(f"WeightUpdate alias {name!r} is not a parameter/buffer of the engine's model")
            if src not in update.tensors:
                raise KeyError(f"WeightUpdate alias {name!r} -> {src!r}: {src!r} is not in the update's tensors")
            if tuple(self._targets[name].shape) != tuple(update.tensors[src].shape):
                raise ValueError(f"WeightUpdate alias {name!r} -> {src!r}: shapes differ")

    def update_weights(
        self, update: WeightUpdate, *, wait: bool = True
    ) -> concurrent.futures.Future:
        """Load new policy weights, interrupting in-flight generation (AReaL interruptible rollout).

        The update is validated in the calling thread, then applied by the decode thread
        between two forward passes: every tensor is copied into the model (cast to the model's
        dtype), the version is set, the KV cache of every in-flight request is dropped and
        ``prompt + partial response`` is re-encoded with the new weights before decoding
        continues (after :meth:`resume` when paused). Tokens sampled before the update keep the
        old version. When the decode thread is not running the update is applied directly.
        ``update.tensors`` may be a subset of ``model.state_dict()`` (missing tensors keep their
        values). Thread-safe. From asyncio code, use ``wait=False`` and
        ``await asyncio.wrap_future(future)`` (or ``asyncio.to_thread``) rather than blocking the
        event loop for up to one forward pass.

        Args:
            update: The weights and their version.
            wait: Block until the update is applied (default). With ``wait=False`` return at
                once; the returned future completes when the update is applied.

        Returns:
            A :class:`concurrent.futures.Future` (already done when ``wait``) resolving to None.

        Raises:
            ValueError: ``update.version`` is not greater than the last accepted version, or a
                tensor has the wrong shape / a non-float dtype for a float parameter (the message
                names the tensor). Nothing is applied and the engine keeps working.
            KeyError: a tensor name is not in the model's state dict (named in the message).
            TypeError: ``update`` is not a :class:`WeightUpdate` or holds a non-tensor.
        """
        self._validate_update(update)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        pending = _PendingUpdate(update, fut)
        with self._cond:
            if update.version <= self._accepted_version:
                raise ValueError(
                    f"WeightUpdate.version must increase: got {update.version}, last accepted "
                    f"version is {self._accepted_version}"
                )
            self._accepted_version = update.version
            inline = self._thread is None or self._stopping
            if not inline:
                self._updates.append(pending)
                self._cond.notify_all()
        if inline:
            with self._model_lock:
                self._apply_updates([pending], [])
        if wait:
            fut.result()
        return fut

    def _apply_updates(self, updates: list[_PendingUpdate], in_flight: list[_Request]) -> None:
        """Copy the tensors of ``updates`` (in order) into the model; caller holds the model lock."""
        for pending in updates:
            fault_point("weight_sync")  # chaos suite: a kill during a weight sync
            t0 = time.perf_counter()
            try:
                with torch.inference_mode(False), torch.no_grad():
                    for name, t in pending.update.tensors.items():
                        self._targets[name].copy_(t)
                    for name, src in pending.update.aliases.items():
                        target = self._targets[name]
                        if target.data_ptr() != self._targets[src].data_ptr():  # not tied here
                            target.copy_(pending.update.tensors[src])
            except BaseException as e:  # validated beforehand; report anything unexpected
                log.exception("applying weight update version %s failed", pending.update.version)
                pending.future.set_exception(e)
                continue
            dt = time.perf_counter() - t0
            for req in in_flight:
                req.num_interruptions += 1
            with self._cond:
                self._version = pending.update.version
                self._stats["num_weight_updates"] += 1
                self._stats["weight_load_seconds"] += dt
                self._stats["pause_seconds_total"] += dt
            pending.future.set_result(None)

    # ---------------------------------------------------------------- decode thread

    def _set_thread_count(self) -> None:
        """Apply ``num_threads`` to the decode thread only.

        With torch's OpenMP backend, ``torch.set_num_threads`` sets the calling thread's OpenMP
        / MKL thread count *and* a process-wide default that every thread reads lazily on its
        first ATen op. So: (1) trigger this thread's lazy initialisation first (otherwise it
        would re-read the default later), (2) set the count, (3) restore the process-wide
        default from a short-lived helper thread, leaving the caller and threads started later
        at their previous setting.
        """
        if self._num_threads is not None:
            previous = torch.get_num_threads()  # lazy per-thread init; returns the default
            torch.set_num_threads(self._num_threads)
            helper = threading.Thread(target=torch.set_num_threads, args=(previous,))
            helper.start()
            helper.join()
        with self._cond:
            self._stats["num_threads"] = torch.get_num_threads()

    def _loop(self) -> None:
        try:
            self._set_thread_count()
            with torch.inference_mode():
                while True:
                    with self._cond:
                        self._in_step = False
                        self._cond.notify_all()
                        while not (
                            self._stopping
                            or self._updates
                            or (
                                not self._paused
                                and (self._waiting or self._batch is not None or self._reencode)
                            )
                        ):
                            self._cond.wait()
                        updates, self._updates = self._updates, []
                        stopping = self._stopping
                        paused = self._paused
                        self._in_step = True
                    with self._model_lock:
                        if updates:
                            in_flight = self._reencode + (self._batch.reqs if self._batch else [])
                            self._apply_updates(updates, in_flight)
                            if self._batch is not None and self._reencode_on_update:
                                self._reencode += self._batch.reqs
                                self._batch = None
                        if stopping:
                            break
                        if not paused:
                            self._step()
        except BaseException as e:  # crash: fail every request and update, keep the error
            log.exception("InferenceEngine decode thread crashed")
            self._crash(e)
        finally:
            with self._cond:
                self._in_step = False
                self._cond.notify_all()

    def _crash(self, error: BaseException) -> None:
        with self._cond:
            self._failure = error
            self._stopped = True
            reqs = [r for r in self._live.values() if not r.cancelled]
            self._live.clear()
            self._waiting.clear()
            self._reencode = []
            self._batch = None
            updates, self._updates = self._updates, []
            self._running_count = 0
            self._thread = None
        for req in reqs:
            req.deliver(error)
        for pending in updates:
            pending.future.set_exception(error)

    def _step(self) -> None:
        """One scheduling round: drop cancelled requests, re-encode / admit, one decode step."""
        with self._cond:
            for rid in [rid for rid, r in self._live.items() if r.cancelled]:
                del self._live[rid]
            if self._waiting and any(r.cancelled for r in self._waiting):
                self._waiting = deque(r for r in self._waiting if not r.cancelled)
            self._reencode = [r for r in self._reencode if not r.cancelled]
            running = len(self._reencode) + (len(self._batch.reqs) if self._batch else 0)
            admit = []
            while self._waiting and running + len(admit) < self._max_batch_size:
                admit.append(self._waiting.popleft())
            self._running_count = running + len(admit)
        if self._batch is not None and any(r.cancelled for r in self._batch.reqs):
            self._batch = _select(
                self._batch, [i for i, r in enumerate(self._batch.reqs) if not r.cancelled]
            )
        if self._reencode:
            reqs, self._reencode = self._reencode, []
            t0 = time.perf_counter()
            self._prefill(reqs)
            dt = time.perf_counter() - t0
            with self._cond:
                self._stats["pause_seconds_total"] += dt
                self._stats["reencoded_tokens"] += sum(
                    len(r.prompt_ids) + len(r.token_ids) for r in reqs
                )
        if admit:
            self._prefill(admit)
        if self._batch is not None:
            self._decode()
        with self._cond:
            self._running_count = len(self._batch.reqs) if self._batch else 0

    def _prefill(self, reqs: list[_Request]) -> None:
        """Encode ``prompt + response so far`` of ``reqs`` in fresh caches, sample each one's next
        token and merge the unfinished ones into the running batch."""
        reqs = sorted(reqs, key=lambda r: len(r.prompt_ids) + len(r.token_ids), reverse=True)
        i = 0
        while i < len(reqs):
            longest = len(reqs[i].prompt_ids) + len(reqs[i].token_ids)
            n = max(1, min(len(reqs) - i, _PREFILL_MAX_TOKENS // longest))
            self._prefill_chunk(reqs[i : i + n])
            i += n

    def _prefill_chunk(self, reqs: list[_Request]) -> None:
        seqs = [r.prompt_ids + r.token_ids for r in reqs]
        length = max(len(s) for s in seqs)
        pad = torch.tensor([length - len(s) for s in seqs], dtype=torch.long)
        ids = torch.full((len(seqs), length), self._pad_id, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, length - len(s) :] = torch.tensor(s, dtype=torch.long)
        cols = torch.arange(length)
        position_ids = (cols.unsqueeze(0) - pad.unsqueeze(1)).clamp_(min=0)
        real = cols.unsqueeze(0) >= pad.unsqueeze(1)  # [B, L] key is a real token
        causal = cols.unsqueeze(1) >= cols.unsqueeze(0)  # [L(query), L(key)]
        eye = torch.eye(length, dtype=torch.bool)
        # Padding queries attend to themselves only, so no attention row is fully masked.
        mask = (causal.unsqueeze(0) & real.unsqueeze(1)) | eye.unsqueeze(0)
        layers = [_KVLayer() for _ in range(self._num_layers)]
        t0 = time.perf_counter()
        out = self.model(
            input_ids=ids,
            attention_mask=mask.unsqueeze(1),
            position_ids=position_ids,
            cache=Cache(layers=layers),
            use_cache=True,
            logits_to_keep=1,
        )
        dt = time.perf_counter() - t0
        with self._cond:
            self._stats["busy_seconds"] += dt
            self._stats["prefill_seconds"] += dt
            self._stats["prefill_tokens"] += sum(len(s) for s in seqs)
        plan = _make_plan([r.params for r in reqs])
        tokens = self._sample_and_record(reqs, out.logits[:, -1, :], plan)
        new = _Batch(reqs=reqs, layers=layers, pad=pad, length=length, pending=tokens, plan=plan)
        new = _select(new, [i for i, r in enumerate(reqs) if r.finish_reason is None])
        if new is not None:
            self._batch = _merge(self._batch, new)

    def _decode(self) -> None:
        fault_point("generate")  # chaos suite: a kill during generation
        batch = self._batch
        length = batch.length + 1
        mask = torch.arange(length).unsqueeze(0) >= batch.pad.unsqueeze(1)
        position_ids = (batch.length - batch.pad).unsqueeze(1)
        t0 = time.perf_counter()
        out = self.model(
            input_ids=batch.pending.unsqueeze(1),
            attention_mask=mask[:, None, None, :],
            position_ids=position_ids,
            cache=batch.cache(),
            use_cache=True,
            logits_to_keep=1,
        )
        dt = time.perf_counter() - t0
        batch.length = length
        with self._cond:
            self._stats["busy_seconds"] += dt
            self._stats["decode_steps"] += 1
            prof = self._decode_profile.setdefault(len(batch.reqs), [0, 0.0])
            prof[0] += 1
            prof[1] += dt
        batch.pending = self._sample_and_record(batch.reqs, out.logits[:, -1, :], batch.plan)
        done = [r.finish_reason is not None for r in batch.reqs]
        if any(done):
            self._batch = _select(batch, [i for i, d in enumerate(done) if not d])

    def _sample_and_record(
        self, reqs: list[_Request], logits: torch.Tensor, plan: _SamplingPlan
    ) -> torch.Tensor:
        """Sample one token per row, append it (log-prob, version, kept set) to each request and
        finish the requests that hit a stop condition. Returns the tokens ``[B]``."""
        t0 = time.perf_counter()
        if plan.needs_uniforms:
            u = torch.tensor(
                [r.uniforms[len(r.token_ids)] if r.uniforms else 1.0 for r in reqs],
                dtype=torch.float64,
            )
        else:
            u = torch.ones(len(reqs), dtype=torch.float64)
        tokens, logprobs, kept = _sample_with_plan(logits, plan, u)
        version = self._version
        rows = zip(reqs, tokens.tolist(), logprobs.tolist(), strict=True)
        for i, (req, tok, lp) in enumerate(rows):
            if kept is not None and kept[i] is not None:
                req.support.append(kept[i])
            req.token_ids.append(tok)
            req.logprobs.append(lp)
            req.versions.append(version)
            if tok in req.stop_ids:
                self._finish(req, FINISH_STOP)
            elif req.params.stop and self._hits_stop_string(req):
                self._finish(req, FINISH_STOP)
            elif len(req.token_ids) >= req.max_new:
                self._finish(req, FINISH_LENGTH)
        with self._cond:
            self._stats["generated_tokens"] += len(reqs)
            self._stats["sample_seconds"] += time.perf_counter() - t0
        return tokens

    def _hits_stop_string(self, req: _Request) -> bool:
        text = self.tokenizer.decode(req.token_ids, skip_special_tokens=True)
        if any(s in text for s in req.params.stop):
            req.text = text  # reused as the final text
            return True
        return False

    def _finish(self, req: _Request, reason: str) -> None:
        req.finish_reason = reason
        text = req.text
        if text is None:
            text = self.tokenizer.decode(req.token_ids, skip_special_tokens=True)
        output = GenerationOutput(
            prompt_ids=list(req.prompt_ids),
            token_ids=list(req.token_ids),
            logprobs=list(req.logprobs),
            versions=list(req.versions),
            finish_reason=reason,
            text=text,
            num_interruptions=req.num_interruptions,
            old_logprobs=req.old_logprobs,  # shared: partial-rollout sync may extend it later
            sampling_mask=req.sampling_mask(len(req.token_ids)),
        )
        with self._cond:
            self._live.pop(req.rid, None)
            if self._track_partials and reason != FINISH_ABORT:
                self._finished_unscored[req.rid] = req
            self._stats["num_finished"] += 1
            if reason == FINISH_ABORT:
                self._stats["num_aborted"] += 1
        req.deliver(output)


def _set_future(fut: asyncio.Future, result: GenerationOutput | BaseException) -> None:
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)
