"""The local, in-process engine: :class:`InferenceEngine` (a background decode thread running
continuous batching with interruptible weight updates; see :mod:`conveyor.rollout.engine`)."""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import inspect
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

from conveyor.devices import module_device, synchronize, to
from conveyor.faults import fault_point
from conveyor.hardware import restore_default_thread_count, set_own_thread_count
from conveyor.rollout.engine.kv_cache import (
    _KV_GROWTH,
    _Batch,
    _KVLayer,
    _merge,
    _PrefixCache,
    _Request,
    _select,
)
from conveyor.rollout.engine.sampling import _make_plan, _sample_with_plan, _SamplingPlan
from conveyor.rollout.engine.types import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    PartialRequest,
    PromptTooLongError,
    SamplingParams,
    _is_int,
)
from conveyor.sync import LoraFactors, WeightUpdate, apply_update

log = logging.getLogger("conveyor.rollout.engine")  # the name before the split: same in train.log

RECLAIM_TIMEOUT_S = 10.0
"""Longest wait (s) of the decode thread for cores it lent (:meth:`InferenceEngine.lend_threads`)
once work has arrived; then it runs anyway and does not wait again until they are given back."""
_PREFILL_MAX_TOKENS = 8192  # padded tokens (rows x longest sequence) per prefill forward pass
_FEED_MAX_TOKENS = 8
"""A prefix-cache hit with at most this many tokens left to run joins the running batch and its
decode steps run those tokens, one per step (:meth:`InferenceEngine._join_from_prefix`), instead
of a prefill pass of its own. A calculator result is 2-8 tokens; a pass of one or two rows cost
0.11-0.15 s in the main job (the float32 engine), one more row in a decode step ~5-10 ms
(docs/results/main_job.md, section 15)."""


_SHARED_PREFIX_MIN = 16
"""Fewest tokens a re-encode's shared prefix must save to be prefilled once for the rows sharing
it (:func:`_shared_prefixes`, :meth:`InferenceEngine._reencode_requests`): about what one more
forward pass costs (``_PASS_COST_TOKENS``)."""
_PASS_COST_TOKENS = 16
"""What one more forward pass costs, in tokens of prefill, when hit rows are packed into passes
(:func:`_plan_hit_passes`): a decode step of one row took 0.07 s and a prefill ~7 ms per token
for SmolLM2 on one core (float32; docs/results/main_job.md sections 1 and 15)."""


def _priority(req: _Request) -> int:
    return req.priority


def _padded_prefill_inputs(seqs: list[list[int]], pad_id: int):
    """Left-padded inputs of one prefill pass over ``seqs``: ``(ids [B, L], mask [B, 1, L, L]
    bool, position_ids [B, L], pad [B], L)``; a padding query attends to itself only, so no
    attention row is fully masked."""
    length = max(len(s) for s in seqs)
    pad = torch.tensor([length - len(s) for s in seqs], dtype=torch.long)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, length - len(s) :] = torch.tensor(s, dtype=torch.long)
    cols = torch.arange(length)
    position_ids = (cols.unsqueeze(0) - pad.unsqueeze(1)).clamp_(min=0)
    real = cols.unsqueeze(0) >= pad.unsqueeze(1)  # [B, L] key is a real token
    causal = cols.unsqueeze(1) >= cols.unsqueeze(0)  # [L(query), L(key)]
    eye = torch.eye(length, dtype=torch.bool)
    mask = (causal.unsqueeze(0) & real.unsqueeze(1)) | eye.unsqueeze(0)
    return ids, mask.unsqueeze(1), position_ids, pad, length


def _shared_prefixes(seqs: Sequence[Sequence[int]], min_saved: int) -> list[tuple[int, ...]]:
    """The prefixes worth prefilling once for a set of sequences (a re-encode's rows: a group's
    responses share their prompt, all prompts a chat template's header): every prefix at which
    sequences branch (the longest common prefix of two neighbours in sorted order, at most each
    one's length - 1: a token is left to run for its logits), kept when prefilling it once saves
    at least ``min_saved`` tokens: ``(k - 1) x (its length - its parent's)`` for the ``k``
    sequences longer than it that start with it, its parent being the longest kept prefix nested
    in it (prefilled first; :meth:`InferenceEngine._prefill_prefixes` runs only the difference).
    Shortest first; [] when none.

    Example: ``[1,2,3,4], [1,2,3,5], [1,2,9]`` branch at ``1, 2`` (3 rows: saves 2 x 2 = 4) and
    ``1, 2, 3`` (2 rows, one token beyond ``1, 2``: saves 1): with ``min_saved`` 1 the result is
    ``[(1, 2), (1, 2, 3)]``, with 2 to 4 ``[(1, 2)]``."""
    order = sorted(range(len(seqs)), key=lambda i: list(seqs[i]))
    found: set[tuple[int, ...]] = set()
    for a, b in zip(order, order[1:]):  # the branching prefixes are the neighbours' common prefixes
        x, y = seqs[a], seqs[b]
        n = 0
        for u, v in zip(x, y):
            if u != v:
                break
            n += 1
        n = min(n, len(x) - 1, len(y) - 1)
        if n > 0:
            found.add(tuple(x[:n]))
    kept: list[tuple[int, ...]] = []
    for p in sorted(found, key=lambda p: (len(p), p)):
        parent = max((len(q) for q in kept if p[: len(q)] == q), default=0)
        k = sum(1 for x in seqs if len(x) > len(p) and tuple(x[: len(p)]) == p)
        if (k - 1) * (len(p) - parent) >= min_saved:
            kept.append(p)
    return kept


def _plan_hit_passes(lefts: Sequence[int], lengths: Sequence[int], pass_cost: int,
                     max_tokens: int) -> list[list[int]]:
    """Pack prefix-cache hits into forward passes (:meth:`InferenceEngine._prefill_hits`): row
    ``i`` has ``lefts[i]`` uncached tokens of a sequence of ``lengths[i]`` tokens. A pass runs the
    same number ``S`` of tokens for each of its rows (``S`` = its largest ``left``; a row with
    fewer runs some of its cached tokens again, so ``S <= lengths[i]`` for each row) and costs
    ``rows x S + pass_cost`` tokens; at most ``max_tokens`` tokens (``rows x S``) unless one row.
    Returns the passes (row indices, largest ``left`` first) of least total cost: an exact
    dynamic programme over the rows sorted by ``left`` (a pass is a run of that order).

    Example: lefts 10, 9, 2, 1 (lengths 50) with ``pass_cost`` 16: one pass costs 4 x 10 + 16 =
    56, ``[10, 9] [2, 1]`` cost 20 + 16 + 4 + 16 = 56 too, the single pass is kept (fewer
    passes first); with ``pass_cost`` 8: 48 against 52, ``[[0, 1], [2, 3]]``."""
    order = sorted(range(len(lefts)), key=lambda i: (-lefts[i], i))
    n = len(order)
    best = [0] + [math.inf] * n  # best[j]: least cost of the first j rows of ``order``
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        shortest = math.inf
        for i in range(j, 0, -1):  # the last pass holds order[i-1 : j]; its S is lefts[order[i-1]]
            shortest = min(shortest, lengths[order[i - 1]])
            S = lefts[order[i - 1]]
            rows = j - i + 1
            if S > shortest or (rows > 1 and rows * S > max_tokens):
                continue
            cost = best[i - 1] + rows * S + pass_cost
            if cost < best[j] or (cost == best[j] and i < cut[j]):
                best[j], cut[j] = cost, i
    passes = []
    j = n
    while j > 0:
        passes.append(order[cut[j] - 1 : j])
        j = cut[j] - 1
    return passes[::-1]


