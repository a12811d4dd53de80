"""The publish phase of the step protocol: a new policy version goes from the trainer to the
engine, with whatever the proximal strategy must do around it (MISSION.md section 2).

A :class:`Publisher` owns that: the runtime calls :meth:`Publisher.before_step` before each
policy update and :meth:`Publisher.publish` after it, and never touches a strategy's internals.

- :class:`DirectPublisher`: the update is sent to the engine (interruptible rollouts continue
  with the new weights; recompute, behavior, snapshot, ewma, interpolate).
- :class:`PartialSyncPublisher` (``proximal.method=partial_sync``, recovery 3): the engine is
  paused; every token the outgoing version sampled (in-flight requests, finished ones, buffered
  trajectories) is scored with the engine's outgoing parameters before the update.
- :class:`DedicatedPublisher` (``proximal.method=dedicated``, recovery 2): the update is sent,
  then the dedicated worker scores the outgoing version's tokens on its own copy while the
  trainer goes on; the next update waits until it has.

Pending trajectories are handed over through ``pending()`` (the engine's partial requests and the
buffer's trajectories, as :class:`PendingTokens`); their ``old_logprobs`` lists are still filled
in place (``trajectory.metadata["old_logprobs"]``): replacing that shared list with messages is
the next step of issue 12.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from conveyor.trainer.proximal import Dedicated, score_partials


class PendingTokens:
    """A buffered trajectory seen as a partial request by
    :func:`~conveyor.trainer.proximal.score_partials`: its ``metadata["old_logprobs"]`` list is
    extended in place."""

    def __init__(self, t):
        self.prompt_ids, self.token_ids, self.versions = t.prompt_ids, t.response_ids, t.versions
        self.sampling_mask = t.sampling_mask  # kept sets: scored like the trainer
        self.old_logprobs = t.metadata.setdefault("old_logprobs", [])


def buffered_pending(buffer) -> list[PendingTokens]:
    """Every trajectory in ``buffer`` (a :class:`~conveyor.rollout.buffer.TrajectoryBuffer`) as
    :class:`PendingTokens`."""
    return [PendingTokens(t) for g in buffer.snapshot() for t in g]


class Publisher:
    """Sends each new policy version to the engine (the step protocol's publish phase).

    Args:
        engine: The engine (:class:`~conveyor.rollout.engine.Engine`).
        pending: ``() -> list`` of the buffered trajectories as :class:`PendingTokens` (for the
            strategies that score them).
    """

    #: whether the engine must keep its requests' tokens for scoring (``track_partials``)
    tracks_partials = False

    def __init__(self, engine, pending: Callable[[], list]):
        self.engine = engine
        self.pending = pending

    def start(self, trainer) -> None:
        """Before the first step (after any evaluation that used the engine)."""
        if self.tracks_partials:
            self.engine.partial_requests(require_pause=False)  # forget the evaluation's requests

    def before_step(self, trainer) -> None:
        """Before the policy update that will produce ``trainer.version + 1``."""

    def publish(self, trainer) -> dict[str, float]:
        """Send ``trainer``'s parameters (version ``trainer.version``) to the engine.

        Returns:
            Metrics of the phase (seconds, tokens scored), merged into the step's row.
        """
        raise NotImplementedError

    def stop(self) -> None:
        """After the last step (idempotent)."""


class DirectPublisher(Publisher):
    """The update goes straight to the engine."""

    def publish(self, trainer) -> dict[str, float]:
        self.engine.update_weights(trainer.weight_update())
        return {}


class PartialSyncPublisher(Publisher):
    """Pause, score every token of the outgoing version with the engine's outgoing parameters
    (MISSION.md section 2, recovery 3), update, resume."""

    tracks_partials = True

    def publish(self, trainer) -> dict[str, float]:
        t0 = time.perf_counter()
        self.engine.pause()
        try:
            pending = self.engine.partial_requests() + self.pending()
            n = score_partials(trainer, self.engine.model, pending, self.engine.version)
            dt = time.perf_counter() - t0
            self.engine.update_weights(trainer.weight_update())
        finally:
            self.engine.resume()
        # time/partial_sync_s is also proximal time (the runtime adds it to time/proximal_s)
        return {"proximal/partial_sync_tokens": float(n), "time/partial_sync_s": dt}


class DedicatedPublisher(Publisher):
    """Send the update, then hand the outgoing version's tokens to the dedicated old-logit worker
    (MISSION.md section 2, recovery 2); the next update waits until they are scored."""

    tracks_partials = True

    def __init__(self, engine, pending: Callable[[], list], worker: Dedicated):
        super().__init__(engine, pending)
        self.worker = worker

    def start(self, trainer) -> None:
        self.worker.start(trainer)
        super().start(trainer)

    def before_step(self, trainer) -> None:
        self.worker.wait_retired(trainer.version)  # every version below the trainer's is scored

    def publish(self, trainer) -> dict[str, float]:
        upd = trainer.weight_update()
        self.engine.update_weights(upd)
        # the engine no longer samples the outgoing version: its tokens can be scored now
        self.worker.retire(self.engine.partial_requests(require_pause=False) + self.pending(), upd)
        return {}

    def stop(self) -> None:
        self.worker.stop()


def publisher_for(proximal, engine, pending: Callable[[], list]) -> Publisher:
    """The publisher a proximal strategy needs (``proximal.name``)."""
    if proximal.name == "partial_sync":
        return PartialSyncPublisher(engine, pending)
    if proximal.name == "dedicated":
        return DedicatedPublisher(engine, pending, proximal)
    return DirectPublisher(engine, pending)


def tracks_partials(proximal) -> bool:
    """Whether the engine must keep its requests' tokens for ``proximal``'s publisher (before the
    engine exists)."""
    return proximal.name in ("partial_sync", "dedicated")
