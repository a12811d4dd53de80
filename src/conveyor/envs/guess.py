"""An interactive multi-turn environment with per-turn feedback and rewards (issue 14, section 3):
guess the secret number.

The secret is an integer in ``[1, high]`` fixed by the sample (``int(sample.answer)`` when it is
one, else derived from the sample id), so an episode is reproducible. The range: a ``guess``
sample's own (``metadata["high"]``, from its data spec ``guess?high=H``, default 100); ``high``
given to the environment (``env.options.high``) must agree with it. A run or ``conveyor eval``
writes an explicit ``env.options.high`` into the ``guess`` data specs that do not name a range
(:func:`guess_spec_for`), so the option wins over the spec's default and the recorded spec is the
game played; a spec whose ``high=`` disagrees with the option is an error.

Each model turn is read for its last integer; the environment answers ``"Higher."`` /
``"Lower."`` (or asks for a number), and rewards:

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

__all__ = ["GUESS_DEFAULT_HIGH", "GuessNumberEnv", "check_guess_options", "guess_samples", "guess_spec_for"]

_INT = re.compile(r"-?\d+")

GUESS_DEFAULT_HIGH: int = 100
"""The range ``[1, 100]`` of a ``guess`` data spec without ``high=`` (and of the environment on
samples of other data sets)."""


def _check(name: str, value, low: float, integer: bool) -> None:
    """``env.options.<name>`` must be an integer (``integer``) or a number, ``>= low``."""
    ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    if not ok or value < low:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"env.options.{name}={value!r} ({type(value).__name__}): the guess environment expects "
                         f"{kind} >= {low:g}")


def check_guess_options(options: dict) -> None:
    """Check the guess environment's options (``env.options``): ``high`` and ``max_guesses``
    integers >= 1, ``shaping`` a number >= 0 (unknown options are left to the constructor).

    Raises:
        ValueError: the option, its value and type, and what is expected, e.g.
            ``env.options.high='abc' (str): the guess environment expects an integer >= 1``.
    """
    for name, low, integer in (("high", 1, True), ("max_guesses", 1, True), ("shaping", 0, False)):
        if name in options and not (name == "high" and options[name] is None):
            _check(name, options[name], low, integer)


def guess_spec_for(spec: str, high: int | None, key: str = "data.train", option_key: str = "env.options.high",
                   origin: str | None = None) -> str:
    """A ``guess`` data spec that plays the environment's range ``high`` (``env.options.high``).

    Args:
        spec: A data spec; only ``guess[:train|:heldout][?...]`` specs are changed.
        high: The environment's ``high`` option, None when not given (the spec is kept).
        key: The config key or flag holding ``spec``, for the error message.
        option_key: The config key or flag that set ``high``, for the error message.
        origin: The file ``high`` was read from (an export's settings), None when it was given here;
            for the error message.

    Returns:
        ``spec`` with ``high=<high>`` added when it has no ``high=`` option (the option wins over
        the spec's default of 100), else ``spec`` unchanged.

    Raises:
        ValueError: the spec's own ``high=`` differs from ``high`` (the message names both).
    """
    base, sep, query = spec.partition("?")
    if high is None or base.strip().split(":", 1)[0] != "guess":
        return spec
    for pair in query.split("&") if query else []:
        name, _, value = pair.partition("=")
        if name.strip() == "high":
            if value.strip() != str(high) and not (value.strip().isdigit() and int(value) == high):
                raise ValueError(f"{key}={spec} plays numbers up to high={value.strip()} but {option_key}={high}"
                                 f"{'' if origin is None else f' (from {origin})'}: "
                                 "give the range once (drop high= from the spec, or the option) or make them agree")
            return spec
    return f"{spec}{'&' if query else '?'}high={high}"


class GuessNumberEnv:
    """Guess-the-number (module docstring); one object per episode.

    Args:
        high: The secret lies in ``[1, high]`` (an integer >= 1); None (the default): the range of
            a ``guess`` sample (``metadata["high"]``), else :data:`GUESS_DEFAULT_HIGH`.
        max_guesses: Turns before the episode ends unsolved (an integer >= 1).
        shaping: Reward for a guess closer than every earlier one (a number >= 0).

    Raises:
        ValueError: an argument of the wrong type or out of range (:func:`check_guess_options`:
            the message names ``env.options.<name>``, its value and the expected type).
    """

    def __init__(self, high: int | None = None, max_guesses: int = 6, shaping: float = 0.1):
        check_guess_options({"high": high, "max_guesses": max_guesses, "shaping": shaping})
        self.explicit_high = high is not None
        self.high = high if high is not None else GUESS_DEFAULT_HIGH
        self.max_guesses, self.shaping = max_guesses, shaping
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
        (a sample of another data set only seeds the secret).

        Raises:
            ValueError: the environment's explicit ``high`` differs from a ``guess`` sample's range
                (its question states that range; :func:`guess_spec_for` makes them agree).
        """
        if str(sample.dataset).startswith("guess") and isinstance(sample.metadata.get("high"), int):
            high = max(1, sample.metadata["high"])
            if self.explicit_high and high != self.high:
                raise ValueError(f"env.options.high={self.high} but the sample {sample.id} of {sample.dataset} plays "
                                 f"numbers up to {high}: give the range once (the option or the spec's high=)")
            self.high = high
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


def guess_samples(n: int, high: int = GUESS_DEFAULT_HIGH, seed: int = 0) -> list[Sample]:
    """``n`` reproducible guess-the-number samples (the secret in ``answer``)."""
    import random

    rng = random.Random(seed)
    q = (f"I am thinking of an integer between 1 and {high}. Guess it: answer with one number per turn; "
         "I will say higher or lower.")
    return [Sample(f"guess:{high}/{i}", q, str(rng.randint(1, high)), "guess") for i in range(n)]
