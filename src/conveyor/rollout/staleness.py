"""Staleness-bounded admission of new rollouts (MISSION.md section 1; AReaL, arXiv 2505.24298).

AReaL bounds the staleness (version lag) of every trajectory by limiting how many rollouts may
be started: with trainer version ``v``, batch size ``B`` and maximum staleness ``eta``, the
``N``-th rollout may start only while ``floor((N - 1) / B) <= v + eta``. Its code enforces this as

    capacity(v) = min(max_concurrent - running, (eta + v + 1) * B - (accepted + running))

clamped at 0, where ``running`` counts rollouts in flight and ``accepted`` counts finished
rollouts kept for training. This module is that rule as one small, synchronous, thread-safe unit;
the asyncio rollout controller calls it.

Units: every count (``batch_size``, ``max_concurrent``, ``running``, ``accepted``, the ``n`` of
``on_start`` / ``on_accept`` / ``on_reject`` / ``on_drop``) is in trajectories, or in whatever
single unit the controller uses consistently (e.g. one rollout group of ``G`` responses per
``on_start(G)`` call, with ``batch_size`` then counting trajectories as well). Versions are
policy versions (number of optimiser steps taken), integers >= 0.
"""

from __future__ import annotations

import threading
from typing import Any

_COUNTERS = ("running", "accepted", "rejected", "dropped", "started")