def _hit_passes(hits: Sequence[tuple[Any, int, list[tuple[torch.Tensor, torch.Tensor]]]],
                lengths: Sequence[int]) -> Iterator[list[tuple[int, int, list[tuple[torch.Tensor, torch.Tensor]]]]]:
    """Prefix-cache ``hits`` (``(anything, cached tokens n, per-layer (keys [H, n, D], values))``,
    sequences of ``lengths`` tokens) packed into forward passes by :func:`_plan_hit_passes` with
    the engine's costs. Each pass as ``(index into hits, keep, keys / values of the first keep
    tokens)``: ``keep`` = the row's length - the pass's ``S`` (<= n; a row with fewer tokens left
    than ``S`` recomputes the end of its cached part)."""
    lefts = [length - n for length, (_, n, _) in zip(lengths, hits, strict=True)]
    for rows in _plan_hit_passes(lefts, lengths, _PASS_COST_TOKENS, _PREFILL_MAX_TOKENS):
        S = lefts[rows[0]]
        out = []
        for i in rows:
            _, n, kv = hits[i]
            keep = lengths[i] - S
            out.append((i, keep, kv if keep == n else [(k[:, :keep], v[:, :keep]) for k, v in kv]))
        yield out


def _token_chunks(items: list, lengths: Sequence[int]) -> Iterator[list]:
    """``items`` (sequences of ``lengths`` tokens, longest first) in consecutive chunks of at most
    ``_PREFILL_MAX_TOKENS`` padded tokens (rows x the chunk's longest; one row at least)."""
    i = 0
    while i < len(items):
        n = max(1, min(len(items) - i, _PREFILL_MAX_TOKENS // lengths[i]))
        yield items[i : i + n]
        i += n


@dataclass
class _PendingUpdate:
    update: WeightUpdate
    future: concurrent.futures.Future


class InferenceEngine:
    """Continuous-batching generator with interruptible weight updates (see the package docstring).

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
        prefix_cache_tokens: Token budget of the prefix cache (0: off, the default). Keys /
            values of every prefilled prompt and of every request that finished with ``stop``
            are kept (least recently used evicted beyond the budget) and a new request whose
            prompt extends one runs only the rest through the model: a tool or agent episode's
            next turn, and a group's responses admitted after the first. Cleared at every weight
            update. Memory: ``2 x layers x kv heads x head dim x dtype bytes`` per token (46 KB
            for SmolLM2 in float32). Requests with the same prompt admitted together are
            prefilled once whatever the budget.
        prefix_feed_tokens: A prefix-cache hit with at most this many tokens left joins the
            running batch and its decode steps run them, one per step, instead of a prefill pass
            of its own (default ``_FEED_MAX_TOKENS`` = 8; 1: only a group-mate's last prompt
            token, the engine before 2026-12-06; >= 1).
        lora_base: Parameter name -> base weight ``W0`` (``[out, in]``) for an engine that
            receives LoRA adapters (``lora.sync=adapter``; :class:`~conveyor.sync.LoraFactors`):
            an update's factors for a name set that weight to ``W0 + scale * B @ A``, always from
            this ``W0`` (kept by the engine as given: float32 for a float32 trainer; for SmolLM2's
            attention and MLP projections 106 M elements, 0.42 GB, by arithmetic). None: the
            engine accepts no factors.
        device: Where the model runs (``rollout.engine_device`` resolved, e.g. ``"cuda:0"``): the
            model is moved there; None keeps it where it is. The scheduler's bookkeeping (token
            lists, padding, sampling plans) stays on the host; token ids, masks and positions go
            to the device for each forward pass, the keys / values stay there, and each step's
            sampled tokens and log-probs come back (``[B]`` each). Weight updates are copied onto
            the device (from pinned host memory or another device's tensors).

    Attributes:
        supports_priority: True: :meth:`generate` / :meth:`submit` take ``priority`` (an
            optional capability of the :class:`~conveyor.rollout.engine.protocol.Engine`
            protocol that the rollout controller checks for).
        model: The model (read it only while the engine is paused or stopped; the decode thread
            runs forward passes on it and :meth:`update_weights` overwrites its weights).
        tokenizer: The tokenizer passed in.

    Raises:
        ValueError: invalid arguments, or a model with non-full-attention (sliding / linear)
            layers.
    """

    supports_priority = True

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
        prefix_cache_tokens: int = 0,
        prefix_feed_tokens: int = _FEED_MAX_TOKENS,
        lora_base: dict[str, torch.Tensor] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if not _is_int(version) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        if not _is_int(max_batch_size) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if not _is_int(seed):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if num_threads is not None and (not _is_int(num_threads) or num_threads < 1):
            raise ValueError(f"num_threads must be an int >= 1 or None, got {num_threads!r}")
        if not _is_int(prefix_cache_tokens) or prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be an int >= 0, got {prefix_cache_tokens!r}")
        if not _is_int(prefix_feed_tokens) or prefix_feed_tokens < 1:
            raise ValueError(f"prefix_feed_tokens must be an int >= 1, got {prefix_feed_tokens!r}")
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
        if device is not None or dtype is not None:  # (one move: cast and place together)
            model.to(device=device, dtype=dtype)
        model.eval()
        self.device = module_device(model)
        # the KV cache's keyword: `cache` from transformers 5.2x on, `past_key_values` before (5.17:
        # an unknown keyword is swallowed by **kwargs and the model would build a cache of its own)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._dtype_name = str(next(model.parameters()).dtype).removeprefix("torch.")
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
        self._lora_base = {k: v.to(self.device) for k, v in (lora_base or {}).items()}  # (no copy on the host)
        for name, base in self._lora_base.items():
            if name not in self._targets or tuple(base.shape) != tuple(self._targets[name].shape):
                raise ValueError(f"lora_base {name!r} {tuple(base.shape)} is not a weight of the engine's model of "
                                 "that shape")
        self._version = version
        self._accepted_version = version
        self._max_batch_size = max_batch_size
        self._seed = seed
        self._num_threads = num_threads
        self._threads_wanted: int | None = None  # set_num_threads, applied by the decode thread
        self._prefix_cache = _PrefixCache(prefix_cache_tokens)
        self._feed_tokens = prefix_feed_tokens

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
        self._abort_pending = False  # running requests flagged by abort(), not yet finished
        # lend_threads: the decode thread's cores lent to the trainer while it idles (issue 16)
        self._lent = False
        self._lent_since = 0.0
        self._reclaim = False  # work arrived while lent: the borrower is asked to give them back
        self._overrun = False  # the wait for them timed out: run anyway until they are given back
        self._idle_since: float | None = None  # when the decode thread last found nothing to run
        self._next_rid = 0
        # request keys "<engine id>:<rid>" are unique across engines, processes and resumes
        self.engine_id = uuid.uuid4().hex[:12]
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
            thread_changes=0,  # set_num_threads applied (elastic cores)
            prefix_cache_hits=0,  # requests whose prompt extended a cached prefix
            prefix_cache_hit_tokens=0,  # prompt tokens those requests did not run through the model
            prefix_hits_joined=0,  # hits with <= prefix_feed_tokens left, run by decode steps (no prefill pass)
            prefix_fed_tokens=0,  # the tokens those hits ran in decode steps
            reencode_prefix_tokens=0,  # re-encoded tokens taken from a prefix prefilled once for several rows
            prefill_dedup_tokens=0,  # tokens of identical sequences prefilled once (admitted together)
            prefill_forwards=0,  # prefill / re-encode forward passes
            merge_seconds=0.0,  # s copying the running batch's keys / values to admit requests into it
            lends=0,  # lend_threads granted (the trainer borrowed the idle engine's cores)
            lent_seconds=0.0,  # s the cores were lent
            reclaims=0,  # times work arrived while lent and the decode thread waited for them back
            reclaim_wait_seconds=0.0,  # s the decode thread waited for its cores
            reclaim_timeouts=0,  # waits cut at RECLAIM_TIMEOUT_S (the borrower did not answer)
        )
        self._track_partials = track_partials
        self._reencode_on_update = reencode_on_update
        self._finished_unscored: dict[int, _Request] = {}
        # batch size -> [decode steps, forward seconds]: the simulator's calibration
        self._decode_profile: dict[int, list[float]] = {}
        # prefill kind -> [forward passes, rows, padded tokens, seconds] (where the prefill time goes)
        self._prefill_profile: dict[str, list[float]] = {}
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
            self._prefix_cache.clear()
            self._reencode = []
            self._batch = None
            self._running_count = 0
            self._paused = False
            self._abort_pending = False
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
    def running(self) -> bool:
        """True while the decode thread runs (started, neither stopped nor crashed); paused
        counts as running. The engine server's ``/health`` reports it."""
        with self._cond:
            return self._thread is not None and not self._stopped and self._failure is None

    def _no_work(self) -> bool:
        return not (self._waiting or self._running_count or self._reencode or self._updates
                    or self._batch is not None)

    @property
    def idle(self) -> bool:
        """True when the decode thread has nothing to run: no waiting, running or re-encoding
        request and no pending weight update (paused counts as idle), and its cores are not lent
        (:meth:`lend_threads`). A hint for work that borrows the engine's cores
        (:mod:`conveyor.trainer.reference`); it may change right after it is read. Thread-safe,
        no lock (reads of counters and containers)."""
        return not self._lent and self._no_work()

    @property
    def idle_seconds(self) -> float:
        """Seconds since the decode thread last found nothing to run (0.0 while it has work or
        has not started). Thread-safe, no lock."""
        since = self._idle_since
        if since is None or not self._no_work():
            return 0.0
        return max(0.0, time.perf_counter() - since)

    def lend_threads(self, min_idle_s: float = 0.0) -> bool:
        """Lend the decode thread's cores to the caller while the engine idles (elastic cores,
        issue 16: on a trainer-bound machine the engine waits for capacity during the update,
        and the trainer may compute with its own threads plus the engine's).

        Granted only when the engine has had nothing to run for ``min_idle_s`` and its cores are
        not lent already. While lent, the decode thread does not start a forward pass: when
        work arrives (a request, a weight update) it sets :attr:`reclaim_requested` and waits
        until :meth:`return_threads`, at most :data:`RECLAIM_TIMEOUT_S` (then it runs anyway, so
        a borrower that blocks on the engine cannot deadlock it). :meth:`stop` does not wait.

        Args:
            min_idle_s: Seconds the engine must have been idle (:attr:`idle_seconds`), so that
                a short gap between two tool turns is not taken.

        Returns:
            True: the cores are lent; the caller must call :meth:`return_threads` (soon after
            :attr:`reclaim_requested` turns True). False: nothing lent.
        """
        with self._cond:
            if self._lent or self._stopped or self._thread is None or self.idle_seconds < max(min_idle_s, 1e-9):
                return False
            self._lent = True
            self._reclaim = self._overrun = False
            self._lent_since = time.perf_counter()
            self._stats["lends"] += 1
            return True

    @property
    def reclaim_requested(self) -> bool:
        """True while the cores are lent and the decode thread has work waiting for them
        (:meth:`lend_threads`). Thread-safe, no lock."""
        return self._lent and self._reclaim

    def return_threads(self) -> None:
        """Give back cores lent by :meth:`lend_threads`; the decode thread resumes at once.
        Idempotent."""
        with self._cond:
            if not self._lent:
                return
            self._lent = False
            self._reclaim = self._overrun = False
            self._stats["lent_seconds"] += time.perf_counter() - self._lent_since
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        """True between :meth:`pause` and :meth:`resume`."""
        return self._paused

    def abort(self, rids: Sequence[int] | None = None) -> int:
        """Finish requests now with ``finish_reason="abort"`` and the tokens they have
        (SGLang's ``/abort_request``; the engine keeps running).

        Queued requests are finished at once (no tokens); requests in the running batch (or
        awaiting re-encoding) are removed at the next step boundary by the decode thread, also
        while the engine is paused, and resolve with their partial response. A request that
        finishes on its own (stop / length) before that boundary keeps its own finish reason.

        Args:
            rids: Request ids (the ``rid`` attribute of the future :meth:`submit` returns);
                None aborts every unfinished request. Unknown or already finished ids are
                ignored.

        Returns:
            The number of unfinished requests that were aborted.
        """
        finish_now: list[_Request] = []
        with self._cond:
            targets = list(self._live.values()) if rids is None else [
                self._live[r] for r in rids if r in self._live
            ]
            targets = [r for r in targets if not r.cancelled and not r.aborted]
            queued = {id(r) for r in self._waiting}
            for req in targets:
                req.aborted = True
                if id(req) in queued:
                    finish_now.append(req)
            if finish_now:
                self._waiting = deque(r for r in self._waiting if not r.aborted)
            if len(finish_now) < len(targets):
                self._abort_pending = True
                self._cond.notify_all()
        for req in finish_now:
            self._finish(req, FINISH_ABORT)
        return len(targets)

    def partial_requests(self, *, require_pause: bool = True) -> list[PartialRequest]:
        """Every request with generated tokens: in flight (running batch or awaiting
        re-encoding) and, with ``track_partials``, finished since the previous call (then
        forgotten). For partial-rollout sync: between :meth:`pause` and the next weight update,
        the caller scores the tokens of the outgoing version (:meth:`score_old_logprobs`) and
        sends the patches to the rollout side (:mod:`conveyor.rollout.old_logprobs`).

        With ``require_pause=False`` (a dedicated old-logit worker) the snapshot is taken under
        the engine's lock while it runs: the copies are consistent, and every token of a version
        the engine has already replaced is in them; newer tokens appear in later calls.

        Returns:
            A list of :class:`PartialRequest` (copies; each with its request key).

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
                                          self.request_key(r.rid), finished,
                                          r.sampling_mask(len(tokens))))
        return out

    def request_key(self, rid: int) -> str:
        """The key of request ``rid``: ``"<engine id>:<rid>"``."""
        return f"{self.engine_id}:{rid}"

    def score_old_logprobs(self, spec, items, version: int | None = None):
        """Partial-rollout sync's scoring capability (MISSION.md section 2, recovery 3): the
        training-side log-probs of ``items``' tokens of ``version`` (default: the loaded one)
        under the engine's current weights, as old-log-prob patches. Only the strategies that
        need it call it; the engine must be paused (or stopped) so the weights cannot change
        and no decode step runs concurrently.

        Args:
            spec: The trainer's :class:`~conveyor.trainer.logprobs.ScoringSpec` (temperature,
                precision, chunking, packing budgets: the numbers match the trainer's).
            items: :class:`~conveyor.rollout.old_logprobs.ScoringItem` s.

        Returns:
            ``(patches, tokens scored)``
            (:func:`~conveyor.trainer.proximal.score_old_logprobs`).

        Raises:
            RuntimeError: the engine is running (not paused).
        """
        from conveyor.trainer.proximal import score_old_logprobs

        with self._cond:
            if self._thread is not None and not self._stopped and not self._paused:
                raise RuntimeError("score_old_logprobs() needs a paused engine: call pause() first")
            v = self._version if version is None else version
        with self._model_lock:
            return score_old_logprobs(spec, self.model, items, v)

    def stats(self) -> dict[str, Any]:
        """Counters since construction.

        Returns:
            A dict with ``busy_seconds`` (s of forward passes, prefill and decode),
            ``prefill_seconds`` (s, the prefill / re-encode part of it), ``sample_seconds``
            (s spent sampling), ``generated_tokens``, ``prefill_tokens`` (real tokens encoded
            by prefills, re-encodes included), ``reencoded_tokens`` (tokens re-encoded after
            weight updates), ``reencode_prefix_tokens`` (of those, tokens a row took from a
            prefix prefilled once for the several rows sharing it, with the prefix cache on:
            not run again per row), ``decode_steps``, ``num_requests`` (submitted), ``num_finished``
            (resolved with stop / length / abort), ``num_aborted``, ``num_weight_updates``,
            ``weight_load_seconds`` (s copying weights), ``pause_seconds_total`` (s generation
            was paused by weight updates: loading plus re-encoding), ``running`` (requests in
            the running batch, including those awaiting re-encoding), ``waiting`` (queued),
            ``version``, ``paused``, ``dtype`` (of the model's weights, e.g. ``"float32"``),
            ``num_threads`` (intra-op threads of the decode thread now, 0 before it started),
            ``thread_changes`` (:meth:`set_num_threads` changes applied), ``prefix_cache_hits``,
            ``prefix_cache_hit_tokens`` (prompt tokens the prefix cache saved from the model),
            ``prefix_hits_joined`` (hits with at most ``prefix_feed_tokens`` tokens left: they
            joined the running batch and its decode steps ran those tokens, one per step, no
            prefill pass of their own), ``prefix_fed_tokens`` (the tokens they ran that way: counted
            in neither ``prefill_tokens`` nor ``prefix_cache_hit_tokens``),
            ``prefill_dedup_tokens`` (tokens of identical prompts admitted together, prefilled
            once), ``prefill_forwards`` (prefill and re-encode forward passes), ``merge_seconds``
            (s copying keys / values to admit prefilled requests into the running batch; not
            part of ``busy_seconds``), ``prefill_profile`` (``{"reencode" | "admit" |
            "prefix_hit": [forward passes, rows, padded tokens, seconds]}``: re-encodes after
            weight updates, admissions that missed the prefix cache, admissions that hit it with
            more than ``prefix_feed_tokens`` tokens left; joined hits run no pass and are not
            counted here),
            ``prefix_cache_tokens`` (held now), ``decode_profile`` (``{batch size: [decode steps,
            seconds]}``, seconds of the decode forward passes, used with ``sample_seconds`` to
            calibrate ``conveyor simulate``), and, for cores lent while idle (:meth:`lend_threads`),
            ``lends``, ``lent_seconds`` (s; a lease still open is not counted yet), ``reclaims``
            (work arrived while lent), ``reclaim_wait_seconds`` (s the decode thread waited for its
            cores) and ``reclaim_timeouts``.
        """
        with self._cond:
            out = dict(self._stats)
            out["decode_profile"] = {b: list(v) for b, v in self._decode_profile.items()}
            out["prefill_profile"] = {k: list(v) for k, v in self._prefill_profile.items()}
            out["running"] = self._running_count
            out["waiting"] = len(self._waiting)
            out["version"] = self._version
            out["paused"] = self._paused
            out["dtype"] = self._dtype_name
            out["prefix_cache_tokens"] = self._prefix_cache.tokens
        return out

    # ---------------------------------------------------------------- submission

    def _make_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, deliver: Callable, priority: int = 0
    ) -> _Request:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not _is_int(priority):
            raise TypeError(f"priority must be an int, got {priority!r} ({type(priority).__name__})")
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
            priority=int(priority),
        )

    def _enqueue(self, req: _Request) -> None:
        with self._cond:
            if self._stopped:
                raise RuntimeError("InferenceEngine is stopped; call start() before submitting")
            # priority order, FIFO among equal priorities (all 0 by default: a plain FIFO queue)
            if not self._waiting or self._waiting[-1].priority <= req.priority:
                self._waiting.append(req)
            else:
                self._waiting.insert(bisect.bisect_right(self._waiting, req.priority, key=_priority), req)
            self._live[req.rid] = req
            self._stats["num_requests"] += 1
            self._cond.notify_all()

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *, priority: int = 0
    ) -> GenerationOutput:
        """Generate one response; awaitable from any asyncio event loop in any thread.

        Args:
            prompt_ids: Prompt token ids (length ``P >= 1``, each in ``[0, vocab_size)``, chat
                template already applied).
            params: Sampling parameters (default ``SamplingParams()``).
            priority: Place in the waiting queue: requests wait for a free slot of the running
                batch (``max_batch_size``) in ascending ``priority``, FIFO among equal values
                (vLLM's priority scheduling convention: lower is served first). Running requests
                are never preempted. The rollout controller passes each episode's admission
                sequence (``rollout.priority=oldest_first``), so that a group admitted earlier,
                and closer to its staleness deadline, is not overtaken by younger ones. Sampling
                does not depend on it (each request's random stream is fixed at submission).

        Returns:
            The finished :class:`GenerationOutput`. If the engine is not started yet the request
            waits in the queue until :meth:`start`.

        Raises:
            ValueError: empty / out-of-range prompt; PromptTooLongError (a ValueError): a
                prompt that fills the context.
            TypeError: ``params`` is not a :class:`SamplingParams`, or ``priority`` not an int.
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

        req = self._make_request(prompt_ids, params or SamplingParams(), deliver, priority)
        self._enqueue(req)
        try:
            return await fut
        except asyncio.CancelledError:
            req.cancelled = True
            with self._cond:
                self._cond.notify_all()
            raise

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *, priority: int = 0
    ) -> concurrent.futures.Future:
        """Submit one request without asyncio.

        Args / errors: as :meth:`generate` (validation errors are raised here; ``priority`` as
        there).

        Returns:
            A :class:`concurrent.futures.Future` resolving to the :class:`GenerationOutput`
            (or to the decode thread's exception). Cancelling it drops the request. Its ``rid``
            attribute (int) is the request id, for :meth:`abort`.
        """
        cfut: concurrent.futures.Future = concurrent.futures.Future()

        def deliver(result: GenerationOutput | BaseException) -> None:
            if not cfut.set_running_or_notify_cancel():
                return
            if isinstance(result, BaseException):
                cfut.set_exception(result)
            else:
                cfut.set_result(result)

        req = self._make_request(prompt_ids, params or SamplingParams(), deliver, priority)

        def on_done(f: concurrent.futures.Future) -> None:
            if f.cancelled():
                req.cancelled = True
                with self._cond:
                    self._cond.notify_all()

        cfut.add_done_callback(on_done)
        cfut.rid = req.rid
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
        for name, f in update.lora.items():
            if name not in self._lora_base:
                raise KeyError(f"WeightUpdate LoRA factors for {name!r}, but the engine keeps no base weight for it "
                               "(start it with lora_base: the base weights W0 the adapters are merged onto)")
            if not isinstance(f, LoraFactors) or not isinstance(f.A, torch.Tensor) or not isinstance(f.B, torch.Tensor):
                raise TypeError(f"WeightUpdate LoRA factors for {name!r} must be LoraFactors of tensors")
            out, inp = self._targets[name].shape
            if f.A.dim() != 2 or f.B.dim() != 2 or f.B.shape[0] != out or f.A.shape[1] != inp \
                    or f.A.shape[0] != f.B.shape[1]:
                raise ValueError(f"WeightUpdate LoRA factors for {name!r}: A {tuple(f.A.shape)}, B {tuple(f.B.shape)} "
                                 f"do not fit the weight {(out, inp)} (A [r, in], B [out, r])")
            if not math.isfinite(f.scale):
                raise ValueError(f"WeightUpdate LoRA factors for {name!r}: scale {f.scale!r} is not finite")

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
        values); ``update.lora`` factors set their weights to ``W0 + scale * B @ A`` with ``W0``
        from ``lora_base`` (:func:`conveyor.sync.apply_update`). Thread-safe. From asyncio code, use ``wait=False`` and
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
            KeyError: a tensor name is not in the model's state dict, or LoRA factors name a
                weight without a base in ``lora_base`` (named in the message).
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
                    # tensors, aliases, and LoRA factors merged onto lora_base (never onto the
                    # previous version's weights)
                    apply_update(self._targets, pending.update, self._lora_base)
            except BaseException as e:  # validated beforehand; report anything unexpected
                log.exception("applying weight update version %s failed", pending.update.version)
                pending.future.set_exception(e)
                continue
            dt = time.perf_counter() - t0
            self._prefix_cache.clear()  # its keys / values belong to the previous weights
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
            self._default_threads = set_own_thread_count(self._num_threads)
        with self._cond:
            self._stats["num_threads"] = torch.get_num_threads()

    def _restore_default_threads(self) -> None:
        """Put the process-wide default thread count back (set from a short-lived helper thread,
        so the decode thread keeps its own count); nothing before the decode thread set one."""
        default = getattr(self, "_default_threads", None)
        if default is not None:
            restore_default_thread_count(default)

    def set_num_threads(self, n: int) -> None:
        """Change the decode thread's intra-op thread count from its next step on (elastic
        cores, issue 16: the runtime lends the engine the trainer's cores while the trainer
        waits for a batch and takes them back before it trains). Only the decode thread changes
        (as ``num_threads`` at construction); the count applies between two forward passes.
        Thread-safe, returns at once; a count equal to the current one costs nothing.

        Args:
            n: Intra-op threads (int >= 1).

        Raises:
            ValueError: ``n`` is not an int >= 1.
        """
        if not _is_int(n) or n < 1:
            raise ValueError(f"num_threads must be an int >= 1, got {n!r}")
        with self._cond:
            self._threads_wanted = n

    def _apply_thread_change(self) -> None:
        """Decode thread, between two steps: apply :meth:`set_num_threads` (the process-wide
        default stays what it was before the engine started, as in :meth:`_set_thread_count`)."""
        with self._cond:
            n, self._threads_wanted = self._threads_wanted, None
        if n is None or n == torch.get_num_threads():
            return
        torch.set_num_threads(n)
        self._restore_default_threads()
        with self._cond:
            self._stats["num_threads"] = n
            self._stats["thread_changes"] += 1

    def _loop(self) -> None:
        try:
            self._set_thread_count()
            with torch.inference_mode():
                while True:
                    with self._cond:
                        self._in_step = False
                        self._cond.notify_all()
                        self._wait_for_work()
                        updates, self._updates = self._updates, []
                        stopping = self._stopping
                        paused = self._paused
                        self._in_step = True
                        rethread = self._threads_wanted is not None
                    if rethread:
                        self._apply_thread_change()
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
                        elif self._abort_pending:  # abort() while paused: finish them now
                            self._reap()
        except BaseException as e:  # crash: fail every request and update, keep the error
            log.exception("InferenceEngine decode thread crashed")
            self._crash(e)
        finally:
            with self._cond:
                self._in_step = False
                self._cond.notify_all()

    def _has_work(self) -> bool:
        return bool(self._stopping or self._updates or self._abort_pending or (
            not self._paused and (self._waiting or self._batch is not None or self._reencode)))

    def _wait_for_work(self) -> None:
        """Decode thread, holding ``_cond``: wait until there is work, and, while the cores are
        lent (:meth:`lend_threads`), until they are given back (at most
        :data:`RECLAIM_TIMEOUT_S`; :meth:`stop` does not wait)."""
        while not self._has_work():
            if self._idle_since is None:
                self._idle_since = time.perf_counter()
            self._cond.wait()
        if self._lent and not self._stopping and not self._overrun:
            t0 = time.perf_counter()
            self._reclaim = True
            self._stats["reclaims"] += 1
            while self._lent and not self._stopping:
                left = RECLAIM_TIMEOUT_S - (time.perf_counter() - t0)
                if left <= 0:
                    self._stats["reclaim_timeouts"] += 1
                    self._overrun = True
                    log.warning("engine: the borrower kept the lent cores %.0f s after work arrived; "
                                "running anyway", RECLAIM_TIMEOUT_S)
                    break
                self._cond.wait(left)
            self._stats["reclaim_wait_seconds"] += time.perf_counter() - t0
        self._idle_since = None

    def _crash(self, error: BaseException) -> None:
        with self._cond:
            self._failure = error
            self._stopped = True
            reqs = [r for r in self._live.values() if not r.cancelled]
            self._live.clear()
            self._waiting.clear()
            self._prefix_cache.clear()
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
        """One scheduling round: drop cancelled / aborted requests, re-encode / admit, one
        decode step."""
        self._reap()
        with self._cond:
            running = len(self._reencode) + (len(self._batch.reqs) if self._batch else 0)
            admit = []
            while self._waiting and running + len(admit) < self._max_batch_size:
                admit.append(self._waiting.popleft())
            self._running_count = running + len(admit)
        if self._reencode:
            reqs, self._reencode = self._reencode, []
            t0 = time.perf_counter()
            self._reencode_requests(reqs)
            dt = time.perf_counter() - t0
            with self._cond:
                self._stats["pause_seconds_total"] += dt
                self._stats["reencoded_tokens"] += sum(
                    len(r.prompt_ids) + len(r.token_ids) for r in reqs
                )
        if admit:
            misses, joined, hits = [], [], []
            for req in admit:
                seq = req.prompt_ids + req.token_ids
                hit = self._prefix_cache.lookup(seq) if self._prefix_cache.max_tokens else None
                if hit is None:
                    misses.append(req)
                elif len(seq) - hit[0] <= self._feed_tokens:
                    joined.append((req, *hit))
                else:
                    hits.append((req, *hit))
            if joined:  # a few tokens left (a tool's result, a group-mate's last prompt token): decode steps run them
                self._join_from_prefix(joined)
            if hits:
                self._prefill_hits(hits, "prefix_hit")
            if misses:
                self._prefill(misses, kind="admit")
        if self._batch is not None:
            self._decode()
        with self._cond:
            self._running_count = len(self._batch.reqs) if self._batch else 0

    def _reencode_requests(self, reqs: list[_Request]) -> None:
        """Re-encode ``prompt + response so far`` of ``reqs`` with the weights just loaded (their
        KV caches were dropped), sample each one's next token and merge them into the running
        batch. With the prefix cache on, the prefixes several rows share (a group's prompt:
        :func:`_shared_prefixes`) are prefilled once into the (just emptied) cache and each row
        runs only the rest, packed into a few passes (:meth:`_prefill_hits`); without it, or for
        rows sharing nothing, every row runs whole (:meth:`_prefill`). The same computation
        either way (keys / values of a prefix do not depend on what follows it)."""
        for r in reqs:  # a re-encode runs the whole sequence, tokens still to be fed included
            r.feed = []
        if not self._prefix_cache.max_tokens or len(reqs) < 2:
            self._prefill(reqs, kind="reencode")
            return
        seqs = [r.prompt_ids + r.token_ids for r in reqs]
        prefixes = _shared_prefixes(seqs, _SHARED_PREFIX_MIN)
        if prefixes:
            self._prefill_prefixes(prefixes)
        hits, misses = [], []
        for r, seq in zip(reqs, seqs, strict=True):
            hit = self._prefix_cache.lookup(seq)
            if hit is None:
                misses.append(r)
            else:
                hits.append((r, *hit))
        if hits:
            self._prefill_hits(hits, "reencode")
        if misses:
            self._prefill(misses, kind="reencode")

    def _prefill_prefixes(self, prefixes: list[tuple[int, ...]]) -> None:
        """Prefill token sequences into the prefix cache only (no request, nothing sampled; a
        re-encode's shared prefixes, :func:`_shared_prefixes`), profiled and counted as
        ``reencode``. A prefix runs after the ones nested in it and only its own tokens (a hit on
        the longest, packed by :func:`_plan_hit_passes`); the others whole, in passes of at most
        ``_PREFILL_MAX_TOKENS`` padded tokens."""
        todo = sorted(prefixes, key=len)
        while todo:
            level = {p for p in todo if not any(len(q) < len(p) and p[: len(q)] == q for q in todo)}
            todo = [p for p in todo if p not in level]
            misses, hits = [], []
            for p in sorted(level, key=lambda p: (-len(p), p)):  # longest first, as the passes pack them
                hit = self._prefix_cache.lookup(p)
                if hit is None:
                    misses.append(list(p))
                else:
                    hits.append((p, *hit))
            for chunk in _token_chunks(misses, [len(q) for q in misses]):
                ids, mask, position_ids, pad, length = _padded_prefill_inputs(chunk, self._pad_id)
                layers = [_KVLayer() for _ in range(self._num_layers)]
                self._prefill_forward(ids, mask, position_ids, layers, "reencode",
                                      prefill_tokens=sum(len(q) for q in chunk))
                self._cache_rows(chunk, layers, pad, length)
            for rows in _hit_passes(hits, [len(p) for p, _, _ in hits]):
                group = [(hits[j][0], keep, kv) for j, keep, kv in rows]
                _, layers, pad, length = self._forward_from_prefix(group, "reencode")
                self._cache_rows([p for p, _, _ in group], layers, pad, length)

    def _cache_rows(self, keys: Sequence[Sequence[int]], layers: list[_KVLayer], pad: torch.Tensor,
                    end: int) -> None:
        """Insert row ``b``'s keys / values, columns ``pad[b]:end`` of ``layers``, under ``keys[b]``
        (its tokens) into the prefix cache."""
        if not self._prefix_cache.max_tokens:
            return
        for b, key in enumerate(keys):
            p = int(pad[b])
            self._prefix_cache.insert(key, lambda b=b, p=p: [
                (la.kbuf[b, :, p:end].clone(), la.vbuf[b, :, p:end].clone()) for la in layers])

    def _prefill_hits(self, hits: list[tuple[_Request, int, list[tuple[torch.Tensor, torch.Tensor]]]],
                      kind: str) -> None:
        """Run prefix-cache hits (``(request, cached tokens, per-layer (keys [H, n, D], values))``,
        any numbers of tokens left) in as few, small forward passes as pay
        (:func:`_plan_hit_passes`): in each pass every row runs the pass's largest number of
        tokens left, a row with fewer recomputing the end of its cached part (the same keys /
        values), then samples and joins the running batch (:meth:`_prefill_from_prefix`).
        Requests with the same sequence (a group's prompt admitted together) are planned as one
        row and run through the model once."""
        rows_of: dict[tuple[int, ...], list[int]] = {}
        for i, (r, _, _) in enumerate(hits):
            rows_of.setdefault(tuple(r.prompt_ids + r.token_ids), []).append(i)
        members = list(rows_of.values())
        uniq = [hits[m[0]] for m in members]  # a sequence's requests share its lookup (cached n, keys / values)
        for rows in _hit_passes(uniq, [len(r.prompt_ids) + len(r.token_ids) for r, _, _ in uniq]):
            self._prefill_from_prefix([(hits[i][0], keep, kv) for u, keep, kv in rows for i in members[u]], kind)

    def _reap(self) -> None:
        """Drop cancelled requests and finish the ones :meth:`abort` flagged with their tokens
        (decode thread, between two forward passes)."""
        with self._cond:
            self._abort_pending = False
            for rid in [rid for rid, r in self._live.items() if r.cancelled]:
                del self._live[rid]
            gone = [r for r in self._waiting if r.cancelled or r.aborted]
            if gone:
                self._waiting = deque(r for r in self._waiting if not (r.cancelled or r.aborted))
            gone += [r for r in self._reencode if r.cancelled or r.aborted]
            self._reencode = [r for r in self._reencode if not (r.cancelled or r.aborted)]
        if self._batch is not None and any(r.cancelled or r.aborted for r in self._batch.reqs):
            gone += [r for r in self._batch.reqs if r.cancelled or r.aborted]
            self._batch = _select(
                self._batch,
                [i for i, r in enumerate(self._batch.reqs) if not (r.cancelled or r.aborted)],
            )
        for req in gone:
            if req.aborted and not req.cancelled and req.finish_reason is None:
                self._finish(req, FINISH_ABORT)
        with self._cond:
            self._running_count = len(self._reencode) + (len(self._batch.reqs) if self._batch else 0)

    def _prefill(self, reqs: list[_Request], kind: str) -> None:
        """Encode ``prompt + response so far`` of ``reqs`` in fresh caches, sample each one's next
        token and merge the unfinished ones into the running batch (``kind``: ``"reencode"`` or
        ``"admit"``, for ``prefill_profile``)."""
        reqs = sorted(reqs, key=lambda r: len(r.prompt_ids) + len(r.token_ids), reverse=True)
        for chunk in _token_chunks(reqs, [len(r.prompt_ids) + len(r.token_ids) for r in reqs]):
            self._prefill_chunk(chunk, kind)

    def _prefill_chunk(self, reqs: list[_Request], kind: str) -> None:
        all_seqs = [r.prompt_ids + r.token_ids for r in reqs]
        # identical sequences (a group's prompt admitted together) run through the model once
        first: dict[tuple[int, ...], int] = {}
        row_of = [first.setdefault(tuple(q), len(first)) for q in all_seqs]
        seqs = [list(q) for q in first]
        ids, mask, position_ids, pad, length = _padded_prefill_inputs(seqs, self._pad_id)
        layers = [_KVLayer() for _ in range(self._num_layers)]
        logits = self._prefill_forward(ids, mask, position_ids, layers, kind,
                                       prefill_tokens=sum(len(s) for s in seqs),
                                       prefill_dedup_tokens=sum(len(s) for s in all_seqs) - sum(len(s) for s in seqs))
        # each prompt but its last token: a later group-mate runs 1 token
        self._cache_rows([q[:-1] for q in seqs], layers, pad, length - 1)
        if len(seqs) < len(reqs):  # every request its own row (its own sampling stream)
            idx = torch.tensor(row_of, dtype=torch.long)
            on_dev = to(idx, self.device)
            layers = [_KVLayer(la.kbuf.index_select(0, on_dev), la.vbuf.index_select(0, on_dev), la.length)
                      for la in layers]
            pad, logits = pad.index_select(0, idx), logits.index_select(0, on_dev)
        plan = _make_plan([r.params for r in reqs])
        tokens = self._sample_and_record(reqs, logits, plan)
        self._join(_Batch(reqs=reqs, layers=layers, pad=pad, length=length, pending=tokens, plan=plan))

    def _join(self, new: _Batch) -> None:
        """Merge the unfinished requests of a prefilled batch into the running batch (its copy
        time counts in ``merge_seconds``)."""
        new = _select(new, [i for i, r in enumerate(new.reqs) if r.finish_reason is None])
        if new is None:
            return
        t0 = time.perf_counter()
        self._batch = _merge(self._batch, new)
        dt = time.perf_counter() - t0
        with self._cond:
            self._stats["merge_seconds"] += dt

    def _prefill_forward(self, ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor,
                         layers: list[_KVLayer], kind: str, **counts: int) -> torch.Tensor:
        """One prefill forward pass into ``layers``: the last position's logits ``[B, V]``; its
        seconds count as busy and prefill time (and under ``kind`` in ``prefill_profile``),
        ``counts`` are added to the stats."""
        t0 = time.perf_counter()
        dev = self.device
        out = self.model(input_ids=to(ids, dev), attention_mask=to(mask, dev), position_ids=to(position_ids, dev),
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: Cache(layers=layers)})
        synchronize(dev)  # (CUDA: kernels run asynchronously; the busy time is the forward pass's)
        dt = time.perf_counter() - t0
        with self._cond:
            self._stats["busy_seconds"] += dt
            self._stats["prefill_seconds"] += dt
            self._stats["prefill_forwards"] += 1
            prof = self._prefill_profile.setdefault(kind, [0, 0, 0, 0.0])
            prof[0] += 1
            prof[1] += ids.shape[0]
            prof[2] += ids.numel()
            prof[3] += dt
            for k, v in counts.items():
                self._stats[k] += v
        return out.logits[:, -1, :]

    def _prefill_from_prefix(self, hits: list[tuple[_Request, int, list[tuple[torch.Tensor, torch.Tensor]]]],
                             kind: str = "prefix_hit") -> None:
        """Admit requests whose first tokens have cached keys / values (the prefix cache): only
        the rest of each sequence runs through the model, then they join the running batch.
        ``hits``: ``(request, cached tokens, per-layer (keys [H, n, D], values))``, all with the
        same number of tokens left to run (``S``), so they share one forward pass: each row's
        cached part is left-padded to end at the same column and its ``S`` new tokens follow
        (the running batch's layout, no gap in any row). Requests with the same sequence run as
        one row (counted in ``prefill_dedup_tokens``), and each sequence but its last token is
        cached, as a prefill does (a later group-mate then runs one token). ``kind``:
        ``"prefix_hit"`` (an admission: counted as prefix-cache hits) or ``"reencode"`` (rows of a
        re-encode whose shared prefix was prefilled once: counted in ``reencode_prefix_tokens``)."""
        reqs = [r for r, _, _ in hits]
        seqs = [r.prompt_ids + r.token_ids for r in reqs]
        first: dict[tuple[int, ...], int] = {}
        row_of = [first.setdefault(tuple(q), len(first)) for q in seqs]
        uniq = [(q, *hits[row_of.index(u)][1:]) for u, q in enumerate(first)]  # each sequence's first request
        S = len(uniq[0][0]) - uniq[0][1]
        all_cached = sum(n for _, n, _ in hits)
        counts = ({"prefix_cache_hits": len(hits), "prefix_cache_hit_tokens": all_cached} if kind == "prefix_hit"
                  else {"reencode_prefix_tokens": all_cached})
        logits, layers, pad, length = self._forward_from_prefix(
            uniq, kind, prefill_dedup_tokens=S * (len(hits) - len(uniq)), **counts)
        self._cache_rows([q[:-1] for q in first], layers, pad, length - 1)  # each but its last token, as a prefill
        if len(uniq) < len(reqs):  # every request its own row (its own sampling stream)
            idx = torch.tensor(row_of, dtype=torch.long)
            on_dev = to(idx, self.device)
            layers = [_KVLayer(la.kbuf.index_select(0, on_dev), la.vbuf.index_select(0, on_dev), la.length)
                      for la in layers]
            pad, logits = pad.index_select(0, idx), logits.index_select(0, on_dev)
        plan = _make_plan([r.params for r in reqs])
        tokens = self._sample_and_record(reqs, logits, plan)
        self._join(_Batch(reqs=reqs, layers=layers, pad=pad, length=length, pending=tokens, plan=plan))

    def _forward_from_prefix(self, rows: list[tuple[Sequence[int], int, list[tuple[torch.Tensor, torch.Tensor]]]],
                             kind: str, **counts: int) -> tuple[torch.Tensor, list[_KVLayer], torch.Tensor, int]:
        """One forward pass over sequences whose first tokens have cached keys / values: ``rows``
        ``(tokens, cached tokens n, per-layer (keys [H, n, D], values))``, all with the same number
        ``S`` of tokens left. Each row's cached part is left-padded to end at the same column and
        its ``S`` new tokens follow (the running batch's layout, no gap in any row). Returns the
        last position's logits ``[B, V]``, the per-layer caches, the left padding ``[B]`` and the
        length (columns) of the rows; profiled under ``kind``, ``counts`` added to the stats."""
        cached = [n for _, n, _ in rows]
        rest = [list(q[n:]) for q, n, _ in rows]
        S = len(rest[0])
        past = max(cached)
        length = past + S
        pad, layers = self._cached_rows(rows, S)
        cols = torch.arange(length)
        q = torch.arange(past, length)
        causal = cols.unsqueeze(0) <= q.unsqueeze(1)  # [S(query), length(key)]
        real = cols.unsqueeze(0) >= pad.unsqueeze(1)  # [B, length]
        mask = (causal.unsqueeze(0) & real.unsqueeze(1)).unsqueeze(1)  # [B, 1, S, length]
        position_ids = torch.tensor(cached, dtype=torch.long).unsqueeze(1) + torch.arange(S).unsqueeze(0)
        logits = self._prefill_forward(torch.tensor(rest, dtype=torch.long), mask, position_ids, layers, kind,
                                       prefill_tokens=S * len(rows), **counts)
        return logits, layers, pad, length

    def _cached_rows(self, hits: list, left: int) -> tuple[torch.Tensor, list[_KVLayer]]:
        """The left padding ``[B]`` and per-layer caches of prefix-cache ``hits`` (as in
        :meth:`_prefill_from_prefix`): each row's cached keys / values end at the same column,
        with room for ``left`` more tokens before the buffers grow."""
        cached = [n for _, n, _ in hits]
        past = max(cached)
        layers = []
        for li in range(self._num_layers):
            k0 = hits[0][2][li][0]
            h, _, d = k0.shape
            kbuf = k0.new_zeros(len(hits), h, past + left + _KV_GROWTH, d)
            vbuf = k0.new_zeros(len(hits), h, past + left + _KV_GROWTH, d)
            for b, (_, n, kv) in enumerate(hits):
                kbuf[b, :, past - n : past].copy_(kv[li][0])
                vbuf[b, :, past - n : past].copy_(kv[li][1])
            layers.append(_KVLayer(kbuf, vbuf, past))
        return torch.tensor([past - n for n in cached], dtype=torch.long), layers

    def _join_from_prefix(self, hits: list[tuple[_Request, int, list[tuple[torch.Tensor, torch.Tensor]]]]) -> None:
        """Admit prefix-cache hits with at most ``prefix_feed_tokens`` tokens left without a
        forward pass of their own: they join the running batch with the first uncached token as
        their pending input and the others in :attr:`_Request.feed`; each decode step runs one of
        them (a group-mate whose sibling prefilled the shared prompt: one; a tool's result: a
        few) and the step after the last one samples the row's next token from its logits. The
        same computation as a prefill of those tokens, one query at a time; no pass of one or two
        rows each admission round. ``hits`` as in :meth:`_prefill_from_prefix`, any number of
        tokens left (1 to ``prefix_feed_tokens``)."""
        reqs = [r for r, _, _ in hits]
        rest = [(r.prompt_ids + r.token_ids)[n:] for r, n, _ in hits]
        pad, layers = self._cached_rows(hits, max(len(x) for x in rest))
        for r, x in zip(reqs, rest, strict=True):
            r.feed = x[1:]
        first = torch.tensor([x[0] for x in rest], dtype=torch.long)
        with self._cond:
            self._stats["prefix_cache_hits"] += len(hits)
            self._stats["prefix_cache_hit_tokens"] += sum(n for _, n, _ in hits)
            self._stats["prefix_hits_joined"] += len(hits)
            self._stats["prefix_fed_tokens"] += sum(len(x) for x in rest)
        self._join(_Batch(reqs=reqs, layers=layers, pad=pad, length=layers[0].length, pending=first,
                          plan=_make_plan([r.params for r in reqs])))

    def _decode(self) -> None:
        fault_point("generate")  # chaos suite: a kill during generation
        batch = self._batch
        length = batch.length + 1
        mask = torch.arange(length).unsqueeze(0) >= batch.pad.unsqueeze(1)
        position_ids = (batch.length - batch.pad).unsqueeze(1)
        t0 = time.perf_counter()
        dev = self.device
        out = self.model(
            input_ids=to(batch.pending.unsqueeze(1), dev),
            attention_mask=to(mask[:, None, None, :], dev),
            position_ids=to(position_ids, dev),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: batch.cache()},
        )
        synchronize(dev)
        dt = time.perf_counter() - t0
        batch.length = length
        with self._cond:
            self._stats["busy_seconds"] += dt
            self._stats["decode_steps"] += 1
            prof = self._decode_profile.setdefault(len(batch.reqs), [0, 0.0])
            prof[0] += 1
            prof[1] += dt
        logits = out.logits[:, -1, :]
        fed = [i for i, r in enumerate(batch.reqs) if r.feed]
        if not fed:
            batch.pending = self._sample_and_record(batch.reqs, logits, batch.plan)
        else:  # rows still running a prefix hit's tokens take their next one and sample nothing
            pending = batch.pending.clone()
            for i in fed:
                pending[i] = batch.reqs[i].feed.pop(0)
            fed_rows = set(fed)
            rows = [i for i in range(len(batch.reqs)) if i not in fed_rows]
            if rows:
                idx = torch.tensor(rows, dtype=torch.long)
                reqs = [batch.reqs[i] for i in rows]
                tokens = self._sample_and_record(reqs, logits.index_select(0, to(idx, logits.device)),
                                                 _make_plan([r.params for r in reqs]))
                pending.index_copy_(0, idx, tokens)
            batch.pending = pending
        done = [r.finish_reason is not None for r in batch.reqs]
        if any(done):
            if self._prefix_cache.max_tokens:
                self._cache_finished(batch, done)
            self._batch = _select(batch, [i for i, d in enumerate(done) if not d])

    def _cache_finished(self, batch: _Batch, done: list[bool]) -> None:
        """Keep the keys / values of the requests that just finished with ``stop`` (a tool call
        or a turn whose episode may continue): ``prompt + tokens`` but the last token, which was
        sampled and never run through the model."""
        for b, (req, d) in enumerate(zip(batch.reqs, done, strict=True)):
            if not d or req.finish_reason != FINISH_STOP:
                continue
            p = int(batch.pad[b])
            key = req.prompt_ids + req.token_ids[:-1]
            if batch.length - p != len(key):  # never expected: do not cache what does not line up
                continue
            self._prefix_cache.insert(key, lambda b=b, p=p: [
                (la.kbuf[b, :, p : batch.length].clone(), la.vbuf[b, :, p : batch.length].clone())
                for la in batch.layers])

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
            sampling_mask=req.sampling_mask(len(req.token_ids)),
            key=self.request_key(req.rid),
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
