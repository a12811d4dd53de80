"""The step protocol, written once for every runtime (issue 12, section 1; MISSION.md section 1):

1. the publisher's ``before_step`` (e.g. the dedicated old-logit worker has scored every older
   version and delivered the patches);
2. wait for a batch the staleness rule admits at the trainer's version (:class:`RolloutPort`;
   the old-log-prob patches are attached as it leaves the rollout side), and train on it;
3. publish the new weights (:class:`~conveyor.runtime.publish.Publisher`: interrupt the engine,
   or partial-sync, or hand the outgoing tokens to the dedicated worker);
4. tell the rollout side the new version, only after the engine has it, so the capacity rule
   never admits a rollout of a version the engine does not run yet.

Recording (metrics rows, trained batches, evaluation, checkpoints) is the caller's
(:mod:`conveyor.runtime.record`, :mod:`conveyor.runtime.inline`). The step talks to the rollout
side only through :class:`RolloutPort`, so the same function drives the in-process controller
(:class:`LocalRollout`) and, later, a rollout actor in another process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from conveyor.rollout.controller import wait_for_batch
from conveyor.trainer.trainer import NonFiniteLossError
from conveyor.types import Trajectory

__all__ = ["LocalRollout", "RolloutPort", "StepOutcome", "run_step"]


@runtime_checkable
class RolloutPort(Protocol):
    """What the step protocol needs from the rollout side (controller, staleness rule, buffer)."""

    def next_batch(self, n: int, version: int, *, health: Callable[[], None] | None = None,
                   stop: threading.Event | None = None) -> list[Trajectory] | None:
        """Block until ``n`` trajectories admissible at trainer ``version`` are buffered and
        return them (oldest first); None when ``stop`` is set first. ``health`` is called while
        waiting and raises to abort (e.g. the controller crashed)."""
        ...

    def set_version(self, version: int) -> None:
        """The engine now samples ``version``: admit rollouts against it."""
        ...

    def buffered(self) -> list[Trajectory]:
        """The buffered trajectories (copies may do: only read), for old-log-prob scoring."""
        ...

    def apply_old_logprobs(self, patches: list) -> None:
        """Deliver :class:`~conveyor.rollout.old_logprobs.OldLogprobPatch` es: they reach their
        trajectories when those are handed out by :meth:`next_batch`."""
        ...

    def counters(self) -> dict[str, float]:
        """The controller's counters (``rollout/*``) for the step's metrics row."""
        ...

    def take_not_trained(self) -> list[dict]:
        """Trajectories dropped since the previous call (stale, filtered), for ``trained.jsonl``."""
        ...

    def training_ended(self) -> None:
        """The last update is done: stop work that only serves future batches (the reference
        scorer of ``trainer.reference_scoring``). Idempotent."""
        ...


class LocalRollout:
    """:class:`RolloutPort` over an in-process :class:`~conveyor.rollout.controller.RolloutController`
    and its :class:`~conveyor.rollout.buffer.TrajectoryBuffer`.

    Args:
        controller: The rollout controller (its own asyncio thread).
        buffer: The buffer the controller fills and the staleness rule empties.
        elastic: ``(engine, own, lent)`` (``rollout.elastic_threads``, issue 16): while
            :meth:`next_batch` waits, the engine decodes with ``lent`` intra-op threads (its own
            plus the waiting trainer's), and with ``own`` again once the batch is there, before
            the update runs (:meth:`InferenceEngine.set_num_threads
            <conveyor.rollout.engine.local.InferenceEngine.set_num_threads>`). None: fixed threads.
        reference: A :class:`~conveyor.trainer.reference.ReferenceScorer` that scores the KL
            reference's log-probs of buffered trajectories off the update
            (``trainer.reference_scoring=idle_engine`` or ``background``): its values are
            attached to each batch as it is handed out. None: the update scores them.
    """

    def __init__(self, controller, buffer, elastic: tuple | None = None, reference=None):
        self.controller = controller
        self.buffer = buffer
        self.elastic = elastic
        self.reference = reference

    def next_batch(self, n: int, version: int, *, health=None, stop=None) -> list[Trajectory] | None:
        if self.elastic is not None:  # lend the trainer's cores to the engine for the wait
            engine, own, lent = self.elastic
            engine.set_num_threads(lent)
        try:
            batch = wait_for_batch(self.buffer, n, lambda: version, health_fn=health, stop=stop,
                                   take=self.controller.take_batch)
        finally:
            if self.elastic is not None:
                engine.set_num_threads(own)
        if batch is None:
            return None
        batch = self.controller.hand_out(batch)
        if self.reference is not None:
            self.reference.attach(batch)
        return batch

    def set_version(self, version: int) -> None:
        self.controller.set_version(version)

    def training_ended(self) -> None:
        """Stop the reference scorer's thread (idempotent; nothing without one): after the last
        update there is nothing to score for."""
        if self.reference is not None:
            self.reference.stop()

    def buffered(self) -> list[Trajectory]:
        return [t for g in self.buffer.snapshot() for t in g]

    def apply_old_logprobs(self, patches: list) -> None:
        self.controller.apply_old_logprobs(patches)

    def counters(self) -> dict[str, float]:
        out = self.controller.counters()
        if self.reference is not None:  # cumulative, like the controller's counters
            st = self.reference.stats
            out.update({"reference/scored_trajectories": float(st.scored), "reference/attached_trajectories": float(st.attached),
                        "reference/scorer_busy_s": st.busy_seconds, "reference/scorer_forwards": float(st.forwards)})
        return out

    def take_not_trained(self) -> list[dict]:
        return self.controller.take_not_trained()


@dataclass
class StepOutcome:
    """One finished step.

    Attributes:
        batch: The trajectories trained on (``B`` = trainer.batch_size x group_size).
        metrics: The trainer's metrics plus the publish phase's (``time/weight_sync_s``: the
            publish and version hand-over, s; ``time/proximal_s`` includes partial-sync scoring).
        busy_s: Seconds the trainer side was busy (update + publish), for the busy fraction.
    """

    batch: list[Trajectory]
    metrics: dict[str, float]
    busy_s: float


@contextmanager
def _no_context() -> Iterator[dict]:
    yield {}


def run_step(trainer, rollout: RolloutPort, publisher, batch_size: int, *,
             health: Callable[[], None] | None = None,
             stop: threading.Event | None = None,
             update_context: Callable[[], AbstractContextManager[dict]] | None = None) -> StepOutcome | None:
    """One step of the protocol (module docstring): batch, update, publish, version.

    Args:
        trainer: The :class:`~conveyor.trainer.trainer.Trainer` (``version``, ``train_step``,
            ``weight_update``).
        rollout: The rollout side.
        publisher: The :class:`~conveyor.runtime.publish.Publisher` of the proximal strategy.
        batch_size: Trajectories per update.
        health: Called while waiting for the batch (raises to abort).
        stop: When set while waiting, the step is not taken.
        update_context: Entered around the update (not the wait, not the publish); what it
            yields is a dict of metrics added to the step's
            (:meth:`TrainerThreadBorrowing.update <conveyor.runtime.elastic.TrainerThreadBorrowing.update>`,
            ``trainer.elastic_threads``). None: nothing.

    Returns:
        The :class:`StepOutcome`, or None when ``stop`` was set before a batch was ready.

    Raises:
        NonFiniteLossError: the update gave a non-finite loss too many times in a row; the
            error's ``batch`` attribute holds the batch (the step counts: the caller logs it).
        Whatever publishing the new weights raises, with a ``trained_step`` attribute: the
            :class:`StepOutcome` of the update that was taken (the caller logs it).
        Whatever ``health`` raises.
    """
    t_before = time.perf_counter()
    publisher.before_step(trainer)
    before_s = time.perf_counter() - t_before
    batch = rollout.next_batch(batch_size, trainer.version, health=health, stop=stop)
    if batch is None:
        return None
    t0 = time.perf_counter()
    try:
        with (update_context or _no_context)() as extra:
            metrics = trainer.train_step(batch)
        metrics.update(extra)
    except NonFiniteLossError as e:
        e.batch = batch
        raise
    t_sync = time.perf_counter()
    try:
        metrics.update(publisher.publish(trainer))
    except BaseException as e:
        # the update itself happened (the trainer is at the new version, the final checkpoint
        # will hold it): the caller records the step before the error stops the run
        e.trained_step = StepOutcome(batch, metrics, before_s + time.perf_counter() - t0)
        raise
    metrics["time/proximal_s"] += metrics.get("time/partial_sync_s", 0.0)
    rollout.set_version(trainer.version)
    metrics["time/weight_sync_s"] = time.perf_counter() - t_sync
    return StepOutcome(batch, metrics, before_s + time.perf_counter() - t0)
