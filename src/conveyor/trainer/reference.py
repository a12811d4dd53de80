"""The KL reference's log-probs scored off the update, on an idle engine core (issue 16).

With ``loss.kl_coef > 0`` every update runs the frozen reference policy over its batch (the
score phase, ``time/reference_s``): on the main job 4-5 s of a 21-23 s update on a 2-core CPU
where the trainer is the bottleneck and the engine's core idles a quarter of the time
(docs/results/main_job.md, sections 10 and 12). The reference never changes, so its log-probs of
a finished trajectory can be computed by anyone at any time before the update that trains it:
:class:`ReferenceScorer` is a background thread that scores buffered trajectories while the local
engine has nothing to run (``trainer.reference_scoring=idle_engine``) or, ungated, at the lowest
scheduling priority (``background``: the operating system gives it only CPU time no other thread
wants), and hands the values over as
the batch leaves the rollout side (:meth:`ReferenceScorer.attach`: ``metadata["reference_logprobs"]``,
as the old-log-prob book attaches its patches). The trainer uses attached values and scores only
the trajectories without them (:func:`reference_from_attached`, in
:meth:`conveyor.trainer.trainer.Trainer.score`), so the scorer never delays an update: at worst it
scored nothing and the update is what it was.

What it must never do: take the engine's core while the engine has work (``idle_engine`` checks
before every forward pass, so an admission waits at most one pass of ``micro_batch_tokens``;
``background`` leaves the choice to the scheduler, which prefers every other thread), change the numbers
(the same frozen module and the trainer's :class:`~conveyor.trainer.logprobs.ScoringSpec`:
temperature, autocast, chunking, kept sets; the packing differs from the update's, so values agree
to floating-point rounding, not bit for bit), or hold a trajectory longer than it stays buffered.

verl runs the reference as a worker role of its own (``ref`` in its Ray worker groups, colocated
with the actor or not); here the role is a thread that borrows the engine's idle core.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from conveyor.hardware import set_own_thread_count
from conveyor.trainer.batch import pack_micro_batches
from conveyor.types import Trajectory

log = logging.getLogger(__name__)

__all__ = ["ReferenceScorer", "ReferenceScorerStats", "next_to_score", "reference_from_attached", "score_reference"]


@dataclass
class ReferenceScorerStats:
    """Cumulative counters of a :class:`ReferenceScorer`.

    Attributes:
        scored: Trajectories scored.
        tokens: Action tokens scored.
        attached: Trajectories whose values reached a batch (:meth:`ReferenceScorer.attach`).
        busy_seconds: Seconds spent in forward passes (s).
        forwards: Forward passes run.
    """

    scored: int = 0
    tokens: int = 0
    attached: int = 0
    busy_seconds: float = 0.0
    forwards: int = 0


def _lowest_priority() -> bool:
    """Give the calling thread the lowest scheduling priority (Linux: ``setpriority`` on its
    thread id, nice 19; other threads keep theirs). Returns whether it was applied."""
    import os

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return True
    except (AttributeError, OSError) as e:  # not Linux, or not permitted: run at normal priority
        log.info("reference scorer: could not lower its thread's priority (%s)", e)
        return False


class ReferenceScorer:
    """Scores the frozen reference policy's log-probs of buffered trajectories in a background
    thread while the engine is idle (module docstring).

    The thread polls ``source()`` (the buffered trajectories, oldest first) every ``poll_s``
    seconds; while ``idle()`` is true it packs unscored ones, newest first (:func:`next_to_score`),
    into micro-batches of at most
    ``micro_batch_tokens`` tokens (a group's responses share their prompt, as in the update:
    :func:`~conveyor.trainer.batch.group_shared_prompts`) and runs one forward pass at a time,
    checking ``idle()`` before each. Results are kept per trajectory object until
    :meth:`attach` hands them to a batch or the trajectory has left the buffer for ``forget_s``
    seconds (dropped as stale).

    Args:
        model: The frozen reference policy (eval mode, no gradients; the trainer's own copy: it is
            only read, by this thread and the trainer's forward passes).
        spec: The trainer's :class:`~conveyor.trainer.logprobs.ScoringSpec` (temperature,
            autocast, chunking, packing budgets).
        source: Returns the buffered trajectories (e.g. :meth:`LocalRollout.buffered
            <conveyor.runtime.step.LocalRollout.buffered>`); only read.
        idle: Whether the engine has nothing to run now (:attr:`InferenceEngine.idle
            <conveyor.rollout.engine.local.InferenceEngine.idle>`); None: no such gate (with
            ``lowest_priority``, the operating system's scheduler is the gate).
        threads: Intra-op threads of the scoring thread (the engine's count: it borrows the
            engine's cores).
        micro_batch_tokens: Packed tokens per forward pass (bounds how long an admission can wait
            for the core: 1.56 s per pass of at most 1,024 tokens for SmolLM2 on one core of the
            2-core AMD EPYC, bf16 autocast, in the main job; docs/results/main_job.md section 13).
        share_prompts: Pack a group's prompt once (the update's ``trainer.share_prompts``; needs
            an attention implementation that takes a 4-D mask).
        poll_s: Seconds between looks at the buffer when there is nothing to do.
        forget_s: Seconds a result is kept after its trajectory left the buffer without being
            attached (a hand-out attaches within microseconds; a stale drop never does).
        lowest_priority: The thread lowers its own scheduling priority to the lowest (Linux: nice
            19 for this thread only), so it runs on CPU time no other thread of the machine wants
            (``trainer.reference_scoring=background``); elsewhere, or if refused, it runs as is.

    Raises:
        ValueError: ``threads`` < 1, ``micro_batch_tokens`` < 1, or ``poll_s`` / ``forget_s``
            not positive.
    """

    def __init__(self, model: torch.nn.Module, spec, source: Callable[[], list[Trajectory]],
                 idle: Callable[[], bool] | None, *, threads: int = 1, micro_batch_tokens: int = 1024,
                 share_prompts: bool = True, poll_s: float = 0.05, forget_s: float = 30.0,
                 lowest_priority: bool = False):
        if threads < 1:
            raise ValueError(f"ReferenceScorer: threads must be >= 1, got {threads}")
        if micro_batch_tokens < 1:
            raise ValueError(f"ReferenceScorer: micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
        if not (poll_s > 0 and forget_s > 0):
            raise ValueError(f"ReferenceScorer: poll_s and forget_s must be > 0, got {poll_s}, {forget_s}")
        self.model = model
        self.spec = spec
        self.source = source
        self.idle = idle
        self.threads = threads
        self.micro_batch_tokens = micro_batch_tokens
        self.share_prompts = share_prompts
        self.poll_s = poll_s
        self.forget_s = forget_s
        self.lowest_priority = lowest_priority
        self.stats = ReferenceScorerStats()
        self.error: BaseException | None = None
        # id(trajectory) -> (the trajectory, its values, when it was last seen buffered (monotonic s))
        self._results: dict[int, tuple[Trajectory, list[float], float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        """Start the scoring thread (idempotent)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="conveyor-reference", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the thread after its current forward pass (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            self._thread = None

    # ------------------------------------------------------------------ hand-over
    def attach(self, trajectories: list[Trajectory]) -> int:
        """Write ``metadata["reference_logprobs"]`` (a list of ``R`` floats: the reference's
        log-prob of every response token, NaN on observation tokens) into each of
        ``trajectories`` this scorer has scored, and forget them. Call it as the batch leaves the
        rollout side, before the update (the trainer thread). Returns how many got values."""
        n = 0
        with self._lock:
            for t in trajectories:
                got = self._results.pop(id(t), None)
                if got is not None and got[0] is t:
                    t.metadata["reference_logprobs"] = got[1]
                    n += 1
            self.stats.attached += n
        return n

    def pending(self) -> int:
        """Scored trajectories not yet attached (nor forgotten)."""
        with self._lock:
            return len(self._results)

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        try:
            set_own_thread_count(self.threads)
            if self.lowest_priority:
                _lowest_priority()
            with torch.inference_mode():
                while not self._stop.is_set():
                    if not self._score_some():
                        self._stop.wait(self.poll_s)
        except BaseException as e:  # the trainer computes what is missing: report, never crash the run
            self.error = e
            log.exception("reference scorer stopped; the updates compute the reference log-probs themselves")

    def _todo(self) -> list[Trajectory]:
        """Buffered trajectories without values (oldest first); forgets results whose
        trajectory has been out of the buffer for ``forget_s``."""
        now = time.monotonic()
        buffered = self.source()
        live = {id(t) for t in buffered}
        todo = []
        with self._lock:
            for key, (t, vals, seen) in list(self._results.items()):
                if key in live:
                    self._results[key] = (t, vals, now)
                elif now - seen > self.forget_s:
                    del self._results[key]
            for t in buffered:
                got = self._results.get(id(t))
                if got is None or got[0] is not t:
                    todo.append(t)
        return todo

    def _score_some(self) -> bool:
        """Score one micro-batch of unscored buffered trajectories if the engine is idle.
        Returns whether a forward pass ran."""
        if self.idle is not None and not self.idle():
            return False
        todo = self._todo()
        if not todo:
            return False
        chosen = next_to_score(todo, self.micro_batch_tokens)
        if self.idle is not None and not self.idle():  # the engine got work meanwhile: it has the core
            return False
        t0 = time.perf_counter()
        values = score_reference(self.spec, self.model, chosen, share_prompts=self.share_prompts)
        dt = time.perf_counter() - t0
        now = time.monotonic()
        with self._lock:
            for t, vals in zip(chosen, values, strict=True):
                self._results[id(t)] = (t, vals, now)
            self.stats.scored += len(chosen)
            self.stats.tokens += sum(sum(1 for v in vals if not math.isnan(v)) for vals in values)
            self.stats.busy_seconds += dt
            self.stats.forwards += 1
        return True


def next_to_score(todo: list[Trajectory], budget_tokens: int) -> list[Trajectory]:
    """The next trajectories for the reference scorer: the *newest* groups of ``todo`` (given
    oldest first, as the buffer holds them) whose ``prompt + response`` tokens fit
    ``budget_tokens`` (at least one trajectory), a group's members together while they fit.

    Newest first because the batch hands out the oldest: a scorer slower than the hand-out that
    took the oldest would finish each pass after its trajectories had left (measured at the
    lowest priority, oldest first: no value reached a batch after update 20, 307 of 469 scored
    trajectories in all; docs/results/main_job.md section 13), while the newest wait at least one
    more update.
    """
    by_group: dict[str, list[Trajectory]] = {}
    for t in todo:
        by_group.setdefault(t.group_id, []).append(t)
    chosen: list[Trajectory] = []
    used = 0
    for group in reversed(list(by_group.values())):
        for t in group:
            n = len(t.prompt_ids) + len(t.response_ids)
            if chosen and used + n > budget_tokens:
                return chosen
            chosen.append(t)
            used += n
    return chosen


def score_reference(spec, model: torch.nn.Module, trajectories: list[Trajectory], *,
                    share_prompts: bool = True) -> list[list[float]]:
    """The log-probs of every response token of ``trajectories`` under ``model`` (the KL
    reference), computed as the update computes them (``spec``: the trainer's
    :class:`~conveyor.trainer.logprobs.ScoringSpec`; kept sets of truncated sampling replayed).

    Args:
        spec: The trainer's scoring spec (its packing budgets split the work into forward passes).
        model: The reference policy.
        trajectories: Finished trajectories (``prompt_ids``, ``response_ids``, optional
            ``action_mask`` / ``sampling_mask``).
        share_prompts: Pack the responses of a prompt once per row (as ``trainer.share_prompts``).

    Returns:
        One list per trajectory, ``len(response_ids)`` floats (natural log): the log-prob of each
        action token, NaN on observation tokens (``action_mask`` 0: no loss, no KL term).
    """
    if not trajectories:
        return []
    out: list[list[float] | None] = [None] * len(trajectories)
    for mb in pack_micro_batches(trajectories, spec.micro_batch_tokens, spec.pack_row_tokens,
                                 share_prompts=share_prompts):
        lp = spec.logprobs(model, mb)
        for s, i in enumerate(mb.indices):
            here = mb.seq_index == s
            r = len(trajectories[i].response_ids)
            vals = [math.nan] * r
            rix, lps, m = mb.response_index[here].tolist(), lp[here].tolist(), mb.mask[here].tolist()
            for k, v, w in zip(rix, lps, m, strict=True):
                if k >= 0 and w > 0:
                    vals[k] = float(v)
            out[i] = vals
    return [v if v is not None else [] for v in out]


def reference_from_attached(mb, score_missing: Callable[[list[int]], list[list[float]]]
                            ) -> tuple[torch.Tensor, int] | None:
    """The micro-batch's reference log-probs ``[R, L]`` float32 (0 off the loss mask, as a
    forward pass of the update gives them) built from the values scored before the update
    (``mb.reference_logprobs``, packed from ``metadata["reference_logprobs"]``), the trajectories
    without them scored by ``score_missing``; and how many action tokens came precomputed.

    Args:
        mb: A :class:`~conveyor.trainer.batch.PackedBatch`.
        score_missing: Called once, only when some trajectory of ``mb`` lacks values, with their
            sequence indices ``s`` (``mb.seq_index``; trajectory ``mb.indices[s]`` of the step's
            batch); returns one list per index, a value per response token (:func:`score_reference`).

    Returns:
        ``(values, precomputed action tokens)``, or None when no trajectory of ``mb`` has values
        or ``mb`` has no action token (the caller runs its own pass over the whole micro-batch;
        a micro-batch without action tokens, e.g. data parallelism's padding copy, always does:
        every process of a group takes part in the same forward passes).
    """
    ref = mb.reference_logprobs
    if ref is None:
        return None
    on = mb.mask > 0
    have = torch.isfinite(ref) & on
    if not bool(on.any()) or not bool(have.any()):
        return None
    out = torch.where(have, ref, torch.zeros_like(ref))
    missing = on & ~have
    redone = torch.zeros_like(on)
    if bool(missing.any()):
        seqs = sorted(set(mb.seq_index[missing].tolist()))
        for s, vals in zip(seqs, score_missing(seqs), strict=True):
            pos = (mb.seq_index == s) & on
            out[pos] = torch.tensor([vals[k] for k in mb.response_index[pos].tolist()], dtype=out.dtype)
            redone |= pos
    return out, int((have & ~redone).sum())
