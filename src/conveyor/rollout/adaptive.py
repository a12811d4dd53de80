"""Adaptive staleness: AsyPPO's async ratio controller (MISSION.md section 4; issue 13).

The AsyPPO article adapts the share of asynchronous work at run time: it starts at a base ratio
of 0.7 ("7 成") and, whenever the variance of the batch rewards exceeds a threshold (15%), moves
toward on-policy training; otherwise it moves back toward more asynchrony, within bounds (which
the article's code elides; issue 13 fixes them at ``[0.1, 1.0]``).

In conveyor the ratio drives the staleness bound of AReaL's admission rule (MISSION.md
section 1): ``eta = floor(ratio * eta_max)``, so ratio 1 is the most asynchronous setting the
run allows (``eta_max``) and ratio 0 is synchronous training (``eta = 0``). Use::

    controller = AsyncRatioController(eta_max=4)
    manager = StalenessManager(batch_size=B, eta=controller.eta(), max_concurrent=M)
    ...
    controller.update(float(rewards.var()))      # once per trainer step
    manager.set_eta(controller.eta())            # the capacity rule follows at once

Exact arithmetic: the ratio is kept as an integer number of steps from ``base`` and every
number is read as the decimal it prints as (``Fraction(repr(x))``), so the ratio never drifts
(0.7 - 0.1 - 0.1 is exactly 0.5, not 0.49999999999999994) and ``floor(ratio * eta_max)`` needs
no epsilon.
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction
from typing import Any

__all__ = ["AsyncRatioController"]

_GRID = ("base", "r_min", "r_max", "step")


def _real(name: str, value: object) -> Fraction:
    """``value`` (a finite real, not bool) as the exact decimal it prints as; else ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite real number, got {value!r}")
    return Fraction(repr(float(value)))


