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
