"""Stopping a training process on Ctrl-C / SIGTERM, without tracebacks.

The policy (:class:`Interrupts`):

1. During the training loop (the *graceful* phase) the first SIGINT / SIGTERM asks the loop to
   stop after the current step; the runtime then writes a checkpoint and exits.
2. Any further signal, or the first one outside the training loop (model loading, the held-out
   evaluations, the export), raises :class:`StopNow` in the main thread: the runtime stops its
   threads and worker processes, skips what is left (a half-done step is never checkpointed), and
   reports what was and was not saved (:attr:`StopNow.report`). No traceback.
3. A signal while that clean-up runs ends the process at once (``os._exit(130)``). That is the
   third signal after a graceful stop, but the second when the first one came outside the
   training loop (e.g. a SIGTERM during the held-out evaluation), so the messages name the signal
   and count the signals this process received.

A SIGTERM that repeats one handled less than :data:`DUPLICATE_SIGTERM_S` before is the same
request delivered twice and is ignored: GNU ``timeout`` (and process managers that stop a whole
process group) sends SIGTERM to the process and then to its process group, which holds the
process too, so about every other ``timeout`` expiry reached the handler twice, turning one
request into "stop now" (no checkpoint) or, outside the loop, into an exit that skipped the
clean-up report.

Signal handlers can only be installed from the main thread; elsewhere (a run started from a
worker thread) :class:`Interrupts` does nothing and the caller's own handling applies.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

DUPLICATE_SIGTERM_S = 0.2
"""A SIGTERM this soon (s) after the previous one is a duplicate delivery, not a second request."""

_ORDINALS = ("first", "second", "third")


def _signal_name(signum: int) -> str:
    """``SIGTERM`` for 15 (the number itself if the platform has no name for it)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _ordinal(n: int) -> str:
    return _ORDINALS[n - 1] if 1 <= n <= len(_ORDINALS) else f"{n}th"


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
        clock: Monotonic seconds (tests pass a fake one), for duplicate SIGTERMs.

    Attributes:
        stop: Set by the first signal of the graceful phase; the training loop polls it.
        requested: True once any stop was requested.
    """

    def __init__(self, say=print, clock=time.monotonic):
        self.say = say
        self.clock = clock
        self._last_sigterm: float | None = None
        self.stop = threading.Event()
        self.requested = False
        self.graceful = False
        self._stopping_now = False
        self.received = 0  # signals handled so far (the console messages count them)
        self.first_signum: int | None = None  # the signal that asked the run to stop (exit code 128 + it)
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
        if signum == signal.SIGTERM:
            now = self.clock()
            if self._last_sigterm is not None and now - self._last_sigterm < DUPLICATE_SIGTERM_S:
                return  # one SIGTERM sent to the process and to its group (e.g. by `timeout`)
            self._last_sigterm = now
        self.received += 1
        if self.first_signum is None:
            self.first_signum = int(signum)
        name, nth = _signal_name(signum), _ordinal(self.received)
        if self._stopping_now:
            sys.stderr.write(
                f"\nstopping at once: {name} ({nth} signal) arrived while the process was already "
                "stopping; nothing more is written\n"
            )
            os._exit(128 + int(signum))
        if self.graceful and not self.requested:
            self.requested = True
            self.stop.set()
            self.say(
                f"[yellow]{name}: stopping after the current step, with a checkpoint "
                "(Ctrl-C or SIGTERM again stops now, without it)...[/]"
            )
            return
        why = "again" if self.requested else "outside the training loop"
        self.requested = True
        self._stopping_now = True
        self.stop.set()
        self.say(f"[yellow]{name} ({nth} signal, {why}): stopping now...[/]")
        raise StopNow(signum)
