"""Self-steering runs (issue 13, sections 2 and 3; MISSION.md section 4): what the runtime does
after each step and each periodic evaluation besides recording it.

- the **adaptive staleness controller** (:class:`~conveyor.rollout.adaptive.AsyncRatioController`,
  ``async.adaptive=true``): after every policy update the batch's reward variance moves the async
  ratio one step (toward on-policy above the threshold, toward asynchrony otherwise) and the
  staleness bound ``eta = floor(ratio * eta_max)`` follows at once (the capacity rule stays exact:
  ``StalenessManager.set_eta`` / ``TrajectoryBuffer.set_eta``);
- the **run monitor** (:class:`~conveyor.runtime.monitor.RunMonitor`): its alerts go to the
  console and ``events.jsonl`` (``alert`` events), and an alert with an action changes the run:
  ``lower_eta`` (eta - 1, not below 0; with the adaptive controller on, the controller's own
  bound takes over again at its next change), ``scale_lr`` (every learning rate of the trainer
  times ``monitor.lr_scale``), ``stop`` (a graceful stop after this step, with its checkpoint).

:class:`RunSteering` talks to the rest through callbacks (``set_eta``, ``scale_lr``,
``request_stop``, ``event``, ``say``), so it runs unchanged in every runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from conveyor.rollout.adaptive import AsyncRatioController
from conveyor.runtime.monitor import Alert, RunMonitor

__all__ = ["RunSteering"]


class RunSteering:
    """Adaptive eta and monitor actions for one run (module docstring).

    Args:
        monitor: The run monitor, or None (no rules).
        controller: The async ratio controller, or None (eta fixed).
        eta: The staleness bound in force now (None: unbounded; then neither the controller nor
            ``lower_eta`` applies).
        set_eta: ``(eta) -> None``: apply a new staleness bound to the rollout side.
        scale_lr: ``(factor) -> None``: multiply every learning rate of the trainer.
        request_stop: ``() -> None``: stop gracefully after the current step.
        event: ``(name, **fields) -> None``: write an event (``events.jsonl``).
        say: ``(text) -> None``: a console line.
        settings: The configuration the eta and the controller follow (``async.eta``,
            ``async.adaptive``, ``async.eta_max``, the ratio keys): saved in :meth:`state_dict`
            so that a resume can tell whether its configuration changed them
            (:meth:`changed_settings`).
    """

    def __init__(self, monitor: RunMonitor | None, controller: AsyncRatioController | None, eta: int | None, *,
                 set_eta: Callable[[int], None], scale_lr: Callable[[float], None],
                 request_stop: Callable[[], None], event: Callable[..., None], say: Callable[[str], None],
                 lr_scale: float = 0.5, settings: dict | None = None):
        self.monitor, self.controller, self.eta = monitor, controller, eta
        self.settings = dict(settings or {})
        self._set_eta, self._scale_lr, self._stop = set_eta, scale_lr, request_stop
        self._event, self._say, self.lr_scale = event, say, lr_scale
        self.stopped_by: str | None = None  # "monitor rule R" once a rule's stop action fired
        if monitor is not None:
            monitor.set_eta(eta)

    def _apply_eta(self, eta: int, step: int, reason: str) -> None:
        if eta == self.eta:
            return
        old, self.eta = self.eta, eta
        self._set_eta(eta)
        if self.monitor is not None:
            self.monitor.set_eta(eta)
        self._event("eta_change", version=step, old_eta=old, new_eta=eta, reason=reason)
        self._say(f"  eta {old} -> {eta} at version {step}: {reason}")

    def _handle(self, alerts: Sequence[Alert]) -> None:
        for a in alerts:
            self._event("alert", version=a.step, rule=a.rule, level=a.level, action=a.action, message=a.message,
                        **{k: v for k, v in a.values.items() if k not in ("rule", "level", "action", "message")})
            self._say(f"[yellow]{a.level}[/] ({a.rule}) at version {a.step}: {a.message}"
                      + (f" -> {a.action}" if a.action != "none" else ""))
            if a.action == "lower_eta" and self.eta:
                self._apply_eta(self.eta - 1, a.step, f"monitor rule {a.rule}")
            elif a.action == "scale_lr":
                self._scale_lr(self.lr_scale)
                self._event("lr_scaled", version=a.step, factor=self.lr_scale, rule=a.rule)
            elif a.action == "stop":
                self.stopped_by = self.stopped_by or f"monitor rule {a.rule}"
                self._stop()

    def after_step(self, step: int, metrics: dict, rewards: Sequence[float]) -> list[Alert]:
        """After policy update ``step``: the controller sees the batch's reward variance
        (population variance), then the monitor sees the metrics row.

        Returns:
            The alerts that fired.
        """
        if self.controller is not None and self.eta is not None and rewards:
            n = len(rewards)
            mean = sum(rewards) / n
            var = sum((r - mean) ** 2 for r in rewards) / n
            self.controller.update(var)
            ev = self.controller.events[-1] if self.controller.events else None
            if self.controller.eta() != self.eta:
                self._apply_eta(self.controller.eta(), step, ev["reason"] if ev else "adaptive controller")
        alerts = self.monitor.on_step(step, metrics) if self.monitor is not None else []
        self._handle(alerts)
        return alerts

    def after_eval(self, step: int, pass_at_1: float) -> list[Alert]:
        """After a periodic held-out evaluation: the plateau rule."""
        alerts = self.monitor.on_eval(step, pass_at_1) if self.monitor is not None else []
        self._handle(alerts)
        return alerts

    def state_dict(self) -> dict:
        """The controller's state, the eta in force, the settings they follow and the monitor's
        evaluations (checkpoints)."""
        return {"eta": self.eta, "controller": self.controller.state_dict() if self.controller else None,
                "evals": list(self.monitor.evals) if self.monitor else [], "settings": dict(self.settings)}

    def changed_settings(self, state: dict) -> list[str]:
        """The keys of :attr:`settings` whose value differs from those saved in ``state``
        (a checkpoint written before the settings were saved: none, it is restored as before)."""
        saved = state.get("settings")
        if not saved:
            return []
        return sorted(k for k in set(saved) | set(self.settings) if saved.get(k) != self.settings.get(k))

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (then the caller applies :attr:`eta`). When the
        settings changed since the checkpoint (:meth:`changed_settings`: e.g. a resume with
        ``async.eta=1`` or ``async.adaptive=false``) the eta and the controller stay as this
        configuration starts them, so the bound asked for is the one in force; the monitor's
        evaluations are restored either way."""
        if not self.changed_settings(state):
            if self.controller is not None and state.get("controller"):
                self.controller.load_state_dict(state["controller"])
            self.eta = state.get("eta", self.eta)
        if self.monitor is not None:
            self.monitor.evals = list(state.get("evals", []))
            self.monitor.set_eta(self.eta)
