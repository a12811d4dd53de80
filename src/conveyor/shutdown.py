"""Stopping a training process on Ctrl-C / SIGTERM, without tracebacks.

The policy (:class:`Interrupts`):

1. During the training loop (the *graceful* phase) the first SIGINT / SIGTERM asks the loop to
   stop after the current step; the runtime then writes a checkpoint and exits.
2. Any further signal, or the first one outside the training loop (model loading, the held-out
   evaluations, the export), raises :class:`StopNow` in the main thread: the runtime stops its
   threads and worker processes, skips what is left (a half-done step is never checkpointed), and
   reports what was and was not saved (:attr:`StopNow.report`). No traceback.
3. A signal while that clean-up runs ends the process at once (``os._exit(130)``).

Signal handlers can only be installed from the main thread; elsewhere (a run started from a
worker thread) :class:`Interrupts` does nothing and the caller's own handling applies.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


class StopNow(KeyboardInterrupt):
    """Raised in the main thread by a second Ctrl-C / SIGTERM (or the first one outside the
    training loop). ``report`` is filled in by the runtime: what was saved, what was not, and how
    to continue."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum
        self.report = ""


class Interrupts:
    """SIGINT / SIGTERM handling of one training process (see the module docstring).

    Args:
        say: Called with a one-line message when a signal is handled (e.g. ``console.print``).

    Attributes:
        stop: Set by the first signal of the graceful phase; the training loop polls it.
        requested: True once any stop was requested.
    """

    def __init__(self, say=print):
        self.say = say
        self.stop = threading.Event()
        self.requested = False
        self.graceful = False
        self._stopping_now = False
        self._old: dict[int, object] = {}

    def install(self) -> None:
        """Install the handlers (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread() or self._old:
            return
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        """Put the previous handlers back (idempotent)."""
        old, self._old = self._old, {}
        for s, h in old.items():
            signal.signal(s, h)

    def begin_graceful(self) -> threading.Event:
        """Enter the training loop: the first signal now only sets :attr:`stop`. Returns it."""
        self.graceful = True
        return self.stop

    def end_graceful(self) -> None:
        """Leave the training loop: the next signal raises :class:`StopNow`."""
        self.graceful = False

    def _handle(self, signum, frame) -> None:
        if self._stopping_now:
            sys.stderr.write("\nstopping at once (third signal); nothing more is written\n")
            os._exit(130)
        if self.graceful and not self.requested:
            self.requested = True
            self.stop.set()
            self.say(
                "[yellow]stopping: finishing the current step and writing a checkpoint "
                "(Ctrl-C again to stop now, without it)...[/]"
            )
            return
        self.requested = True
        self._stopping_now = True
        self.stop.set()
        self.say("[yellow]stopping now...[/]")
        raise StopNow(signum)
