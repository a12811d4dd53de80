"""Rollout side of conveyor: admitting, running and buffering rollouts.

Modules (MISSION.md section 1, AReaL arXiv 2505.24298):

- ``staleness``: :class:`~conveyor.rollout.staleness.StalenessManager`, the admission rule
  that bounds how many policy versions a trajectory may lag behind the trainer (eta).
- ``buffer``: :class:`~conveyor.rollout.buffer.TrajectoryBuffer`, which holds finished groups of
  trajectories and hands out the oldest ones still within the staleness bound, each once.

Import from the submodules directly (this package deliberately re-exports nothing).
"""
