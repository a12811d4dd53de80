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

Old log-probs travel as messages: the scorer returns
:class:`~conveyor.rollout.old_logprobs.OldLogprobPatch` es addressed to the engine requests that
sampled the tokens, and the publisher hands them to the rollout side
(:meth:`~conveyor.runtime.step.RolloutPort.apply_old_logprobs`), which attaches them to the
trajectories when it hands a batch to the trainer. Nothing is shared or filled in place.
"""

from __future__ import annotations

import time

from conveyor.rollout.old_logprobs import ScoringItem, items_of_trajectory
from conveyor.trainer.proximal import Dedicated


def scoring_items(partials, buffered) -> list[ScoringItem]:
    """What a publish scores: the engine's requests (:class:`~conveyor.rollout.engine.PartialRequest`)
    and the buffered trajectories whose requests the engine no longer reports (e.g. restored
    from a checkpoint after a resume), each once."""
    items = [ScoringItem(list(p.prompt_ids), list(p.token_ids), list(p.versions), ((p.key, 0, len(p.token_ids)),),
                         p.sampling_mask) for p in partials]
    seen = {p.key for p in partials}
    for t in buffered:
        it = items_of_trajectory(t)
        if it is not None and not it.keys <= seen:
            items.append(it)
            seen |= it.keys
    return items


class Publisher:
    """Sends each new policy version to the engine (the step protocol's publish phase).

    Args:
        engine: The engine (:class:`~conveyor.rollout.engine.Engine`).
        rollout: The rollout side (:class:`~conveyor.runtime.step.RolloutPort`): its buffered
            trajectories are scored too, and it receives the old-log-prob patches.
    """

    #: whether the engine must keep its requests' tokens for scoring (``track_partials``)
    tracks_partials = False

    def __init__(self, engine, rollout):
        self.engine = engine
        self.rollout = rollout

    def start(self, trainer) -> None:
        """Before the first step (after any evaluation that used the engine)."""
        if self.tracks_partials:
            self.engine.partial_requests(require_pause=False)  # forget the evaluation's requests

    def before_step(self, trainer) -> None:
        """Before the batch of the policy update that will produce ``trainer.version + 1`` is
        taken (so every old-log-prob patch it needs has been delivered)."""

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
            items = scoring_items(self.engine.partial_requests(), self.rollout.buffered())
            # the engine scores with its own (outgoing) weights: its scoring capability
            patches, n = self.engine.score_old_logprobs(trainer.scoring_spec(), items)
            self.rollout.apply_old_logprobs(patches)
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

    def __init__(self, engine, rollout, worker: Dedicated):
        super().__init__(engine, rollout)
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
        items = scoring_items(self.engine.partial_requests(require_pause=False), self.rollout.buffered())
        self.worker.retire(items, upd, self.rollout.apply_old_logprobs)
        return {}

    def stop(self) -> None:
        self.worker.stop()


def publisher_for(proximal, engine, rollout) -> Publisher:
    """The publisher a proximal strategy needs (``proximal.name``).

    Raises:
        ValueError: ``partial_sync`` with an engine that cannot score old log-probs (a remote
            engine: no ``score_old_logprobs`` capability).
    """
    if proximal.name == "partial_sync":
        if not callable(getattr(engine, "score_old_logprobs", None)):
            raise ValueError(f"proximal.method=partial_sync needs an engine that scores old log-probs with its "
                             f"own weights ({type(engine).__name__} cannot); use proximal.method=dedicated "
                             "or recompute")
        return PartialSyncPublisher(engine, rollout)
    if proximal.name == "dedicated":
        return DedicatedPublisher(engine, rollout, proximal)
    return DirectPublisher(engine, rollout)


def tracks_partials(proximal) -> bool:
    """Whether the engine must keep its requests' tokens for ``proximal``'s publisher (before the
    engine exists)."""
    return proximal.name in ("partial_sync", "dedicated")
