"""Buffer of finished trajectory groups between rollout and trainer (MISSION.md section 1).

AReaL (arXiv 2505.24298) keeps finished trajectories in a buffer from which the trainer takes
the oldest ones that are still within the staleness bound, each used once. conveyor keeps a
group (all responses to one prompt) together: groups enter, wait and leave as a unit, so that
group-relative advantages (GRPO-style) always see complete groups.

Staleness of a trajectory is measured from its oldest response token
(``Trajectory.oldest_version``, MISSION.md section 1); a group is as old as its oldest
trajectory. At trainer version ``v`` a group is stale when its age is ``< v - eta``, where
``eta`` is the bound in force when its episode was admitted, or the bound in force now when that
is larger: a bound lowered mid-run (an adaptive controller, MISSION.md section 4) throttles
admission only, and never throws away work admitted under the higher one.

Synchronous and thread-safe (one ``threading.Condition``); the asyncio controller wraps it.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence

from conveyor.rollout.staleness import check_int
from conveyor.types import Trajectory

IN_FORCE = object()
"""``put(group, eta=IN_FORCE)``: the group was admitted under the bound in force now."""


def judged_bound(admitted: int | None, in_force: int | None) -> int | None:
    """The staleness bound work admitted under ``admitted`` is judged by while ``in_force`` is
    the bound: the larger of the two, None (unbounded) when either is (a lowered bound throttles
    admission only; :class:`TrajectoryBuffer`)."""
    if admitted is None or in_force is None:
        return None
    return max(admitted, in_force)


def group_version(group: Sequence[Trajectory]) -> int:
    """Age of a group: the oldest policy version among all its response tokens.

    Trajectories with an empty response carry no version and are ignored (their
    ``oldest_version`` of ``-1`` would otherwise mark every such group as maximally stale).

    Args:
        group: Trajectories of one prompt (non-empty).

    Returns:
        A policy version (>= 0).

    Raises:
        ValueError: if no trajectory of the group has a response token (field ``versions``).
    """
    ages = [t.oldest_version for t in group if t.versions]
    if not ages:
        raise ValueError(
            "group has no response tokens in any trajectory (all `versions` empty); "
            "its staleness cannot be measured"
        )
    return min(ages)


class TrajectoryBuffer:
    """Holds finished groups; hands out the oldest groups still within the staleness bound.

    Rules (MISSION.md section 1; AReaL arXiv 2505.24298):

    - Staleness is measured from a trajectory's oldest token; a group's age is that of its
      oldest trajectory (:func:`group_version`).
    - Each group keeps the bound it was admitted under (:meth:`put`'s ``eta``); its bound is
      that one or the bound in force now, whichever is larger (None, unbounded, is the
      largest). At trainer version ``v``, every group with age ``< v - bound`` is dropped (never
      handed out) and counted in ``stats()["dropped_stale"]`` (trajectories) and
      ``stats()["dropped_stale_groups"]``. ``eta = None`` never drops. So lowering the bound
      (:meth:`set_eta`) drops nothing already admitted: the capacity rule
      (:class:`~conveyor.rollout.staleness.StalenessManager`) admits by the new bound, and the
      groups admitted under the old one are trained within the old one (asyppo.md: judged by
      the lowered bound, every decrease of an adaptive run threw a batch away).
    - :meth:`get_batch` hands out the groups whose deadline (age + bound) comes first, then
      the oldest (by age, then insertion order; with one bound this is oldest-first); each
      trajectory is handed out at most once.

    Args:
        eta: Maximum staleness in policy versions (>= 0), or None for unbounded.
        on_drop: Optional callback given the number of trajectories dropped as stale, called
            (outside the buffer's lock) after each drop; pass ``StalenessManager.on_drop`` so
            that dropped trajectories free admission capacity.

    Raises:
        ValueError: if ``eta`` is not None and not an int >= 0 (field ``eta``).
    """

    def __init__(self, eta: int | None, on_drop: Callable[[int], None] | None = None) -> None:
        self._eta = None if eta is None else check_int("eta", eta, 0)
        if on_drop is not None and not callable(on_drop):
            raise ValueError(f"on_drop must be callable or None, got {on_drop!r}")
        self._on_drop = on_drop
        self._cond = threading.Condition(threading.Lock())
        # Sorted by (age, insertion sequence, ...); sequence numbers are unique, so the group list
        # and its admission bound (None: unbounded) are never compared.
        self._groups: list[tuple[int, int, list[Trajectory], int | None]] = []
        self._seq = 0
        self._dropped_log: list[dict] = []  # groups dropped as stale, not yet taken
        self._size = 0
        self.last_held_back = False  # the last get_batch held a complete batch back (pending_expiring)
        self._stats = {
            "put_groups": 0,
            "put_trajectories": 0,
            "handed_out": 0,
            "dropped_stale": 0,
            "dropped_stale_groups": 0,
            "drained": 0,
        }

    @property
    def eta(self) -> int | None:
        """Maximum staleness in policy versions; None = never drop."""
        return self._eta

    def set_eta(self, eta: int | None) -> None:
        """Change the staleness bound mid-run (an adaptive controller, MISSION.md section 4).

        Raising it applies to every buffered group at once (older groups become usable again
        before they are dropped); lowering it applies to the groups put with a lower admission
        bound only: a group admitted under a higher bound keeps that one (class docstring).

        Raises:
            ValueError: ``eta`` is not None and not an int >= 0 (field ``eta``).
        """
        new = None if eta is None else check_int("eta", eta, 0)
        with self._cond:
            self._eta = new

    # ---------------------------------------------------------------- input
    def put(self, traj_or_group: Trajectory | Sequence[Trajectory], *, eta=IN_FORCE) -> None:
        """Add one group (a list of trajectories of one prompt) or a single trajectory.

        A single :class:`~conveyor.types.Trajectory` is stored as a group of one. Wakes
        :meth:`wait_for` callers.

        Args:
            traj_or_group: The group.
            eta: The staleness bound its episode was admitted under (int >= 0, or None for
                unbounded); the default :data:`IN_FORCE` takes the buffer's bound now. The group
                is judged by this bound or the one in force, whichever is larger.

        Raises:
            TypeError: if the argument or one of its items is not a ``Trajectory``.
            ValueError: if the group is empty, a trajectory's ``versions`` length differs from
                its ``response_ids`` length, a version is negative, or no trajectory has a
                response token.
        """
        if isinstance(traj_or_group, Trajectory):
            group = [traj_or_group]
        elif isinstance(traj_or_group, (list, tuple)):
            group = list(traj_or_group)
        else:
            raise TypeError(
                f"put() takes a Trajectory or a list of Trajectory, got {type(traj_or_group).__name__}"
            )
        if not group:
            raise ValueError("put() got an empty group")
        for i, t in enumerate(group):
            if not isinstance(t, Trajectory):
                raise TypeError(f"group[{i}] is a {type(t).__name__}, not a Trajectory")
            if len(t.versions) != len(t.response_ids):
                raise ValueError(
                    f"group[{i}].versions has length {len(t.versions)} but response_ids has "
                    f"length {len(t.response_ids)}"
                )
            if t.versions and min(t.versions) < 0:
                raise ValueError(
                    f"group[{i}].versions contains a negative version {min(t.versions)}"
                )
        if eta is not IN_FORCE and eta is not None:
            check_int("eta", eta, 0)
        age = group_version(group)
        with self._cond:
            bound = self._eta if eta is IN_FORCE else eta
            bisect.insort(self._groups, (age, self._seq, group, bound))
            self._seq += 1
            self._size += len(group)
            self._stats["put_groups"] += 1
            self._stats["put_trajectories"] += len(group)
            self._cond.notify_all()

    # ---------------------------------------------------------------- output
    def drop_stale(self, current_version: int) -> int:
        """Drop every group with age ``< current_version - eta``; return trajectories dropped.

        Raises:
            ValueError: if ``current_version`` is not an int >= 0.
        """
        check_int("current_version", current_version, 0)
        with self._cond:
            dropped = self._drop_stale_locked(current_version)
        self._notify_drop(dropped)
        return dropped

    def get_batch(self, n_trajectories: int, current_version: int, *,
                  pending_expiring: int = 0) -> list[Trajectory] | None:
        """Hand out exactly ``n_trajectories`` trajectories from the fresh groups whose deadline
        comes first, or None.

        First drops stale groups (as :meth:`drop_stale`). Then walks the groups earliest
        deadline first (age + the group's bound, then age, then insertion order:
        :meth:`_deadline_order`; with one bound for every group that is oldest first) and takes
        each whole group that still fits (``total + len(group) <= n_trajectories``), skipping a
        group that would overflow. Groups are never split. If the taken groups add up to exactly
        ``n_trajectories`` they
        are removed and returned (flattened, in the order taken); otherwise nothing is removed
        and None is returned (not enough yet, or no combination of whole groups makes exactly
        ``n``). When every group size divides ``n_trajectories`` (the usual case: fixed group
        size ``G`` and ``B`` a multiple of ``G``) this is exactly oldest-first.

        Waiting for expiring groups (``pending_expiring > 0``; ``async.wait_for_expiring``,
        docs/results/main_job.md): ``pending_expiring`` trajectories still in flight expire at
        this version (their group would be older than ``current_version + 1 -`` its bound at the next
        one, so this batch is their last chance). If they fit into this batch together with the
        buffered groups that expire now (age ``<= current_version -`` their bound), nothing is handed
        out (None): the caller waits for them instead of filling the batch with younger groups
        and dropping the stragglers at the next version. When they cannot fit, the batch is
        formed as usual (waiting could not save them all). ``last_held_back`` tells whether
        this call held back a batch that could have formed otherwise (the controller times and
        counts only those waits).

        Args:
            n_trajectories: Batch size in trajectories (>= 1).
            current_version: The trainer's policy version (>= 0), for the staleness check.
            pending_expiring: Trajectories in flight that expire at this version (>= 0).

        Returns:
            The batch (each trajectory handed out once, ever), or None.

        Raises:
            ValueError: naming the field if an argument is not an int in range.
        """
        check_int("n_trajectories", n_trajectories, 1)
        check_int("current_version", current_version, 0)
        check_int("pending_expiring", pending_expiring, 0)
        batch: list[Trajectory] | None = None
        with self._cond:
            dropped = self._drop_stale_locked(current_version)
            taken: list[int] = []
            total = 0
            wait = False
            if pending_expiring:
                expiring = 0  # groups that expire after this batch: age == current_version - bound
                for age, _, g, admitted in self._groups:
                    bound = self._bound(admitted)
                    if bound is not None and age <= current_version - bound:
                        expiring += len(g)
                wait = expiring + pending_expiring <= n_trajectories
            # a batch could have formed but waits for the expiring groups (the controller times it)
            self.last_held_back = bool(wait and self._size >= n_trajectories)
            if self._size >= n_trajectories and not wait:
                for idx in self._deadline_order():
                    group = self._groups[idx][2]
                    if total + len(group) <= n_trajectories:
                        taken.append(idx)
                        total += len(group)
                        if total == n_trajectories:
                            break
            if total == n_trajectories:
                batch = [t for idx in taken for t in self._groups[idx][2]]
                for idx in sorted(taken, reverse=True):
                    del self._groups[idx]
                self._size -= total
                self._stats["handed_out"] += total
        self._notify_drop(dropped)
        return batch

    def take_dropped(self, *, keep: bool = False) -> list[dict]:
        """Return the records of the groups dropped as stale since the last call and forget
        them (``keep=True``: a copy, nothing forgotten, for checkpoints):
        ``{"group", "sample", "outcome": "dropped_stale", "age"}`` each (the run's audit trail,
        ``trained.jsonl``, lists them so every sample handed out is accounted for)."""
        with self._cond:
            out = list(self._dropped_log)
            if not keep:
                self._dropped_log = []
            return out

    def drain(self) -> list[list[Trajectory]]:
        """Remove and return every buffered group, oldest first (e.g. to checkpoint them).

        Nothing is dropped for staleness here; put the groups back after a resume and the next
        :meth:`get_batch` applies the bound. Counted in ``stats()["drained"]`` (trajectories).
        """
        with self._cond:
            groups = [g for _, _, g, _ in self._groups]
            self._stats["drained"] += self._size
            self._groups.clear()
            self._size = 0
            return groups

    def snapshot(self) -> list[list[Trajectory]]:
        """Every buffered group, oldest first, without removing anything (for checkpointing).

        The outer and group lists are new; the ``Trajectory`` objects are the buffered ones
        (not deep-copied), so serialise them before mutating. Nothing is dropped for staleness.
        """
        with self._cond:
            return [list(g) for _, _, g, _ in self._groups]

    def snapshot_with_bounds(self) -> list[tuple[list[Trajectory], int | None]]:
        """:meth:`snapshot` with each group's admission bound (``put``'s ``eta``), taken at once:
        ``(group, eta)`` pairs, oldest first, to put back with ``put(group, eta=eta)``."""
        with self._cond:
            return [(list(g), admitted) for _, _, g, admitted in self._groups]

    def widest_bound(self) -> int | None:
        """The largest staleness bound any buffered group is judged by now (the bound in force,
        or a larger admission bound); None when any is unbounded. Data kept for the buffered
        groups (old-log-prob patches) must live this long."""
        with self._cond:
            widest = self._eta
            for _, _, _, admitted in self._groups:
                widest = judged_bound(admitted, widest)
            return widest

    # ---------------------------------------------------------------- waiting and stats
    def size(self) -> int:
        """Number of buffered trajectories (not groups)."""
        with self._cond:
            return self._size

    def num_groups(self) -> int:
        """Number of buffered groups."""
        with self._cond:
            return len(self._groups)

    def wait_for(self, n: int, timeout: float | None = None) -> bool:
        """Block until at least ``n`` trajectories are buffered, or ``timeout`` seconds pass.

        A True result does not guarantee that :meth:`get_batch` succeeds (stale groups may be
        dropped, or group sizes may not add up to the batch size).

        Args:
            n: Trajectories to wait for (>= 1).
            timeout: Seconds (>= 0), or None to wait indefinitely.

        Returns:
            True if ``size() >= n`` when it returns, False on timeout.

        Raises:
            ValueError: if ``n`` is not an int >= 1 or ``timeout`` is negative.
        """
        check_int("n", n, 1)
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout}")
        with self._cond:
            return self._cond.wait_for(lambda: self._size >= n, timeout=timeout)

    def stats(self) -> dict[str, int]:
        """Counters: ``groups`` and ``trajectories`` buffered now; cumulative ``put_groups``,
        ``put_trajectories``, ``handed_out``, ``dropped_stale`` (trajectories),
        ``dropped_stale_groups`` and ``drained`` (trajectories)."""
        with self._cond:
            return {"groups": len(self._groups), "trajectories": self._size, **self._stats}

    # ---------------------------------------------------------------- internals
    def _deadline_order(self) -> list[int]:
        """Indices of the groups, earliest deadline first: a group's deadline is the last version
        it may be trained at, ``age + bound`` (unbounded: never), then by age and insertion order.
        With one bound for all groups this is oldest-first. With mixed admission bounds (eta
        raised and lowered), oldest-first let a group admitted under the lower bound wait behind
        same-age groups of a higher one until it was stale (asyppo.md, the fixed adaptive run);
        by the capacity rule every group with deadline <= D is among the first (D + 1) x B
        trajectories admitted, so taking them by deadline trains every one that has finished by
        then by version D."""
        def key(i: int) -> tuple[float, int, int]:
            age, seq, _, admitted = self._groups[i]
            bound = self._bound(admitted)
            return (float("inf") if bound is None else age + bound, age, seq)

        return sorted(range(len(self._groups)), key=key)

    def _bound(self, admitted: int | None) -> int | None:
        """The bound a group admitted under ``admitted`` is judged by now (None: unbounded)."""
        return judged_bound(admitted, self._eta)

    def _drop_stale_locked(self, current_version: int) -> int:
        """Drop stale groups (lock held); return the number of trajectories dropped."""
        if self._eta is None:
            return 0
        keep, stale = [], []
        for entry in self._groups:
            bound = self._bound(entry[3])
            (stale if bound is not None and entry[0] < current_version - bound else keep).append(entry)
        if not stale:
            return 0
        dropped = sum(len(g) for _, _, g, _ in stale)
        for _, _, g, _ in stale:  # the audit trail: which groups (take_dropped)
            self._dropped_log.append({"group": g[0].group_id, "sample": g[0].sample.id,
                                      "outcome": "dropped_stale", "age": group_version(g)})
        self._groups = keep  # still sorted: a filtered sorted list
        self._size -= dropped
        self._stats["dropped_stale"] += dropped
        self._stats["dropped_stale_groups"] += len(stale)
        return dropped

    def _notify_drop(self, dropped: int) -> None:
        if dropped and self._on_drop is not None:
            self._on_drop(dropped)