class AsyncRatioController:
    """Adapts the async ratio (hence the staleness bound eta) to the batch reward variance.

    Rule, once per :meth:`update` (MISSION.md section 4, the article's
    ``AsyncRatioController``):

    * ``reward_variance > threshold``: one ``step`` DOWN, toward on-policy (noisy rewards: use
      fresher samples);
    * otherwise (a variance EQUAL to the threshold counts as not above): one ``step`` UP, toward
      more asynchrony;
    * the ratio stays in ``[r_min, r_max]``; a step that would leave the range stops at the
      bound (a partial step when the bounds are not a whole number of steps from ``base``),
      and an update at the bound in the direction of the bound changes nothing.

    Mapping to the staleness bound: ``eta = floor(ratio * eta_max)`` (:meth:`eta`), computed
    exactly. With the defaults (``eta_max = 4``): ratio 0.1 -> 0, 0.5 / 0.6 / 0.7 -> 2,
    0.8 -> 3, 1.0 -> 4. Several ratios share one eta, so a ratio change need not change eta.

    Internally the ratio is an integer number of steps ``k`` from ``base``:
    ``ratio = clamp(base + k * step, r_min, r_max)`` in exact rational arithmetic (no float
    drift over thousands of updates); :attr:`ratio` is its nearest float.

    Every change of the ratio is recorded in :attr:`events` as a dict with ``update`` (1-based
    number of the update call), ``old_ratio``, ``new_ratio``, ``old_eta``, ``new_eta``,
    ``direction`` (``"on_policy"`` or ``"async"``), ``reward_variance``, ``threshold`` and a
    readable ``reason``. Updates that change nothing (clamped at a bound) record no event.

    Not thread-safe: call it from the trainer loop only.

    Args:
        base: Starting ratio (the article's 0.7).
        r_min: Lowest ratio (most on-policy), ``0 <= r_min <= base``.
        r_max: Highest ratio (most asynchronous), ``base <= r_max <= 1``.
        step: Ratio change per update, ``> 0``.
        threshold: Reward-variance threshold, ``>= 0`` (the article's 15%: 0.15; rewards in
            ``[0, 1]`` have variance at most 0.25).
        eta_max: The staleness bound at ratio 1 (int >= 0). Default 4: AReaL's typical eta for
            code (MISSION.md section 1); base 0.7 then starts at eta 2, and ``[r_min, r_max]``
            spans eta 0 .. 4, the range of issue 13's fixed-eta comparison (2 and 4).

    Raises:
        ValueError: naming the argument when a number is not finite and real, the bounds are
            not ``0 <= r_min <= base <= r_max <= 1``, ``step <= 0``, ``threshold < 0``, or
            ``eta_max`` is not an int >= 0.
    """

    def __init__(self, base: float = 0.7, r_min: float = 0.1, r_max: float = 1.0,
                 step: float = 0.1, threshold: float = 0.15, eta_max: int = 4) -> None:
        self._config = {"base": base, "r_min": r_min, "r_max": r_max, "step": step,
                        "threshold": threshold, "eta_max": eta_max}
        b, lo, hi = _real("base", base), _real("r_min", r_min), _real("r_max", r_max)
        s, th = _real("step", step), _real("threshold", threshold)
        if lo < 0:
            raise ValueError(f"r_min must be >= 0, got {r_min!r}")
        if hi > 1:
            raise ValueError(f"r_max must be <= 1, got {r_max!r}")
        if lo > b:
            raise ValueError(f"base must be >= r_min ({r_min!r}), got {base!r}")
        if b > hi:
            raise ValueError(f"base must be <= r_max ({r_max!r}), got {base!r}")
        if s <= 0:
            raise ValueError(f"step must be > 0, got {step!r}")
        if th < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold!r}")
        if isinstance(eta_max, bool) or not isinstance(eta_max, int) or eta_max < 0:
            raise ValueError(f"eta_max must be an int >= 0, got {eta_max!r}")
        self._base, self._lo, self._hi, self._step = b, lo, hi, s
        self._threshold = float(threshold)
        self._eta_max = eta_max
        # steps from base: k in [k_lo, k_hi]; the last step before a bound may be partial
        self._k_lo = -math.ceil((b - lo) / s)
        self._k_hi = math.ceil((hi - b) / s)
        self._k = 0
        self._updates = 0
        self._events: list[dict[str, Any]] = []

    # ---------------------------------------------------------------- state
    def _exact(self, k: int) -> Fraction:
        return min(self._hi, max(self._lo, self._base + k * self._step))

    @property
    def ratio(self) -> float:
        """The current async ratio in ``[r_min, r_max]`` (nearest float of the exact value)."""
        return float(self._exact(self._k))

    @property
    def steps(self) -> int:
        """The ratio as a whole number of steps from ``base`` (negative: toward on-policy)."""
        return self._k

    @property
    def threshold(self) -> float:
        """The reward-variance threshold."""
        return self._threshold

    @property
    def eta_max(self) -> int:
        """The staleness bound at ratio 1."""
        return self._eta_max

    @property
    def n_updates(self) -> int:
        """How many times :meth:`update` was called (changes or not)."""
        return self._updates

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every change so far, oldest first (copies; see the class docstring for the keys)."""
        return [dict(e) for e in self._events]

    def eta(self) -> int:
        """The staleness bound for the current ratio: ``floor(ratio * eta_max)``, exact, >= 0."""
        return self._eta_of(self._k)

    def _eta_of(self, k: int) -> int:
        return math.floor(self._exact(k) * self._eta_max)

    # ---------------------------------------------------------------- the rule
    def update(self, reward_variance: float) -> float:
        """Move the ratio one step after a batch whose rewards have variance ``reward_variance``.

        Down (toward on-policy) when ``reward_variance > threshold``, otherwise up; clamped to
        ``[r_min, r_max]``. Records an event when the ratio changes.

        Args:
            reward_variance: Variance of the batch rewards (finite, >= 0; population or sample
                variance, as long as the threshold is meant the same way).

        Returns:
            The new ratio (float).

        Raises:
            ValueError: ``reward_variance`` is not a finite real number >= 0 (nothing changes).
        """
        var = _real("reward_variance", reward_variance)
        if var < 0:
            raise ValueError(f"reward_variance must be >= 0, got {reward_variance!r}")
        self._updates += 1
        above = float(reward_variance) > self._threshold
        old = self._k
        new = max(self._k_lo, old - 1) if above else min(self._k_hi, old + 1)
        if new != old:
            self._k = new
            self._events.append({
                "update": self._updates,
                "old_ratio": float(self._exact(old)),
                "new_ratio": float(self._exact(new)),
                "old_eta": self._eta_of(old),
                "new_eta": self._eta_of(new),
                "direction": "on_policy" if above else "async",
                "reward_variance": float(reward_variance),
                "threshold": self._threshold,
                "reason": (f"reward variance {float(reward_variance):g} "
                           f"{'>' if above else '<='} threshold {self._threshold:g}: one step "
                           f"toward {'on-policy' if above else 'more asynchrony'}"),
            })
        return self.ratio

    # ---------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable state: ``steps``, ``n_updates``, ``events``, the
        configuration (``base``, ``r_min``, ``r_max``, ``step``, ``threshold``, ``eta_max``)
        and, for reading, ``ratio`` and ``eta``."""
        state: dict[str, Any] = dict(self._config)
        state.update(steps=self._k, n_updates=self._updates, events=self.events,
                     ratio=self.ratio, eta=self.eta())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        The grid (``base``, ``r_min``, ``r_max``, ``step``) must equal this controller's, since
        ``steps`` counts from ``base`` in units of ``step``; ``threshold`` and ``eta_max`` may
        differ (this controller's configuration wins, e.g. a resumed run with a new
        ``eta_max``). After loading, apply :meth:`eta` to the staleness manager.

        Raises:
            KeyError: naming a missing key.
            ValueError: naming the key when a grid value differs, ``steps`` is not an int in
                this controller's range, or ``n_updates`` is not an int >= 0 (nothing changes).
        """
        for key in (*_GRID, "steps", "n_updates", "events"):
            if key not in state:
                raise KeyError(f"state dict lacks the key {key!r}")
        for key in _GRID:
            if _real(key, state[key]) != _real(key, self._config[key]):
                raise ValueError(f"state {key} = {state[key]!r} differs from this controller's "
                                 f"{self._config[key]!r}")
        k, n = state["steps"], state["n_updates"]
        if isinstance(k, bool) or not isinstance(k, int) or not self._k_lo <= k <= self._k_hi:
            raise ValueError(f"steps must be an int in [{self._k_lo}, {self._k_hi}], got {k!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n_updates must be an int >= 0, got {n!r}")
        self._k, self._updates = k, n
        self._events = [dict(e) for e in state["events"]]

    def __repr__(self) -> str:
        return (f"AsyncRatioController(ratio={self.ratio}, eta={self.eta()}, "
                f"threshold={self._threshold}, eta_max={self._eta_max})")