def check_int(name: str, value: Any, minimum: int) -> int:
    """Return ``value`` if it is an ``int`` (not ``bool``) >= ``minimum``, else raise.

    Raises:
        ValueError: naming ``name`` when the value has the wrong type or is too small.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class StalenessManager:
    """Counts rollouts and computes how many new ones may start (AReaL's capacity rule).

    Rule (MISSION.md section 1; AReaL arXiv 2505.24298, staleness control)::

        capacity(v) = max(0, min(max_concurrent - running,
                                 (eta + v + 1) * batch_size - (accepted + running)))

    With ``eta = 0`` this is synchronous training (a rollout never outlives the version it
    started at); ``eta = 1`` is one-step overlap. ``eta = None`` means unbounded staleness: only
    ``max_concurrent`` limits admission (AReaL's "unbounded" setting, which it reports to hurt
    accuracy: AIME24 36.9 vs 42.2 at eta = 4 with the decoupled objective).

    Lifecycle the controller must follow (one unit = one trajectory, or one group consistently):

    - ``capacity(v)`` before starting; start at most that many, then ``on_start(n)``.
    - ``on_accept(n)`` when finished rollouts are kept (put into the buffer).
    - ``on_reject(n)`` when finished rollouts are discarded (workflow returned None, filtered):
      the slot is freed and nothing counts as accepted (AReaL semantics).
    - ``on_drop(n)`` when the buffer later discards accepted trajectories as too stale
      (:class:`conveyor.rollout.buffer.TrajectoryBuffer` calls it through ``on_drop=``): they
      leave ``accepted``, otherwise capacity would shrink for trajectories the trainer never
      consumes and admission could stall.
    - After a resume from checkpoint: ``reset_after_resume(v)`` (``accepted = v * batch_size``,
      ``running = 0``; MISSION.md section 1: a real bug was the capacity jumping after recovery).

    Invariant kept by a controller that follows the lifecycle: ``accepted + running <=
    (eta + v + 1) * batch_size`` at every trainer version ``v`` (after :meth:`set_eta` lowers
    eta it may be exceeded by rollouts admitted earlier; nothing new is admitted until it holds).

    All methods are thread-safe (one ``threading.Lock``).

    Args:
        batch_size: ``B``, trajectories consumed per trainer step (>= 1).
        eta: Maximum staleness in policy versions (>= 0), or None for unbounded.
        max_concurrent: Most rollouts in flight at once (>= 1).

    Raises:
        ValueError: naming the field when ``batch_size < 1``, ``eta < 0``,
            ``max_concurrent < 1`` or a value is not an int.
    """

    def __init__(self, batch_size: int, eta: int | None, max_concurrent: int) -> None:
        self._batch_size = check_int("batch_size", batch_size, 1)
        self._eta = None if eta is None else check_int("eta", eta, 0)
        self._max_concurrent = check_int("max_concurrent", max_concurrent, 1)
        self._lock = threading.Lock()
        self._running = 0
        self._accepted = 0
        self._rejected = 0
        self._dropped = 0
        self._started = 0

    # ---------------------------------------------------------------- configuration
    @property
    def batch_size(self) -> int:
        """``B``: trajectories per trainer batch."""
        return self._batch_size

    @property
    def eta(self) -> int | None:
        """Maximum staleness in policy versions; None = unbounded (changed by :meth:`set_eta`)."""
        with self._lock:
            return self._eta

    def set_eta(self, eta: int | None) -> None:
        """Change the staleness bound mid-run (e.g. from an adaptive controller).

        The capacity rule stays exact: :meth:`capacity` reads ``eta`` under the same lock as the
        counters, so every call after this one uses the new bound with the real ``accepted`` and
        ``running``. Lowering eta admits nothing until ``accepted + running`` fits in
        ``(eta_new + v + 1) * B`` (capacity clamped at 0; rollouts already in flight are not
        cancelled, and the buffer judges each by the bound it was admitted under,
        ``TrajectoryBuffer``: nothing admitted is thrown away for the change); raising it
        releases the extra capacity at once. ``None`` (unbounded) <-> int transitions are
        allowed: to None, only ``max_concurrent`` limits admission; from None, the bound applies
        to the counts accumulated while unbounded. The counters are untouched.

        Args:
            eta: New maximum staleness in policy versions (int >= 0), or None for unbounded.

        Raises:
            ValueError: naming ``eta`` when it is not None and not an int >= 0 (nothing changes).
        """
        new = None if eta is None else check_int("eta", eta, 0)
        with self._lock:
            self._eta = new

    @property
    def max_concurrent(self) -> int:
        """Most rollouts in flight at once."""
        return self._max_concurrent

    # ---------------------------------------------------------------- counters
    @property
    def running(self) -> int:
        """Rollouts started and not yet accepted or rejected."""
        with self._lock:
            return self._running

    @property
    def accepted(self) -> int:
        """Finished rollouts kept for training (minus those later dropped as stale)."""
        with self._lock:
            return self._accepted

    @property
    def rejected(self) -> int:
        """Finished rollouts discarded by the workflow / filter (cumulative)."""
        with self._lock:
            return self._rejected

    @property
    def dropped(self) -> int:
        """Accepted trajectories later discarded by the buffer as too stale (cumulative)."""
        with self._lock:
            return self._dropped

    @property
    def started(self) -> int:
        """Rollouts ever started (cumulative)."""
        with self._lock:
            return self._started

    def stats(self) -> dict[str, int]:
        """Snapshot of the counters: ``running``, ``accepted``, ``rejected``, ``dropped``, ``started``."""
        with self._lock:
            return self._counters()

    def _counters(self) -> dict[str, int]:
        return {name: getattr(self, f"_{name}") for name in _COUNTERS}

    # ---------------------------------------------------------------- the rule
    def capacity(self, version: int) -> int:
        """How many new rollouts may start now, at trainer version ``version``.

        ``max(0, min(max_concurrent - running, (eta + version + 1) * B - (accepted + running)))``;
        with ``eta = None`` only the first term applies (MISSION.md section 1; AReaL
        arXiv 2505.24298).

        Args:
            version: Current policy version of the trainer (>= 0).

        Returns:
            A count in rollouts (>= 0).

        Raises:
            ValueError: if ``version`` is not an int >= 0.
        """
        check_int("version", version, 0)
        with self._lock:
            cap = self._max_concurrent - self._running
            if self._eta is not None:
                bound = (self._eta + version + 1) * self._batch_size
                cap = min(cap, bound - (self._accepted + self._running))
            return max(0, cap)

    # ---------------------------------------------------------------- events
    def on_start(self, n: int = 1) -> None:
        """Record ``n`` rollouts started (``running += n``, ``started += n``).

        The controller is responsible for checking ``capacity(v)`` first; this method only
        guards the hard limit ``running <= max_concurrent``.

        Raises:
            ValueError: if ``n`` is not an int >= 1.
            RuntimeError: if ``running + n`` would exceed ``max_concurrent`` (nothing changes).
        """
        check_int("n", n, 1)
        with self._lock:
            if self._running + n > self._max_concurrent:
                raise RuntimeError(
                    f"on_start(n={n}) would make running={self._running + n} exceed "
                    f"max_concurrent={self._max_concurrent}; check capacity() before starting"
                )
            self._running += n
            self._started += n

    def on_accept(self, n: int = 1) -> None:
        """Record ``n`` running rollouts finished and kept (``running -= n``, ``accepted += n``).

        Raises:
            ValueError: if ``n`` is not an int >= 1.
            RuntimeError: if fewer than ``n`` rollouts are running (nothing changes).
        """
        check_int("n", n, 1)
        with self._lock:
            self._check_running("on_accept", n)
            self._running -= n
            self._accepted += n

    def on_reject(self, n: int = 1) -> None:
        """Record ``n`` running rollouts finished and discarded (``running -= n``, ``rejected += n``).

        A rejected rollout frees its slot and is not counted as accepted (AReaL semantics,
        arXiv 2505.24298: the workflow returning None).

        Raises:
            ValueError: if ``n`` is not an int >= 1.
            RuntimeError: if fewer than ``n`` rollouts are running (nothing changes).
        """
        check_int("n", n, 1)
        with self._lock:
            self._check_running("on_reject", n)
            self._running -= n
            self._rejected += n

    def on_drop(self, n: int = 1) -> None:
        """Record ``n`` accepted trajectories discarded as too stale (``accepted -= n``, ``dropped += n``).

        Called when the buffer drops trajectories older than ``v - eta`` (MISSION.md section 1:
        the buffer hands out only trajectories within the bound). Removing them from
        ``accepted`` keeps ``accepted`` equal to "consumed + waiting in the buffer", so that
        fresh rollouts can replace them; without it admission could stall with an empty buffer.
        Pass it to ``TrajectoryBuffer(eta, on_drop=manager.on_drop)``.

        Raises:
            ValueError: if ``n`` is not an int >= 1.
            RuntimeError: if ``n`` exceeds ``accepted`` (nothing changes).
        """
        check_int("n", n, 1)
        with self._lock:
            if n > self._accepted:
                raise RuntimeError(f"on_drop(n={n}) but accepted is only {self._accepted}")
            self._accepted -= n
            self._dropped += n

    def _check_running(self, what: str, n: int) -> None:
        if n > self._running:
            raise RuntimeError(f"{what}(n={n}) but only {self._running} rollouts are running")

    # ---------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, int | None]:
        """Counters and configuration as a plain dict (JSON-serialisable).

        Keys: ``batch_size``, ``eta``, ``max_concurrent`` (informational) and the counters
        ``running``, ``accepted``, ``rejected``, ``dropped``, ``started``.
        """
        with self._lock:
            state: dict[str, int | None] = {
                "batch_size": self._batch_size,
                "eta": self._eta,
                "max_concurrent": self._max_concurrent,
            }
            state.update(self._counters())
            return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters from :meth:`state_dict` output.

        Only the counters are restored; the configuration given to the constructor wins (a
        resumed run may change ``max_concurrent``, so a loaded ``running`` may exceed it; the
        capacity is then 0). Rollouts that were running when the state was saved do not survive
        a restart, so after loading from a checkpoint call :meth:`reset_after_resume`
        (MISSION.md section 1).

        Raises:
            KeyError: naming the missing counter.
            ValueError: naming the field when a counter is not an int >= 0.
        """
        values: dict[str, int] = {}
        for name in _COUNTERS:
            if name not in state:
                raise KeyError(f"state dict lacks the counter {name!r}")
            values[name] = check_int(name, state[name], 0)
        with self._lock:
            for name, value in values.items():
                setattr(self, f"_{name}", value)

    def reset_after_resume(self, version: int, buffered: int = 0) -> None:
        """Reset the counters after resuming at trainer version ``version``.

        Sets ``accepted = version * batch_size + buffered`` and ``running = 0`` (MISSION.md
        section 1: after a resume ``accepted`` must be ``v * B``; keeping the pre-crash value or
        zero made the capacity jump after recovery). Capacity right after the reset is
        ``min(max_concurrent, (eta + 1) * B - buffered)``. ``rejected``, ``dropped`` and
        ``started`` are kept as cumulative statistics.

        Args:
            version: The restored trainer version (>= 0).
            buffered: Trajectories restored into the buffer from the checkpoint (>= 0; default 0,
                the MISSION.md rule). They are accepted but not yet consumed.

        Raises:
            ValueError: naming the field when ``version`` or ``buffered`` is not an int >= 0.
        """
        check_int("version", version, 0)
        check_int("buffered", buffered, 0)
        with self._lock:
            self._accepted = version * self._batch_size + buffered
            self._running = 0

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"StalenessManager(batch_size={self._batch_size}, eta={self._eta}, "
            f"max_concurrent={self._max_concurrent}, running={s['running']}, "
            f"accepted={s['accepted']})"
        )
