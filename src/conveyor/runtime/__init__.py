"""The runtime: what runs the step protocol (wait for a batch, train, publish weights, record)
around the engine, the rollout controller and the trainer (issue 12, section 1).

- :mod:`conveyor.runtime.step`: the step protocol, once (:func:`~conveyor.runtime.step.run_step`
  over a :class:`~conveyor.runtime.step.RolloutPort`).
- :mod:`conveyor.runtime.publish`: the publish phase (one publisher per proximal strategy).
- :mod:`conveyor.runtime.record`: per-step metrics, logs and progress.
- :mod:`conveyor.runtime.inline`: every component in one process (threads); the loop with the
  critic warm-up, evaluations and checkpoints.
- :mod:`conveyor.runtime.ray` (``runtime.name=ray``): the rollout side in a Ray actor, bound to
  the same ports (the loop of :mod:`~conveyor.runtime.inline` runs unchanged in the driver).

:func:`conveyor.train.run_training` assembles a run from these.
"""
