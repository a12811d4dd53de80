"""An interactive multi-turn environment with per-turn feedback and rewards (issue 14, section 3):
guess the secret number.

The secret is an integer in ``[1, high]`` fixed by the sample (``int(sample.answer)`` when it is
one, else derived from the sample id), so an episode is reproducible. Each model turn is read for
its last integer; the environment answers ``"Higher."`` / ``"Lower."`` (or asks for a number), and
rewards:

- ``1.0`` on the turn that names the secret (the episode ends, ``info["correct"] = True``);
- ``shaping`` (default 0.1) on a turn whose guess is strictly closer to the secret than every
  earlier guess (the feedback was used), else 0;
- nothing more after ``max_guesses`` turns (``info["correct"] = False``).
"""

from __future__ import annotations

import hashlib
import re

from conveyor.envs.base import StepResult
from conveyor.types import Sample

__all__ = ["GuessNumberEnv", "guess_samples"]

_INT = re.compile(r"-?\d+")


class GuessNumberEnv:
    """Guess-the-number (module docstring); one object per episode.

    Args:
        high: The secret lies in ``[1, high]`` (>= 1).
        max_guesses: Turns before the episode ends unsolved (>= 1).
        shaping: Reward for a guess closer than every earlier one (>= 0).

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, high: int = 100, max_guesses: int = 6, shaping: float = 0.1):
        if high < 1 or max_guesses < 1 or shaping < 0:
            raise ValueError(f"GuessNumberEnv: high {high} and max_guesses {max_guesses} must be >= 1, shaping >= 0")
        self.high, self.max_guesses, self.shaping = high, max_guesses, shaping
        self.secret = 0
        self.guesses: list[int] = []

    def secret_for(self, sample: Sample) -> int:
        """The sample's secret: its answer when that is an integer in range, else from its id."""
        try:
            v = int(str(sample.answer).strip())
            if 1 <= v <= self.high:
                return v
        except ValueError:
            pass
        return int(hashlib.sha256(sample.id.encode()).hexdigest(), 16) % self.high + 1

    async def reset(self, sample: Sample) -> str:
        """Start a game: the secret from the sample (:meth:`secret_for`; a ``guess`` sample's
        ``metadata["high"]`` sets the range), the first message its question when it is a
        ``guess`` sample (``sample.dataset`` starts with ``guess``), else the game's own text
        (a sample of another data set only seeds the secret)."""
        if str(sample.dataset).startswith("guess") and isinstance(sample.metadata.get("high"), int):
            self.high = max(1, sample.metadata["high"])
        self.secret = self.secret_for(sample)
        self.guesses = []
        own = str(sample.dataset).startswith("guess") and sample.question
        return (sample.question if own else f"I am thinking of an integer between 1 and {self.high}. Guess it: "
                "answer with one number per turn; I will say higher or lower.")

    async def step(self, action: str) -> StepResult:
        """Read the turn's last integer as the guess and answer (module docstring)."""
        found = _INT.findall(action)
        if not found:
            done = len(self.guesses) + 1 >= self.max_guesses
            self.guesses.append(-1)
            return StepResult(None if done else "Please answer with one number.", 0.0, done,
                              {"correct": False} if done else {})
        g = int(found[-1])
        best = min((abs(x - self.secret) for x in self.guesses if x >= 0), default=None)
        self.guesses.append(g)
        if g == self.secret:
            return StepResult(None, 1.0, True, {"correct": True, "guesses": len(self.guesses)})
        closer = best is None or abs(g - self.secret) < best
        reward = self.shaping if closer and best is not None else 0.0
        if len(self.guesses) >= self.max_guesses:
            return StepResult(None, reward, True, {"correct": False, "guesses": len(self.guesses)})
        return StepResult("Higher." if g < self.secret else "Lower.", reward, False)


def guess_samples(n: int, high: int = 100, seed: int = 0) -> list[Sample]:
    """``n`` reproducible guess-the-number samples (the secret in ``answer``)."""
    import random

    rng = random.Random(seed)
    q = (f"I am thinking of an integer between 1 and {high}. Guess it: answer with one number per turn; "
         "I will say higher or lower.")
    return [Sample(f"guess:{high}/{i}", q, str(rng.randint(1, high)), "guess") for i in range(n)]
