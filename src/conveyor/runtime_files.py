"""Run-directory files that survive crashes, full disks and a second process.

Three guarantees the runtime (:mod:`conveyor.train`) builds on:

- **One process per run directory.** :class:`RunLock` takes an OS advisory lock
  (``fcntl.flock``, exclusive, non-blocking) on ``RUN_DIR/run.lock`` for the whole life of a
  training process and writes its PID there. The kernel drops the lock when the process exits
  or is killed (``kill -9`` included), so a crashed run never blocks its own resume, and a second
  process (e.g. a ``--resume`` started while the first is still alive) is refused with the PID of
  the holder instead of training alongside it.
- **No half-written files.** :func:`atomic_write_text` / :func:`atomic_write` write a temporary
  sibling, ``fsync`` it and ``os.replace`` it over the target (POSIX rename is atomic): a reader,
  or the next process after a crash, sees the old file or the new one, never an empty or
  truncated one.
- **Clear errors.** A full disk (``ENOSPC`` / ``EDQUOT``), a read-only file system or a
  ``run.dir`` that cannot be created (e.g. under a regular file) become a
  :class:`RunFileError` whose message names the path and what to do, instead of a traceback.

``RunFileError`` subclasses ``OSError``, so code that already tolerates ``OSError`` keeps doing so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOCK_FILE = "run.lock"

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


class RunFileError(OSError):
    """A run-directory file could not be created or written; the message names the path and the
    remedy. Subclasses: :class:`RunDirInUseError`, :class:`DiskFullError`. ``str()`` is the
    message alone (``errno`` stays an attribute; not ``[Errno 16] ...`` on the console)."""

    def __str__(self) -> str:
        return self.strerror if self.strerror else super().__str__()


class RunDirInUseError(RunFileError):
    """Another live process holds the run directory's lock (``run.lock``)."""


class DiskFullError(RunFileError):
    """No space left on the device (or over quota) while writing a run-directory file."""


def describe_os_error(err: OSError, what: str) -> RunFileError:
    """Turn an ``OSError`` met while writing ``what`` into a :class:`RunFileError` with a message a
    user can act on (a full disk becomes :class:`DiskFullError`).

    Args:
        err: The original error (``errno`` and ``filename`` are used when set).
        what: What was being written, e.g. ``"checkpoint step_4"`` or ``"summary.json"``.

    Returns:
        The error to raise (``raise describe_os_error(e, ...) from e``).
    """
    if isinstance(err, RunFileError):
        return err
    where = f" ({err.filename})" if getattr(err, "filename", None) else ""
    if err.errno in _DISK_FULL:
        return DiskFullError(
            err.errno,
            f"no space left on the device while writing {what}{where}: "
            "free some space, then continue with `conveyor train --resume RUN_DIR`",
        )
    if err.errno == errno.EROFS:
        return RunFileError(err.errno, f"read-only file system: cannot write {what}{where}")
    if err.errno in (errno.EACCES, errno.EPERM):
        return RunFileError(err.errno, f"permission denied writing {what}{where}")
    return RunFileError(err.errno, f"cannot write {what}{where}: {err.strerror or err}")


def is_disk_full(err: BaseException) -> bool:
    """True when ``err`` is an ``OSError`` for a full disk or an exhausted quota."""
    return isinstance(err, OSError) and err.errno in _DISK_FULL


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(
    path: str | Path, writer: Callable[[Path], None], *, what: str | None = None
) -> Path:
    """Write ``path`` atomically: ``writer(tmp)`` fills a temporary sibling, which is ``fsync``-ed
    and renamed over ``path``. On any failure the temporary file is removed and ``path`` is left as
    it was.

    Args:
        path: The target file; its parent directory must exist.
        writer: Called with the temporary path; writes the complete content there.
        what: How to name the file in error messages (default: its name).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        RunFileError: the write failed (:class:`DiskFullError` for a full disk); other exceptions
            from ``writer`` propagate unchanged.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        writer(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise describe_os_error(e, what or path.name) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | Path, text: str, *, what: str | None = None) -> Path:
    """:func:`atomic_write` of a UTF-8 text. Raises :class:`RunFileError` (see there)."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), what=what)


