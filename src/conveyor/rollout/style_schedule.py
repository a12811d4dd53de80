"""The target-style schedule of the online preference-shift task (issue 13, section 5; SAO's
"online learning with shifting preferences", MISSION.md section 3).

The target style switches every ``data.style_every`` policy versions along
``data.style_schedule`` (:func:`style_at_version`). The style in force is the one at the policy
version when the episode is *admitted* (the rollout controller takes the sample from its data
stream): :class:`StyleScheduleStream` wraps the run's :class:`~conveyor.rollout.controller.DataStream`
and stamps it on a copy of each sample it hands out (``metadata["target_style"]`` and
``metadata["style_version"]``, the version it was read at), which the reward
(:func:`conveyor.rewards.styles.style_reward`, in a reward worker process) and the step metrics
(:func:`conveyor.rewards.styles.style_batch_metrics`) read. No state is shared: the wrapper only
reads the version through a getter, and the samples of the data set are never modified.

A resumed run continues the schedule from its checkpoint's policy version; episodes in flight at
the checkpoint are re-queued and stamped again when they are admitted again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from conveyor.rewards.styles import STYLES
from conveyor.types import Sample


def style_at_version(schedule: Sequence[str], every: int, version: int) -> str:
    """The target style in force at policy ``version``: ``schedule[min(version // every,
    len(schedule) - 1)]`` (versions ``0 .. every - 1`` get the first style; after the last switch
    the last style stays; repeat names in ``schedule`` to cycle).

    Args:
        schedule: Style names (``data.style_schedule``), each one of
            :data:`~conveyor.rewards.styles.STYLES`.
        every: Policy versions per entry (``data.style_every``, >= 1).
        version: The policy version (>= 0).

    Raises:
        ValueError: an empty ``schedule``, an unknown style, ``every < 1`` or ``version < 0``
            (naming the config keys).
    """
    if not schedule:
        raise ValueError("data.style_schedule is empty: no target style to stamp")
    unknown = [s for s in schedule if s not in STYLES]
    if unknown:
        raise ValueError(f"data.style_schedule: unknown styles {unknown}; the styles are {list(STYLES)}")
    if every < 1:
        raise ValueError(f"data.style_every must be >= 1, got {every}")
    if version < 0:
        raise ValueError(f"style_at_version: version must be >= 0, got {version}")
    return schedule[min(version // every, len(schedule) - 1)]


def stamp_target_style(sample: Sample, style: str, version: int | None = None) -> Sample:
    """A copy of ``sample`` whose metadata also holds ``target_style`` (and ``style_version``:
    the policy version it was stamped at, when given); ``sample`` itself is not modified.

    Raises:
        ValueError: ``style`` is not one of :data:`~conveyor.rewards.styles.STYLES`.
    """
    if style not in STYLES:
        raise ValueError(f"target style {style!r} is not one of {STYLES}")
    meta = {**sample.metadata, "target_style": style}
    if version is not None:
        meta["style_version"] = int(version)
    return dataclasses.replace(sample, metadata=meta)


class StyleScheduleStream:
    """A :class:`~conveyor.rollout.controller.DataStream` whose samples carry the target style in
    force when they are handed out (:func:`style_at_version` at ``version()``).

    Everything else is the wrapped stream's: the cursor, re-queue and skip set, and its
    checkpoint state (:meth:`state_dict` is the wrapped stream's, so checkpoints of runs with and
    without a schedule are interchangeable).

    Args:
        stream: The data stream.
        schedule: ``data.style_schedule`` (non-empty).
        every: ``data.style_every``.
        version: Returns the policy version episodes are admitted at now (the rollout
            controller's published version); called once per sample handed out.

    Raises:
        ValueError: see :func:`style_at_version`.
    """

    def __init__(self, stream, schedule: Sequence[str], every: int, version: Callable[[], int]):
        style_at_version(schedule, every, 0)  # the arguments' errors now, not at the first episode
        self.stream = stream
        self.schedule = tuple(schedule)
        self.every = int(every)
        self.version = version

    def next(self) -> tuple[int, Sample]:
        """The wrapped stream's next ``(index, sample)``, the sample stamped with the target style
        in force at the current version (:func:`stamp_target_style`)."""
        i, sample = self.stream.next()
        v = int(self.version())
        return i, stamp_target_style(sample, style_at_version(self.schedule, self.every, v), version=v)

    def state_dict(self) -> dict:
        """The wrapped stream's state (the schedule is config, not state)."""
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore the wrapped stream's state."""
        self.stream.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:  # samples, skip, requeue, epoch, pos, ...
        if name == "stream":  # not yet set (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.stream, name)


def with_style_schedule(stream, data_cfg, version: Callable[[], int]):
    """``stream`` wrapped in a :class:`StyleScheduleStream` when ``data_cfg.style_schedule`` (a
    :class:`~conveyor.config.DataConfig`) is set; ``stream`` itself otherwise. Where the runtimes
    build the rollout controller's data stream (``build_rollout``, the Ray ``RolloutActor``)."""
    if not data_cfg.style_schedule:
        return stream
    return StyleScheduleStream(stream, data_cfg.style_schedule, data_cfg.style_every, version)
