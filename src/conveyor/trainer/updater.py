"""An updater: one trained model with its optimizer, learning-rate schedule and parameter filter.

The trainer owns a list of updaters (the policy's; a critic's where ``critic.enabled``), each
stepped by the phase that trains it, so a new trained component (a critic, several mini-critics)
is one more updater, not another set of attributes on the trainer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch


def warmup_schedule(total_steps: int, warmup_steps: int, kind: str) -> Callable[[int], float]:
    """The learning-rate multiplier per optimiser step: linear warm-up over ``warmup_steps``, then
    constant or cosine decay to 0 at ``total_steps``.

    Args:
        total_steps: Optimiser steps of the whole run (>= 1 after clamping).
        warmup_steps: Optimiser steps of the linear warm-up (0: none).
        kind: ``"constant"`` or ``"cosine"``.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in ("constant", "cosine"):
        raise ValueError(f"schedule: unknown kind {kind!r} (constant, cosine)")
    total = max(1, total_steps)

    def lr_lambda(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "cosine":
            prog = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
            return 0.5 * (1.0 + math.cos(math.pi * prog))
        return 1.0

    return lr_lambda


@dataclass
class Updater:
    """A model, the parameters of it that train, their AdamW optimizer and schedule.

    Attributes:
        name: ``"policy"``, ``"critic"``, ... (metric prefix and checkpoint key).
        model: The module (fp32 parameters).
        optimizer: Over ``params`` only.
        scheduler: A ``LambdaLR`` on ``optimizer``.
        params: The trainable parameters (the parameter filter's choice).
        grad_clip: Global L2 gradient-norm clip (None: no clipping, the norm is still measured).
        steps: Optimiser steps taken.
        settings: The configured ``lr`` (the peak the schedule scales), ``betas`` and
            ``weight_decay`` (:meth:`adamw`); checkpointed with the optimizer
            (:meth:`apply_settings` makes a resume with other values take them).
        applied_lr: The learning rate of the last optimiser step taken (None before the first):
            what the parameters were updated with, not the schedule's next value.
    """

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    params: list[torch.nn.Parameter]
    grad_clip: float | None = None
    steps: int = 0
    settings: dict = field(default_factory=dict)
    applied_lr: float | None = None

    @classmethod
    def adamw(cls, name: str, model: torch.nn.Module, *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
              weight_decay: float = 0.0, grad_clip: float | None = None, total_steps: int = 1,
              warmup_steps: int = 0, schedule: str = "constant", fused: bool = False, foreach: bool | None = None,
              param_filter: Callable[[str, torch.nn.Parameter], bool] | None = None) -> Updater:
        """An updater with AdamW over the parameters that require grad (and pass ``param_filter``).

        Args:
            lr: Peak learning rate. total_steps, warmup_steps, schedule: :func:`warmup_schedule`.
            fused: The fused AdamW kernel (one kernel per parameter); ``foreach`` otherwise.
            param_filter: ``(name, parameter) -> bool``; None keeps every trainable parameter.

        Raises:
            ValueError: no parameter to train.
        """
        params = [p for n, p in model.named_parameters() if p.requires_grad and (param_filter is None or param_filter(n, p))]
        if not params:
            raise ValueError(f"{name}: no trainable parameters")
        opt = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay,
                                foreach=None if fused else foreach, fused=fused or None)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_schedule(total_steps, warmup_steps, schedule))
        return cls(name=name, model=model, optimizer=opt, scheduler=sched, params=params, grad_clip=grad_clip,
                   settings={"lr": float(lr), "betas": [float(b) for b in betas], "weight_decay": float(weight_decay)})

    def zero_grad(self) -> None:
        """Drop the gradients (``set_to_none``: their memory is freed)."""
        self.optimizer.zero_grad(set_to_none=True)

    def clip_grad_norm(self) -> torch.Tensor:
        """Clip the gradients of ``params`` to ``grad_clip`` in place; the norm before clipping
        (0-dim tensor; non-finite when a gradient is). Sharded parameters (FSDP2 ``DTensor``):
        the norm over every process's shards (collective)."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip or float("inf"))
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def step(self) -> None:
        """One optimiser step and one schedule step (:attr:`applied_lr`: the step's rate)."""
        self.applied_lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        self.steps += 1

    def scale_lr(self, factor: float) -> None:
        """Multiply the learning rate by ``factor`` from now on (the peak the schedule scales,
        and the current value); checkpointed with the scheduler's state.

        Raises:
            ValueError: ``factor`` not > 0.
        """
        if not factor > 0:
            raise ValueError(f"{self.name}: lr factor must be > 0, got {factor}")
        self.scheduler.base_lrs = [b * factor for b in self.scheduler.base_lrs]
        for g in self.optimizer.param_groups:
            g["lr"] *= factor
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    @property
    def lr(self) -> float:
        """The learning rate the next optimiser step will take (the schedule's current value)."""
        return self.scheduler.get_last_lr()[0]

    def apply_settings(self, saved: dict | None) -> list[str]:
        """After a checkpoint's optimizer and schedule were loaded: take this updater's
        configured :attr:`settings` where they differ from ``saved`` (the settings the
        checkpoint was written with), so that a resume with another ``lr``, ``betas`` or
        ``weight_decay`` trains with it (the loaded optimizer state holds the old values).

        A new ``lr`` rescales the schedule's peak by ``new / saved`` (a factor a monitor
        ``scale_lr`` action applied stays applied) and the current rate with it, at the
        schedule's position. ``saved`` None (a checkpoint written before the settings were
        saved) changes nothing.

        Returns:
            One line per setting taken, e.g. ``"lr 2e-05 -> 0.001"`` (empty: none differed).
        """
        if not saved:
            return []
        out = []
        old_lr, new_lr = float(saved.get("lr", self.settings.get("lr"))), self.settings.get("lr")
        if new_lr is not None and old_lr > 0 and new_lr != old_lr:
            self.scale_lr(new_lr / old_lr)  # the peak and the current rate, at the schedule's position
            out.append(f"lr {old_lr:g} -> {new_lr:g}")
        for key in ("betas", "weight_decay"):
            if key in saved and key in self.settings and saved[key] != self.settings[key]:
                value = tuple(self.settings[key]) if key == "betas" else self.settings[key]
                for g in self.optimizer.param_groups:
                    g[key] = value
                out.append(f"{key} {saved[key]} -> {self.settings[key]}")
        return out

    def state_dict(self) -> dict:
        """Model, optimizer and scheduler state and the step count."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "steps": self.steps,
                "optimizer_settings": dict(self.settings)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state.get("steps", 0))


def trainable(params: Iterable[torch.nn.Parameter]) -> int:
    """Number of elements of the parameters that require grad."""
    return sum(p.numel() for p in params if p.requires_grad)
