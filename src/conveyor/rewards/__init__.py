"""Rewards: answer extraction and checking (math-verify, reasoning-gym scorers), the built-in
reward functions, and the reward service that runs them in parallel with timeouts.

A reward function has the signature ``RewardFn = Callable[[str, Sample], float]``
(response text, sample -> reward).

Grading policy (in full in :mod:`conveyor.rewards.math`; issue 10, section 4). The checker is the
reward, so it must not be gameable:

* The final answer is every *mark* of the response: each ``\\boxed{}``, ``<answer></answer>``,
  ``Answer:`` and ``####`` (and the last ``"answer is"`` phrase). Every mark must equal the
  reference; two different marks (``\\boxed{2} then \\boxed{3}``) are a hedge and wrong.
* Only a response with no mark falls back to its last number, and a list or range of numbers
  there (``"2 4 6 8"``, ``"between 12 and 13"``) names several values: wrong.
* An answer that names several different values (``"12 or 13"``, ``"12, 13"``,
  ``"\\boxed{5 \\text{ or } 6}"``, ``"12 \\pm 1"``) is wrong; ``"12/13"`` is one fraction,
  ``"1 3/4"`` one mixed number, ``"3 ... 3"`` one value given twice.
* Answers are normalised before math-verify compares them (``math_verify.parse`` /
  ``verify``): Unicode digits and vulgar fractions, thousands separators of every locale (comma,
  space, narrow no-break space, apostrophe, Indian lakh, dots only with two or more groups:
  ``1.234`` is a decimal), mixed numbers, scientific notation (``2e3``, ``4 \\times 10^{5}``),
  units with exponents (``9 cm^2``), currency, ``%``. An operation left for the reader
  (``"91 + 88"``) is not a value.
* reasoning-gym samples are scored by the task's own scorer on each mark (word answers welcome).
"""

from conveyor.rewards.math import (
    BUILTIN_REWARD_FNS,
    AnswerReading,
    ExtractedAnswer,
    RewardFn,
    Verdict,
    answers_match,
    check_reward_signature,
    correctness_reward,
    extract_answer,
    extract_answers,
    format_ok,
    format_reward,
    grade,
    is_correct,
    load_reward_fn,
    math_reward,
    normalize_answer,
    read_answer,
)
from conveyor.rewards.service import ANSWER_METRICS, RewardResult, RewardService

__all__ = [
    "ANSWER_METRICS",
    "BUILTIN_REWARD_FNS",
    "AnswerReading",
    "ExtractedAnswer",
    "RewardFn",
    "RewardResult",
    "RewardService",
    "Verdict",
    "answers_match",
    "check_reward_signature",
    "correctness_reward",
    "extract_answer",
    "extract_answers",
    "format_ok",
    "format_reward",
    "grade",
    "is_correct",
    "load_reward_fn",
    "math_reward",
    "normalize_answer",
    "read_answer",
]
