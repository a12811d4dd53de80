"""Elastic cores, the trainer's side (``trainer.elastic_threads``, issue 16).

On a trainer-bound machine the engine runs out of admission capacity during an update (the
staleness bound eta admits no more prompts until the new version is published) and its cores
idle while the trainer computes with its own. :class:`TrainerThreadBorrowing` lets the trainer
borrow them for as long as the engine has nothing to do: at every layer boundary of the
trainer's models (forward pre-hooks on the blocks of each ``nn.ModuleList``, and in the
backward a gradient hook on each block's input) it asks the engine for its cores
(:meth:`~conveyor.rollout.engine.local.InferenceEngine.lend_threads`) and, once granted, runs
with its own intra-op threads plus the engine's; when work reaches the engine
(:attr:`~conveyor.rollout.engine.local.InferenceEngine.reclaim_requested`) it gives them back at
the next layer boundary, and always when the update ends (before the weights are published).
The engine never runs a forward pass while its cores are lent, so the two never oversubscribe
the machine; the engine waits at most one layer's forward or backward.

The other direction (the engine borrows the trainer's cores while the trainer waits for a batch)
is ``rollout.elastic_threads`` (:class:`~conveyor.runtime.step.LocalRollout`).

What it must never do: borrow outside the update (the checks run only inside :meth:`update` and
only on the thread that entered it; the hooks survive ``copy.deepcopy`` of a model as plain
closures that do nothing elsewhere), or keep the cores past the update.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from conveyor.hardware import restore_default_thread_count, set_own_thread_count

MIN_IDLE_S = 0.2
"""Seconds the engine must have been idle before its cores are borrowed, so that the short gap
between two tool turns of an episode (the next turn is submitted milliseconds later) is not
taken."""


class TrainerThreadBorrowing:
    """Borrow an idle engine's intra-op threads during the trainer's update (module docstring).

    Args:
        engine: The in-process engine (``lend_threads``, ``reclaim_requested``,
            ``return_threads``: :class:`~conveyor.rollout.engine.local.InferenceEngine`).
        own: The trainer thread's intra-op threads (int >= 1).
        extra: The engine's threads, added while borrowed (int >= 1).
        min_idle_s: Seconds the engine must have idled before a lend (:data:`MIN_IDLE_S`, read
            at construction, unless given).

    Raises:
        ValueError: ``own`` or ``extra`` < 1.
    """

    def __init__(self, engine, own: int, extra: int, *, min_idle_s: float | None = None):
        if own < 1 or extra < 1:
            raise ValueError(f"thread counts must be >= 1, got own={own}, extra={extra}")
        self.engine = engine
        self.own = own
        self.extra = extra
        self.min_idle_s = MIN_IDLE_S if min_idle_s is None else min_idle_s
        self._owner: int | None = None  # the thread inside update()
        self._borrowed_since: float | None = None
        self._step_borrows = 0
        self._step_seconds = 0.0
        self._handles: list = []
        self._default = own

    # ------------------------------------------------------------------ hooks

    def install(self, models: list[torch.nn.Module]) -> int:
        """Register the layer-boundary checks on ``models`` (each block of every ``nn.ModuleList``
        in them, e.g. a transformer's decoder layers; a model without one gets a check before
        its forward only).

        Args:
            models: The trainer's models (policy, frozen reference, critics); None entries skipped.

        Returns:
            The number of modules hooked.
        """
        poll = self.poll

        def before(module, args):  # a plain function: copied as is by copy.deepcopy
            poll()
            if torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                args[0].register_hook(_poll_in_backward(poll))

        n = 0
        for model in models:
            if model is None:
                continue
            blocks = [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1 for b in m]
            for b in blocks or [model]:
                self._handles.append(b.register_forward_pre_hook(before))
                n += 1
        return n

    def remove(self) -> None:
        """Remove the hooks :meth:`install` registered."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ the update

    @contextmanager
    def update(self) -> Iterator[dict[str, float]]:
        """The update's span: checks borrow only inside it, and the cores are given back when
        it ends (also on an error).

        Yields:
            A dict filled when the span ends with ``time/borrowed_threads_s`` (s the trainer ran
            with the engine's threads in this update) and ``elastic/trainer_borrows`` (leases).
        """
        out: dict[str, float] = {}
        self._owner = threading.get_ident()
        self._step_borrows, self._step_seconds = 0, 0.0
        try:
            yield out
        finally:
            self._give_back()
            self._owner = None
            out["time/borrowed_threads_s"] = self._step_seconds
            out["elastic/trainer_borrows"] = float(self._step_borrows)

    def poll(self) -> None:
        """One check (a layer boundary): borrow if the engine idles, give back if it wants its
        cores. Does nothing outside :meth:`update` or on another thread."""
        if self._owner != threading.get_ident():
            return
        if self._borrowed_since is not None:
            if self.engine.reclaim_requested:
                self._give_back()
        elif self.engine.lend_threads(self.min_idle_s):
            # (set_own_thread_count keeps torch's process-wide default, read from this thread's
            # count before the change; the give-back puts the same default back)
            self._default = set_own_thread_count(self.own + self.extra)
            self._borrowed_since = time.perf_counter()
            self._step_borrows += 1

    def _give_back(self) -> None:
        if self._borrowed_since is None:
            return
        torch.set_num_threads(self.own)
        restore_default_thread_count(self._default)
        dt = time.perf_counter() - self._borrowed_since
        self._borrowed_since = None
        self._step_seconds += dt
        self.engine.return_threads()


def _poll_in_backward(poll):
    def hook(grad):
        poll()
        return None
    return hook