def atomic_write_json(
    path: str | Path, obj: Any, *, indent: int | None = 2, what: str | None = None
) -> Path:
    """:func:`atomic_write` of ``json.dumps(obj)`` (non-JSON values via ``str``). Raises
    :class:`RunFileError` (see there); the JSON is built before the file is touched."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, default=str), what=what)


def _nearest_existing(p: Path) -> Path:
    """``p`` or its nearest ancestor that exists (what a write there would be created under)."""
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_output_file(path: str | Path, what: str) -> Path:
    """Check, without creating anything, that ``path`` can be written as a file: not a
    directory, not under a regular file, its nearest existing ancestor writable. Run before the
    work whose result goes there (fresh-user trial 5: ``conveyor eval -o DIR`` failed with a
    traceback after the evaluation).

    Args:
        path: The file to be written.
        what: How to name it in the message (e.g. ``"--output"``).

    Raises:
        RunFileError: naming ``what`` and the path.
    """
    p = Path(path)
    if p.is_dir():
        raise RunFileError(errno.EISDIR, f"{what} {p} is a directory: give a file path (e.g. {p / 'eval.json'})")
    anc = _nearest_existing(p.parent)
    if not anc.is_dir():
        raise RunFileError(errno.ENOTDIR, f"{what} {p}: {anc} is a regular file, so nothing can be written under it")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise RunFileError(errno.EACCES, f"{what} {p}: {anc} is not writable")
    return p


# ---------------------------------------------------------------------- the run directory
def check_run_dir(path: str | Path) -> Path:
    """Check, without creating anything, that ``path`` is or can become a writable directory.

    Run before the model is loaded, so a bad ``run.dir`` fails in a second, not after a minute.

    Raises:
        RunFileError: ``path`` is a file, lies under a regular file, or its nearest existing
            ancestor is not writable.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise RunFileError(errno.ENOTDIR, f"run.dir={p} is a file, not a directory")
    anc = _nearest_existing(p)
    if not anc.is_dir():
        raise RunFileError(
            errno.ENOTDIR,
            f"run.dir={p}: {anc} is a regular file, so no directory can be created under it",
        )
    if not os.access(anc, os.W_OK | os.X_OK):
        raise RunFileError(errno.EACCES, f"run.dir={p}: {anc} is not writable")
    return p


def make_run_dir(path: str | Path) -> Path:
    """``mkdir -p`` the run directory with a clear error. Raises :class:`RunFileError`."""
    p = check_run_dir(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise describe_os_error(e, f"run directory {p}") from e
    return p


class RunLock:
    """An exclusive lock on a run directory (``RUN_DIR/run.lock``, ``fcntl.flock``).

    The lock belongs to the open file description, which is opened close-on-exec, so worker
    processes started with ``spawn`` / ``forkserver`` do not inherit it; the kernel releases it
    when the holder exits or is killed. The file keeps the holder's PID, host and start time
    (JSON) so a refused process can name it; the file itself is left on disk (its presence means
    nothing, only the lock does).

    Args:
        run_dir: An existing directory.
    """

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> RunLock:
        """Take the lock without waiting.

        Returns:
            ``self``.

        Raises:
            RunDirInUseError: another process holds it (the message names its PID).
            RunFileError: the lock file cannot be created (e.g. a read-only directory).
        """
        if self._fd is not None:
            return self
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise describe_os_error(e, f"the lock file {self.path}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise describe_os_error(e, f"the lock file {self.path}") from e
            raise RunDirInUseError(
                errno.EBUSY,
                f"run directory {self.run_dir} is in use by {holder_name(holder)} (it holds {self.path}); two "
                "processes on one run directory would both train and write checkpoints. Wait for "
                f"it to finish or stop it (e.g. `kill {holder.get('pid', 'PID')}`; Ctrl-C or "
                "SIGTERM writes a checkpoint), then resume.",
            ) from None
        info = json.dumps(
            {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        )
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, info.encode(), 0)
        except OSError:
            pass  # the lock is what matters; the PID is only for the message
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        info = json.loads(raw)
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def holder_name(holder: dict) -> str:
    """A lock holder (:func:`lock_holder`'s dict) for a message: ``process PID`` (``on HOST``
    when another machine holds it), or ``another process`` when the file names none."""
    who = f"process {holder['pid']}" if holder.get("pid") else "another process"
    if holder.get("host") and holder["host"] != socket.gethostname():
        who += f" on {holder['host']}"
    return who


def lock_holder(run_dir: str | Path) -> dict | None:
    """Whether a live process holds ``RUN_DIR/run.lock`` now (a run being trained): its
    ``{"pid", "host", "started"}`` as the holder wrote them (``{}`` when unreadable), or None
    when nobody holds it (or there is no lock file). Tests the lock by taking and dropping it
    at once, without waiting; the file is never created or written."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return _read_holder(fd)
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """True when a process with this PID exists (``kill(pid, 0)``; EPERM counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
