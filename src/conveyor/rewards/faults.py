"""Fault-injecting reward functions, to exercise the reward service's failure handling.

``conveyor train reward.fn=conveyor.rewards.faults:flaky_math_reward reward.timeout_s=1`` makes
about 10% of reward calls raise and about 10% hang past the timeout; training must go on, with the
failures counted (``rollout/reward_failures``) and scored ``reward.failure_score``. Which call
fails is a deterministic function of the response text, so runs are reproducible.
"""

from __future__ import annotations

import time
import zlib

from conveyor.rewards.math import math_reward
from conveyor.types import Sample

HANG_SECONDS = 5.0


def flaky_math_reward(response: str, sample: Sample) -> float:
    """:func:`conveyor.rewards.math.math_reward`, except that a response whose CRC32 modulo 10 is
    0 raises ``RuntimeError`` and one whose CRC32 modulo 10 is 1 sleeps ``HANG_SECONDS`` (5 s)
    first (a timeout with any ``reward.timeout_s`` below that)."""
    h = zlib.crc32(response.encode()) % 10
    if h == 0:
        raise RuntimeError("injected reward failure")
    if h == 1:
        time.sleep(HANG_SECONDS)
    return math_reward(response, sample)


def response_length_reward(response: str, sample: Sample) -> float:
    """Response length in characters / 100: a dense, meaningless reward whose only use is to give
    every group non-zero advantages (so even a random tiny model gets gradient), e.g. to drive a
    run into non-finite losses on purpose (``trainer.lr=1e30``)."""
    return len(response) / 100.0


# ------------------------------------------------------------------------- the chaos suite
CHAOS_KINDS = ("raise", "timeout", "hang", "none", "nan", "inf", "-inf", "huge", "str", "list",
               "complex", "exit", "crash")
"""What :func:`chaos_reward` does, by kind: raise an exception; sleep past any timeout below
2 s; hang (sleep an hour); return None, NaN, +inf, -inf, 1e300, the string ``"1.0"``, a list,
a complex number; raise ``SystemExit``; kill its own worker process (``os._exit``). Every kind
is a failed reward for the reward service."""


def chaos_sample(kind: str, i: int = 0) -> str:
    """A response text that makes :func:`chaos_reward` inject fault ``kind`` (see
    :data:`CHAOS_KINDS`); ``i`` only makes texts distinct."""
    if kind not in CHAOS_KINDS:
        raise ValueError(f"kind must be one of {CHAOS_KINDS}, got {kind!r}")
    return f"chaos:{kind}:{i}"


def chaos_reward(response: str, sample: Sample):
    """A reward function that only fails, one of :data:`CHAOS_KINDS` per call: the kind named
    by a :func:`chaos_sample` text, else chosen by the response's CRC32 (deterministic, so a
    training run with ``reward.fn=conveyor.rewards.faults:chaos_reward`` is reproducible).
    ``benchmarks/chaos.py`` checks that every call is a counted failure and nothing crashes."""
    import math
    import os

    if response.startswith("chaos:"):
        kind = response.split(":")[1]
    else:
        kind = CHAOS_KINDS[zlib.crc32(response.encode()) % len(CHAOS_KINDS)]
    if kind == "raise":
        raise RuntimeError("injected reward failure")
    if kind == "timeout":
        time.sleep(2.0)
        return 1.0
    if kind == "hang":
        time.sleep(3600.0)
    if kind == "exit":
        raise SystemExit(3)
    if kind == "crash":
        os._exit(7)
    return {"none": None, "nan": math.nan, "inf": math.inf, "-inf": -math.inf, "huge": 1e300,
            "str": "1.0", "list": [1.0], "complex": 1 + 2j}[kind]
