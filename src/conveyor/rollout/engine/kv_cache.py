"""The KV cache with preallocated, left-padded rows (:class:`_KVLayer`) and the running batch:
per-request decode state (:class:`_Request`), the batch of requests sharing one cache
(:class:`_Batch`), and merging / selecting rows (:func:`_merge`, :func:`_select`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer

from conveyor.rollout.engine.sampling import _make_plan, _SamplingPlan
from conveyor.rollout.engine.types import GenerationOutput, SamplingParams
from conveyor.types import SamplingMask

_KV_GROWTH = 64  # extra cache columns allocated whenever a KV buffer is (re)allocated


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
    priority: int = 0  # waiting-queue order: lower first, FIFO among equals (InferenceEngine.generate)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    num_interruptions: int = 0
    finish_reason: str | None = None
    text: str | None = None
    cancelled: bool = False
    aborted: bool = False  # InferenceEngine.abort: finish with "abort" at the next step boundary
    # kept set of each sampled token (truncated sampling only); appended before token_ids, so a
    # concurrent snapshot of token_ids never has more tokens than support
    support: list[torch.Tensor] = field(default_factory=list)
    # tokens of ``prompt_ids`` still to run through the model before the next sample (a prefix-cache
    # hit joined the running batch with them: each decode step runs one, samples nothing for this
    # row, and takes the next; empty otherwise). A re-encode runs them all and empties it.
    feed: list[int] = field(default_factory=list)

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
            new[:, :, :length].copy_(x[:, :, trim : batch.length].index_select(0, idx.to(x.device)))
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


class _PrefixCache:
    """KV caches of token prefixes the engine computed recently, reused by later requests whose
    prompt extends one (prefix caching, as vLLM's automatic prefix caching and SGLang's
    RadixAttention; issue 16). A tool episode's next turn is ``prompt + response so far +
    observation``: without the cache every turn prefills the whole history again (69% of the
    engine's busy time in the default main job: docs/results/main_job.md).

    Entries are keyed by their token ids; each holds one ``(keys, values)`` pair per layer,
    ``[H_kv, n, D]`` (a copy, owned by the cache). Least recently used entries are evicted beyond
    ``max_tokens`` tokens in all. The engine clears the cache at every weight update, so an entry
    always holds keys / values of the weights now loaded. Decode thread only (no lock).

    Args:
        max_tokens: Token budget (>= 0; 0 disables the cache: nothing is stored).
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Tokens held now."""
        return self._tokens

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def insert(self, key: Sequence[int], kv: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]) -> bool:
        """Store the keys / values of ``key`` (``kv()`` builds them: called only when stored).
        Returns whether it was stored (not when disabled, longer than the budget, or present:
        then it only becomes most recently used)."""
        n = len(key)
        if not 0 < n <= self.max_tokens:
            return False
        k = tuple(key)
        if k in self._entries:
            self._entries.move_to_end(k)
            return False
        self._entries[k] = kv()
        self._tokens += n
        while self._tokens > self.max_tokens:
            old, _ = self._entries.popitem(last=False)
            self._tokens -= len(old)
        return True

    def lookup(self, seq: Sequence[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """The longest entry that is a proper prefix of ``seq`` (at least one token of ``seq``
        is left to run through the model, whose logits give the next token): ``(its length,
        its per-layer (keys, values))``, or None."""
        best: tuple[int, ...] | None = None
        n_seq = len(seq)
        for key in self._entries:
            n = len(key)
            if n < n_seq and (best is None or n > len(best)) and key[0] == seq[0] and tuple(seq[:n]) == key:
                best = key
        if best is None:
            return None
        self._entries.move_to_end(best)
        return len(best), self._entries[best]
