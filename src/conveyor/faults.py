"""Named fault-injection points, for the chaos suite (``benchmarks/chaos.py``).

Recovery is proven by injecting faults, not argued. The runtime calls :func:`fault_point` at
named places; without the environment variable ``CONVEYOR_FAULTS`` (the normal case) a call is
one dictionary lookup and does nothing. With it, the ``n``-th time a named point is reached in
this process the fault fires::

    CONVEYOR_FAULTS="kill@checkpoint_write#2"           SIGKILL this process (kill -9) there
    CONVEYOR_FAULTS="enospc@checkpoint_write#1"         raise OSError(ENOSPC) there
    CONVEYOR_FAULTS="nonfinite@loss#3,nonfinite@loss#4" the trainer's loss becomes NaN
    CONVEYOR_FAULTS="stall@weight_sync#2"                 sleep there (CONVEYOR_FAULTS_STALL_S
                                                          seconds, default 10): a hung sync

Several faults are separated by commas; ``#n`` defaults to 1 (the first hit). Points placed in
the code (see :data:`POINTS`): ``generate`` (the engine's decode loop, once per step),
``train_step`` (the trainer, after the backward pass and before the optimizer step),
``loss`` (the trainer's loss, per micro-batch), ``checkpoint_write`` (between the files of a
checkpoint being written), ``weight_sync`` (the engine applying new weights), ``eval`` (the
held-out evaluation, once per problem) and ``step_end`` (after a step's logs are written).

Raises:
    ValueError: at import, when ``CONVEYOR_FAULTS`` is malformed or names an unknown point or
        action (a typo in a chaos experiment must not silently inject nothing).
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time

ENV = "CONVEYOR_FAULTS"

POINTS = ("generate", "train_step", "loss", "checkpoint_write", "weight_sync", "eval", "step_end")
"""Names of the fault points placed in the code."""

ACTIONS = ("kill", "enospc", "nonfinite", "stall")
"""``kill``: SIGKILL the process; ``enospc``: raise ``OSError(ENOSPC)``; ``nonfinite``: the
point returns True and the caller makes its value non-finite (only ``loss`` honours it);
``stall``: sleep :data:`STALL_ENV` seconds (default 10) there, then go on."""

STALL_ENV = "CONVEYOR_FAULTS_STALL_S"
"""Seconds a ``stall`` fault sleeps."""


def parse(spec: str) -> dict[str, dict[int, str]]:
    """``"kill@train_step#3,nonfinite@loss"`` -> ``{"train_step": {3: "kill"}, "loss": {1: "nonfinite"}}``.

    Raises:
        ValueError: malformed item, unknown point or action, or hit number < 1.
    """
    plan: dict[str, dict[int, str]] = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        action, at, rest = item.partition("@")
        point, _, nth = rest.partition("#")
        if not at or action not in ACTIONS or point not in POINTS:
            raise ValueError(
                f"{ENV}: bad item {item!r}; expected ACTION@POINT[#N] with ACTION in {ACTIONS} "
                f"and POINT in {POINTS}"
            )
        try:
            n = int(nth) if nth else 1
        except ValueError:
            raise ValueError(f"{ENV}: bad hit number in {item!r}") from None
        if n < 1:
            raise ValueError(f"{ENV}: hit number must be >= 1 in {item!r}")
        plan.setdefault(point, {})[n] = action
    return plan


_PLAN = parse(os.environ.get(ENV, ""))
_HITS: dict[str, int] = {}
_LOCK = threading.Lock()


def armed() -> bool:
    """True when any fault is configured in this process."""
    return bool(_PLAN)


def fault_point(name: str) -> bool:
    """Mark that execution reached point ``name``; fire the fault planned for this hit, if any.

    Returns:
        True when a ``nonfinite`` fault fires here (the caller poisons its value), else False.

    Raises:
        OSError: an ``enospc`` fault (errno ENOSPC, "No space left on device").
    """
    if not _PLAN:
        return False
    plan = _PLAN.get(name)
    if plan is None:
        return False
    with _LOCK:
        n = _HITS[name] = _HITS.get(name, 0) + 1
    action = plan.get(n)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {name} #{n})")
    if action == "stall":
        time.sleep(float(os.environ.get(STALL_ENV, "10")))
    return action == "nonfinite"


def reload_from_env() -> None:
    """Re-read ``CONVEYOR_FAULTS`` and reset the hit counters (for tests in one process)."""
    global _PLAN
    with _LOCK:
        _PLAN = parse(os.environ.get(ENV, ""))
        _HITS.clear()
