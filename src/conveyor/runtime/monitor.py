"""The run monitor: three tiers over a run's signals (AsyPPO's monitoring, MISSION.md section 4;
issue 13 section 3).

- **info**: the metrics themselves (every step's row; nothing to do here);
- **warning**: rules that fire an :class:`Alert` (console, ``events.jsonl``, the report);
- **action**: the same rules with a configured action the runtime carries out: ``lower_eta``
  (the staleness bound minus one, never below 0), ``scale_lr`` (every learning rate times
  ``lr_scale``), ``stop`` (stop after this step with a checkpoint, like a first Ctrl-C).

Rules (:class:`MonitorSettings` holds their thresholds):

- ``plateau``: ``plateau_evals`` (3) consecutive periodic held-out evaluations
  (``run.eval_every``) each improving less than ``plateau_min_rel`` (5%) relative to the one
  before: ``.50, .60, .62, .63, .64`` fires at the fifth; ``.50, .52, .60, .61, .62`` does not
  (the article's "three consecutive checkpoints each improving the reward by less than 5%").
  A relative change needs a positive previous value; from 0, any rise counts as improving.
- ``keep_rate``: the discrepancy keep-rate (the first of ``keep_rate_keys`` present in the row:
  the share of tokens whose pi_prox / pi_behav lies in the band) below ``keep_rate_min``.
- ``nonfinite``: ``nonfinite_steps`` (2) consecutive steps skipped for a non-finite loss.
- ``staleness_pinned``: ``pinned_steps`` (5) consecutive steps whose mean staleness is at least
  ``pinned_share`` (0.9) of eta (eta > 0): rollouts always arrive at the bound, so the bound,
  not the policy's speed, sets the pace and stale drops are likely.
- ``reward_failures``: the step's share of failed rewards above ``reward_failure_share`` (0.2).

After firing, a rule re-arms only when its condition has been false once (one alert per
episode of trouble, not one per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["ACTIONS", "RULES", "Alert", "MonitorSettings", "RunMonitor", "plateau"]

RULES = ("plateau", "keep_rate", "nonfinite", "staleness_pinned", "reward_failures")
ACTIONS = ("none", "lower_eta", "scale_lr", "stop")

Action = Literal["none", "lower_eta", "scale_lr", "stop"]


@dataclass(frozen=True)
class Alert:
    """A rule that fired.

    Attributes:
        rule: One of :data:`RULES`.
        step: The policy version (log step) it fired at.
        message: One readable sentence with the values that made it fire.
        action: What the runtime should do (:data:`ACTIONS`; ``"none"``: a warning only).
        values: The numbers behind it (for ``events.jsonl``).
    """

    rule: str
    step: int
    message: str
    action: str = "none"
    values: dict = field(default_factory=dict)

    @property
    def level(self) -> str:
        """``"warning"``, or ``"action"`` when an action is configured."""
        return "warning" if self.action == "none" else "action"


@dataclass
class MonitorSettings:
    """Thresholds and actions of the rules (module docstring); ``actions`` maps a rule to its
    action (missing: ``"none"``).

    Raises:
        ValueError: an unknown rule or action (naming it), or a threshold out of range.
    """

    plateau_evals: int = 3
    plateau_min_rel: float = 0.05
    keep_rate_min: float = 0.8
    keep_rate_keys: tuple[str, ...] = ("loss/discrepancy_keep_frac", "proximal/ewma_keep_rate")
    nonfinite_steps: int = 2
    pinned_steps: int = 5
    pinned_share: float = 0.9
    reward_failure_share: float = 0.2
    lr_scale: float = 0.5
    actions: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        for rule, action in self.actions.items():
            if rule not in RULES:
                raise ValueError(f"monitor.actions: unknown rule {rule!r} (rules: {', '.join(RULES)})")
            if action not in ACTIONS:
                raise ValueError(f"monitor.actions.{rule}: unknown action {action!r} (actions: {', '.join(ACTIONS)})")
        for name in ("plateau_evals", "nonfinite_steps", "pinned_steps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"monitor.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.lr_scale <= 1:
            raise ValueError(f"monitor.lr_scale must be in (0, 1], got {self.lr_scale}")


def plateau(values: Sequence[float], n: int = 3, min_rel: float = 0.05) -> bool:
    """Whether the last ``n`` evaluations each improved less than ``min_rel`` relative to the
    one before (needs ``n + 1`` values). From a previous value <= 0 a rise counts as improving.

    Examples (``n`` 3, 5%): ``.50, .60, .62, .63, .64`` -> True; ``.50, .52, .60, .61, .62``
    -> False (.52 -> .60 is +15%, only two small steps follow).
    """
    if len(values) < n + 1:
        return False
    tail = list(values)[-(n + 1):]
    for prev, cur in zip(tail, tail[1:]):
        if prev <= 0:
            if cur > prev:
                return False
            continue
        if (cur - prev) / prev >= min_rel:
            return False
    return True


class RunMonitor:
    """Applies the rules to each step's metrics row and each periodic evaluation.

    Args:
        settings: Thresholds and actions.
        eta: The staleness bound (for ``staleness_pinned``; None or 0 disables that rule);
            update it with :meth:`set_eta` when an action or a controller changes it.
    """

    def __init__(self, settings: MonitorSettings | None = None, eta: int | None = None):
        self.s = settings or MonitorSettings()
        self.eta = eta
        self.evals: list[float] = []
        self._nonfinite = 0
        self._pinned = 0
        self._armed = dict.fromkeys(RULES, True)
        self.alerts: list[Alert] = []

    def set_eta(self, eta: int | None) -> None:
        """The staleness bound changed."""
        self.eta = eta

    def _fire(self, rule: str, active: bool, step: int, message: str, values: dict) -> list[Alert]:
        if not active:
            self._armed[rule] = True
            return []
        if not self._armed[rule]:
            return []
        self._armed[rule] = False
        a = Alert(rule, step, message, self.s.actions.get(rule, "none"), values)
        self.alerts.append(a)
        return [a]

    def on_step(self, step: int, metrics: dict) -> list[Alert]:
        """The rules over one step's metrics row; returns the alerts that fired."""
        s, out = self.s, []
        keep_key = next((k for k in s.keep_rate_keys if k in metrics), None)
        if keep_key is not None:
            keep = float(metrics[keep_key])
            out += self._fire("keep_rate", keep < s.keep_rate_min, step,
                              f"discrepancy keep-rate {keep:.3f} < {s.keep_rate_min} ({keep_key}): the proximal "
                              "and behaviour policies disagree on many tokens", {"keep_rate": keep, "key": keep_key})
        self._nonfinite = self._nonfinite + 1 if metrics.get("train/skipped_nonfinite") else 0
        out += self._fire("nonfinite", self._nonfinite >= s.nonfinite_steps, step,
                          f"{self._nonfinite} consecutive steps skipped for a non-finite loss or gradient",
                          {"in_a_row": self._nonfinite})
        mean_st = metrics.get("staleness/mean")
        pinned = bool(self.eta) and mean_st is not None and float(mean_st) >= s.pinned_share * self.eta
        self._pinned = self._pinned + 1 if pinned else 0
        out += self._fire("staleness_pinned", self._pinned >= s.pinned_steps, step,
                          f"mean staleness at the bound for {self._pinned} steps (>= {s.pinned_share} x eta "
                          f"= {self.eta}): the bound sets the pace", {"staleness_mean": mean_st, "eta": self.eta})
        fail = metrics.get("rollout/reward_failed_share")
        out += self._fire("reward_failures", fail is not None and float(fail) > s.reward_failure_share, step,
                          f"{float(fail or 0):.0%} of the step's rewards failed (> {s.reward_failure_share:.0%})",
                          {"reward_failed_share": fail})
        return out

    def on_eval(self, step: int, pass_at_1: float) -> list[Alert]:
        """The plateau rule over the periodic held-out evaluations; returns the alerts."""
        self.evals.append(float(pass_at_1))
        s = self.s
        flat = plateau(self.evals, s.plateau_evals, s.plateau_min_rel)
        tail = ", ".join(f"{v:.3f}" for v in self.evals[-(s.plateau_evals + 1):])
        return self._fire("plateau", flat, step,
                          f"held-out accuracy plateaued: {s.plateau_evals} evaluations in a row improved less "
                          f"than {s.plateau_min_rel:.0%} ({tail})", {"evals": list(self.evals)})
