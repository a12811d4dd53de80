"""Rewards: answer extraction and checking (math-verify, reasoning-gym scorers), the built-in
reward functions, and the reward service that runs them in parallel with timeouts.

A reward function has the signature ``RewardFn = Callable[[str, Sample], float]``
(response text, sample -> reward).
"""

from conveyor.rewards.math import (
    BUILTIN_REWARD_FNS,
    ExtractedAnswer,
    RewardFn,
    answers_match,
    correctness_reward,
    extract_answer,
    format_ok,
    format_reward,
    is_correct,
    load_reward_fn,
    math_reward,
    normalize_answer,
)
from conveyor.rewards.service import RewardResult, RewardService

__all__ = [
    "BUILTIN_REWARD_FNS",
    "ExtractedAnswer",
    "RewardFn",
    "RewardResult",
    "RewardService",
    "answers_match",
    "correctness_reward",
    "extract_answer",
    "format_ok",
    "format_reward",
    "is_correct",
    "load_reward_fn",
    "math_reward",
    "normalize_answer",
]
