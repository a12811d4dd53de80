"""Run model-written Python code in a bubblewrap sandbox, and the Python tool built on it.

Issue 14, section 2. Code a model writes is untrusted: it may loop forever, fork-bomb, allocate
all memory, print without end, read secrets, open sockets or kill its parent. Each call runs in
a fresh sandbox made by bubblewrap (``bwrap``, Debian/Ubuntu package ``bubblewrap``,
https://github.com/containers/bubblewrap; the sandbox tool of Flatpak), never by ``exec`` in
this process:

* **Namespaces** (``--unshare-all --unshare-user``): a new user, mount, PID, network, IPC, UTS
  and cgroup namespace per call. The network namespace holds only its own loopback device:
  127.0.0.1 there is the sandbox itself (connecting to a host service is refused) and there is
  no route anywhere else (unreachable). In the PID namespace bwrap's own
  init is PID 1 and the program is PID 2: ``os.kill(os.getppid(), 9)`` signals that init, which
  the kernel protects from signals sent inside its namespace, and nothing outside is visible.
  ``--disable-userns`` forbids nested user namespaces; ``--new-session`` detaches the terminal
  (no ``TIOCSTI`` injection); ``--die-with-parent`` kills the sandbox if this process dies.
* **Files**: the root is a fresh tmpfs, read-only once built (``--remount-ro /``). ``/usr`` is
  bound read-only (with the ``/bin``, ``/lib``, ``/lib64``, ``/sbin`` symlinks or read-only
  binds of the host), from ``/etc`` only ``ld.so.cache`` and ``localtime``, plus the
  interpreter's installation when it lies outside ``/usr``, and any
  :attr:`SandboxConfig.site_packages`; a fresh ``/proc`` (bwrap keeps ``/proc/sys`` read-only)
  and bwrap's minimal ``/dev`` (null, zero, urandom, ...; read-only). The only writable places
  are two private tmpfs, each :attr:`SandboxConfig.tmp_bytes` large and gone when the call
  ends: ``/tmp``, the working directory (``HOME`` and ``TMPDIR`` too), and ``/dev/shm``
  (POSIX semaphores for ``multiprocessing``). ``/root``, ``/home``, ``/work``, the host's
  ``/tmp`` and the run directory are not there at all.
* **Identity**: when conveyor runs as root, bwrap itself is started as an unprivileged host user
  (:attr:`SandboxConfig.host_uid`, default 65534 "nobody"), so the sandbox holds no root identity
  on the host. This is required, not cosmetic: the kernel never enforces ``RLIMIT_NPROC`` on
  processes whose real user is host root (``kernel/fork.c`` exempts ``INIT_USER``), even inside
  a user namespace; measured here, a fork loop under a 16-process limit created 32,430
  processes when the sandbox mapped to host root and stopped at 14 as "nobody". Inside, the
  program runs as uid/gid 65534 with no capabilities and ``no_new_privs`` set.
* **Limits** (``setrlimit`` in the sandbox, set by a small runner before the code runs, hard =
  soft so the code cannot raise them): CPU seconds (``RLIMIT_CPU``; SIGXCPU at the limit,
  SIGKILL one second later), address space (``RLIMIT_AS``), processes and threads
  (``RLIMIT_NPROC``; set *inside* the new user namespace, where the kernel counts only this
  sandbox's processes), file size (``RLIMIT_FSIZE``), open files (``RLIMIT_NOFILE``), no core
  files. Wall time is enforced from outside: bwrap is started in its own session and, on
  timeout, the whole process group is killed with SIGKILL; its init then dies
  (``--die-with-parent``) and the kernel kills every process of the PID namespace. Output
  (stdout + stderr) is read up to :attr:`SandboxConfig.max_output_bytes`, then the sandbox is
  killed and the observation says ``"output truncated"``.
* **Environment**: ``--clearenv``, then only ``PATH``, ``HOME``, ``TMPDIR``, ``LANG``, ``USER``
  and single-thread settings for OpenMP / OpenBLAS / MKL (their default of one thread per core
  would hit the process limit). The interpreter runs with ``-I -B -u`` (isolated: ``PYTHON*``
  variables and the user site ignored; no ``.pyc`` writes; unbuffered, so output printed before
  a timeout reaches the model).

Each call returns a :class:`SandboxResult`: stdout / stderr (capped), the exit status and an
*incident* kind (:data:`INCIDENT_KINDS`) with an observation for the model such as
``"Error: time limit 10 s exceeded; the program was killed."``.

User namespaces: bwrap (0.8.0, Debian 12) creates them in this container both as root and as an
unprivileged user (``/proc/sys/user/max_user_namespaces`` = 96363; no AppArmor restriction).
Hosts that restrict unprivileged user namespaces (Ubuntu 23.10 and later through AppArmor,
``kernel.apparmor_restrict_unprivileged_userns=1``, unless bwrap has a profile; some hardened
kernels with ``kernel.unprivileged_userns_clone=0``) make every call fail with a
``"sandbox_error"`` incident whose observation quotes bwrap's message; :func:`check_sandbox`
raises it up front.

Start cost: see docs/results/sandbox.md (``benchmarks/sandbox.py``): a median of about 50 to
60 ms per ``print(1)`` call on the busy 2-core development VM, of which 20 to 35 ms is the
interpreter's own start; under the ~100 ms at which a pool of pre-started sandboxes would pay
off, so every call gets a fresh sandbox (the runner reads the program before it sets any limit,
so a pre-started sandbox waiting on stdin would be a small change if that ever changes).

Zombies: bwrap's outer process exits as soon as it knows the program's exit status, before its
init inside the sandbox is reaped, so that init (dead, holding only a PID) is reparented to the
host's init, which reaps it. Where the trainer itself is PID 1 (a container without an init),
run the container with an init (``docker run --init``) or those zombies accumulate.

Not protected against (see docs/results/sandbox.md): kernel exploits (no seccomp filter; the
sandbox can make any system call its namespaces allow), CPU-time and cache side channels,
hosts without user namespaces (every call is then a ``sandbox_error``), and the host RAM of the
two tmpfs (bounded by ``tmp_bytes`` each, not charged to ``RLIMIT_AS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from conveyor.envs.tools import ToolResult, check_arguments

IncidentKind = Literal[
    "timeout", "cpu_limit", "memory", "output_limit", "fork_limit", "killed", "sandbox_error"
]
INCIDENT_KINDS: tuple[str, ...] = (
    "timeout",
    "cpu_limit",
    "memory",
    "output_limit",
    "fork_limit",
    "killed",
    "sandbox_error",
)
"""Every incident kind, in the order :attr:`PythonTool.incidents` lists them:

* ``timeout``: the wall-time limit passed; the sandbox was killed from outside.
* ``cpu_limit``: the program used its CPU seconds (died of SIGXCPU).
* ``memory``: an allocation failed under the address-space limit (``MemoryError``, ``Cannot
  allocate memory``) and the program failed.
* ``output_limit``: stdout + stderr exceeded the cap; the output was truncated (and the sandbox
  killed if it was still running).
* ``fork_limit``: the program failed or was killed after the process / thread limit refused a
  new process or thread (a fork bomb).
* ``killed``: the program died of another signal (e.g. SIGKILL at the hard CPU limit,
  SIGSEGV in a C extension).
* ``sandbox_error``: the sandbox itself could not start (bwrap missing, no user namespaces,
  interpreter not found); the code did not run.
"""

BWRAP_INSTALL_HINT = (
    "the Python tool sandbox needs bubblewrap (the `bwrap` command): install it with "
    "`sudo apt-get install bubblewrap` (Debian/Ubuntu), `sudo dnf install bubblewrap` (Fedora) "
    "or `sudo pacman -S bubblewrap` (Arch)"
)
"""Why the sandbox is unavailable when ``bwrap`` is missing, and how to install it."""

MiB = 1 << 20
_NOBODY = 65534
_SANDBOX_DIR = "/tmp"  # the private tmpfs: working directory, HOME and TMPDIR
_FORK_RE = re.compile(
    r"BlockingIOError: \[Errno 11\]|can't start new thread|Resource temporarily unavailable"
)
_MEMORY_RE = re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc")

# Runs inside the sandbox as `python -I -B -u -c _RUNNER cpu mem nproc fsize nofile [paths...]`:
# reads the program from stdin, writes it to ./main.py (so tracebacks show its lines), sets the
# limits, then executes it as __main__ and prints a traceback without the runner's frame.
_RUNNER = r"""
import builtins, os, resource as R, sys, types
cpu, mem, nproc, fsize, nofile = (int(a) for a in sys.argv[1:6])
extra = sys.argv[6:]
src = sys.stdin.buffer.read()
fd = os.open(os.devnull, os.O_RDONLY)
os.dup2(fd, 0)
os.close(fd)
path = os.path.join(os.getcwd(), "main.py")
with open(path, "wb") as f:
    f.write(src)
for lim, soft, hard in ((R.RLIMIT_CPU, cpu, cpu + 1), (R.RLIMIT_AS, mem, mem),
                        (R.RLIMIT_NPROC, nproc, nproc), (R.RLIMIT_FSIZE, fsize, fsize),
                        (R.RLIMIT_NOFILE, nofile, nofile), (R.RLIMIT_CORE, 0, 0)):
    R.setrlimit(lim, (soft, hard))
sys.argv = [path]
sys.path[:0] = [os.getcwd()]
sys.path.extend(extra)
main = types.ModuleType("__main__")
main.__file__ = path
main.__builtins__ = builtins
sys.modules["__main__"] = main
try:
    code = compile(src, path, "exec")
except (SyntaxError, ValueError) as e:
    import traceback
    traceback.print_exception(type(e), e, None)
    sys.exit(1)
try:
    exec(code, main.__dict__)
except SystemExit:
    raise
except BaseException as e:
    if isinstance(e, MemoryError):
        main.__dict__.clear()
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
"""


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and layout of the Python sandbox.

    Attributes:
        cpu_s: CPU seconds per process (``RLIMIT_CPU``; SIGXCPU at ``cpu_s``, SIGKILL at
            ``cpu_s + 1``). Default 5.
        wall_s: Wall-clock seconds per call, sandbox start included, enforced from outside.
            Default 10.
        memory_bytes: Address space per process in bytes (``RLIMIT_AS``; the interpreter itself
            takes ~25 MiB of it). Default 512 MiB.
        max_processes: Processes plus threads the sandbox may hold at once (``RLIMIT_NPROC``
            counted in the sandbox's own user namespace; bwrap's init and the interpreter count
            as two). Default 64.
        max_file_bytes: Largest file the program may write, in bytes (``RLIMIT_FSIZE``; a write
            beyond it fails with ``OSError: [Errno 27] File too large``). Default 1 MiB.
        max_output_bytes: stdout + stderr bytes read from the program; more is cut off, the
            sandbox is killed and the incident is ``"output_limit"``. Default 64 KiB.
        max_open_files: Open file descriptors per process (``RLIMIT_NOFILE``). Default 64.
        tmp_bytes: Size of the private ``/tmp`` tmpfs (the working directory), in bytes. Its
            pages are host RAM: keep it small. Default 32 MiB.
        max_code_bytes: Longest program accepted, in UTF-8 bytes (longer ones are refused
            without starting a sandbox). Default 256 KiB.
        python: Interpreter to run inside the sandbox. None picks ``/usr/bin/python3`` when it
            exists, else the base interpreter running conveyor (its installation directory is
            then bound read-only at the same path). The interpreter must be readable by
            :attr:`host_uid` when conveyor runs as root (a pyenv under ``/root`` is not).
        site_packages: Extra directories bound read-only at the same path and appended to
            ``sys.path`` (e.g. a virtual environment's ``site-packages`` for sympy / numpy; they
            must match the interpreter's Python version). Default none: the standard library
            and the interpreter's own site-packages only.
        host_uid: Host uid and gid bwrap runs as when conveyor runs as root (default 65534,
            "nobody"); ignored otherwise. Must not be 0 (see the module docstring).
        bwrap: The bubblewrap executable (a name looked up on ``PATH``, or a path).

    Raises:
        ValueError: If a limit is not a positive number, ``host_uid`` is 0 or negative, or
            ``max_output_bytes`` is below 1 KiB.
    """

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_bytes: int = 512 * MiB
    max_processes: int = 64
    max_file_bytes: int = 1 * MiB
    max_output_bytes: int = 64 * 1024
    max_open_files: int = 64
    tmp_bytes: int = 32 * MiB
    max_code_bytes: int = 256 * 1024
    python: str | None = None
    site_packages: tuple[str, ...] = ()
    host_uid: int = _NOBODY
    bwrap: str = "bwrap"

    def __post_init__(self) -> None:
        _check_int("cpu_s", self.cpu_s, 1)
        if (
            isinstance(self.wall_s, bool)
            or not isinstance(self.wall_s, int | float)
            or not self.wall_s > 0
        ):
            raise ValueError(f"wall_s must be a number > 0, got {self.wall_s!r}")
        _check_int("memory_bytes", self.memory_bytes, 32 * MiB)
        _check_int("max_processes", self.max_processes, 3)
        _check_int("max_file_bytes", self.max_file_bytes, 1)
        _check_int("max_output_bytes", self.max_output_bytes, 1024)
        _check_int("max_open_files", self.max_open_files, 8)
        _check_int("tmp_bytes", self.tmp_bytes, MiB)
        _check_int("max_code_bytes", self.max_code_bytes, 1)
        _check_int("host_uid", self.host_uid, 1)
        object.__setattr__(self, "site_packages", tuple(str(p) for p in self.site_packages))


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one sandboxed run.

    Attributes:
        stdout: What the program printed on stdout (UTF-8, undecodable bytes replaced; within the
            output cap).
        stderr: Its stderr (tracebacks), likewise.
        exit_code: bwrap's exit status: the program's exit code, or 128 + N when it died of
            signal N (so 137 is SIGKILL, 152 SIGXCPU; a program calling ``sys.exit(137)`` looks
            the same). None when the sandbox was killed from outside (timeout, output limit) or
            did not start.
        incident: The contained incident (:data:`INCIDENT_KINDS`), or None.
        truncated: True when output beyond :attr:`SandboxConfig.max_output_bytes` was dropped.
        elapsed_s: Wall-clock seconds from starting bwrap to having all of its output.
        observation: The text for the model: stdout, then stderr, then ``"[output truncated
            ...]"`` and an ``"Error: ..."`` line for an incident or a silent failure;
            ``"(no output)"`` when a successful program printed nothing.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    incident: IncidentKind | None
    truncated: bool
    elapsed_s: float
    observation: str

    @property
    def ok(self) -> bool:
        """True when the program exited with status 0 and no incident occurred."""
        return self.incident is None and self.exit_code == 0


def bwrap_path(config: SandboxConfig | None = None) -> str | None:
    """The bubblewrap executable the sandbox would use, or None when it is not installed.

    Args:
        config: Its :attr:`SandboxConfig.bwrap` is looked up (default ``"bwrap"`` on ``PATH``).

    Returns:
        An absolute path, or None.
    """
    return shutil.which((config or SandboxConfig()).bwrap)


def resolve_python(config: SandboxConfig | None = None) -> tuple[str, str | None]:
    """The interpreter the sandbox runs and the directory to bind for it.

    Args:
        config: Its :attr:`SandboxConfig.python` (None: ``/usr/bin/python3`` if present, else the
            base interpreter of this process).

    Returns:
        ``(interpreter path, installation directory to bind read-only or None)``; the
        directory is None when the interpreter's real path is under ``/usr`` (bound anyway),
        else the interpreter's ``prefix`` (two levels above its real path, e.g.
        ``~/.pyenv/versions/3.11.7``).
    """
    cfg = config or SandboxConfig()
    if cfg.python is not None:
        exe = cfg.python
    elif os.path.exists("/usr/bin/python3"):
        exe = "/usr/bin/python3"
    else:
        exe = getattr(sys, "_base_executable", None) or sys.executable
    real = Path(os.path.realpath(exe))
    if real.is_relative_to("/usr"):
        return exe, None
    return str(real), str(real.parent.parent)


def _running_as_root() -> bool:
    return os.geteuid() == 0


def build_command(config: SandboxConfig, status_fd: int) -> list[str]:
    """The bwrap command line for one run (see the module docstring for each part).

    Args:
        config: The sandbox configuration.
        status_fd: File descriptor bwrap writes its JSON status to (``--json-status-fd``).

    Returns:
        The argument list; the program is fed on stdin.

    Raises:
        FileNotFoundError: If bwrap is not installed (the message is :data:`BWRAP_INSTALL_HINT`).
    """
    bwrap = bwrap_path(config)
    if bwrap is None:
        raise FileNotFoundError(BWRAP_INSTALL_HINT)
    python, prefix = resolve_python(config)
    args = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--uid", str(_NOBODY),
        "--gid", str(_NOBODY),
        "--hostname", "sandbox",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--ro-bind", "/usr", "/usr",
    ]  # fmt: skip
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in ("/etc/ld.so.cache", "/etc/localtime"):
        args += ["--ro-bind-try", path, path]
    args += ["--proc", "/proc", "--dev", "/dev"]
    # private tmpfs, size-capped: the working directory, and /dev/shm (POSIX semaphores);
    # bwrap's /dev is a tmpfs too: read-only after that, like the root
    for path in (_SANDBOX_DIR, "/dev/shm"):
        args += ["--perms", "1777", "--size", str(config.tmp_bytes), "--tmpfs", path]
    args += ["--remount-ro", "/dev"]
    if prefix is not None:
        args += ["--ro-bind", prefix, prefix]
    for path in config.site_packages:
        args += ["--ro-bind", path, path]
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": _SANDBOX_DIR,
        "TMPDIR": _SANDBOX_DIR,
        "LANG": "C.UTF-8",
        "USER": "sandbox",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
    }
    for key, value in env.items():
        args += ["--setenv", key, value]
    # the root tmpfs bwrap builds the tree on becomes read-only: only /tmp stays writable
    args += ["--remount-ro", "/", "--chdir", _SANDBOX_DIR, "--json-status-fd", str(status_fd)]
    args += [python, "-I", "-B", "-u", "-c", _RUNNER]
    limits = (
        config.cpu_s,
        config.memory_bytes,
        config.max_processes,
        config.max_file_bytes,
        config.max_open_files,
    )
    args += [str(v) for v in limits] + list(config.site_packages)
    return args


def _parse_status(raw: bytes) -> dict[str, Any]:
    """Merge bwrap's JSON status documents (one per line: child-pid and namespaces, then
    exit-code)."""
    merged: dict[str, Any] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict):
                merged.update(doc)
    return merged


def _read_available(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except (BlockingIOError, OSError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _count_pidns_processes(pid_namespace: int | None) -> int:
    """Host processes in the PID namespace with this inode (best effort: 0 when unknown or
    unreadable)."""
    if not pid_namespace:
        return 0
    target = f"pid:[{pid_namespace}]"
    count = 0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    for entry in entries:
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/ns/pid") == target:
                    count += 1
    return count


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _format_bytes(n: int) -> str:
    if n % MiB == 0:
        return f"{n // MiB} MB"
    if n % 1024 == 0:
        return f"{n // 1024} KB"
    return f"{n} bytes"


def classify(
    *,
    started: bool,
    exit_code: int | None,
    stderr: str,
    killed_for: Literal["timeout", "output"] | None,
    truncated: bool,
    processes_at_kill: int,
    max_processes: int,
) -> IncidentKind | None:
    """The incident kind of a finished run (first match wins).

    1. ``sandbox_error``: bwrap did not start the program, or could not exec the interpreter.
    2. ``fork_limit``: the program failed or was killed, and its stderr shows a refused fork or
       thread, or it held ``max_processes - 1`` or more processes when it was killed.
    3. ``output_limit``: output was truncated.
    4. ``memory``: the program failed and its stderr shows a failed allocation.
    5. ``cpu_limit``: it died of SIGXCPU.
    6. ``timeout``: it was killed for the wall-time limit.
    7. ``killed``: it died of another signal.

    A program that catches a ``MemoryError`` or a refused fork and exits 0 has no incident.

    Args:
        started: Whether bwrap reported starting the program (its ``child-pid`` status).
        exit_code: As :attr:`SandboxResult.exit_code`.
        stderr: The captured stderr.
        killed_for: Why this side killed the sandbox, or None when it ended by itself.
        truncated: Whether output was cut off.
        processes_at_kill: Processes found in the sandbox's PID namespace when it was killed
            (0 when not killed or not counted).
        max_processes: The configured process limit.

    Returns:
        The incident kind, or None.
    """
    if not started or (exit_code == 1 and stderr.startswith("bwrap: ")):
        return "sandbox_error"
    failed = killed_for is not None or exit_code != 0
    if failed and (_FORK_RE.search(stderr) or processes_at_kill >= max_processes - 1):
        return "fork_limit"
    if truncated or killed_for == "output":
        return "output_limit"
    if failed and _MEMORY_RE.search(stderr[-4096:]):
        return "memory"
    if exit_code == 128 + signal.SIGXCPU:
        return "cpu_limit"
    if killed_for == "timeout":
        return "timeout"
    if exit_code is not None and 128 < exit_code < 128 + 65:
        return "killed"
    return None


def _observation(
    config: SandboxConfig,
    stdout: str,
    stderr: str,
    exit_code: int | None,
    incident: IncidentKind | None,
    truncated: bool,
    killed_for: str | None,
) -> str:
    text = stdout
    if stderr:
        if text and not text.endswith("\n"):
            text += "\n"
        text += stderr
    lines = [text.rstrip("\n")] if text.strip() else []
    if truncated:
        lines.append(f"[output truncated at {_format_bytes(config.max_output_bytes)}]")
    killed = "; the program was killed" if killed_for is not None else ""
    if incident == "sandbox_error":
        detail = " ".join(stderr.split())[:300] or f"exit status {exit_code}"
        lines = [f"Error: the Python sandbox could not run the code ({detail})."]
    elif incident == "timeout":
        lines.append(f"Error: time limit {config.wall_s:g} s exceeded; the program was killed.")
    elif incident == "cpu_limit":
        lines.append(f"Error: CPU time limit {config.cpu_s} s exceeded; the program was killed.")
    elif incident == "memory":
        lines.append(f"Error: memory limit {_format_bytes(config.memory_bytes)} exceeded{killed}.")
    elif incident == "output_limit":
        lines.append(
            f"Error: output limit {_format_bytes(config.max_output_bytes)} exceeded; output "
            f"truncated{killed}."
        )
    elif incident == "fork_limit":
        lines.append(
            f"Error: process limit ({config.max_processes} processes and threads) reached{killed}."
        )
    elif incident == "killed":
        assert exit_code is not None
        lines.append(f"Error: the program was killed by {_signal_name(exit_code - 128)}.")
    elif exit_code not in (0, None) and not stderr.strip():
        lines.append(f"Error: the program exited with status {exit_code}.")
    return "\n".join(lines) if lines else "(no output)"


def _result(
    config: SandboxConfig,
    *,
    stdout: bytes = b"",
    stderr: bytes = b"",
    exit_code: int | None,
    incident: IncidentKind | None,
    truncated: bool = False,
    killed_for: str | None = None,
    elapsed_s: float = 0.0,
    observation: str | None = None,
) -> SandboxResult:
    out = stdout.decode("utf-8", "replace")
    err = stderr.decode("utf-8", "replace")
    if observation is None:
        observation = _observation(config, out, err, exit_code, incident, truncated, killed_for)
    return SandboxResult(
        stdout=out,
        stderr=err,
        exit_code=exit_code,
        incident=incident,
        truncated=truncated,
        elapsed_s=elapsed_s,
        observation=observation,
    )


async def run_python(code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """Run a Python program in a fresh sandbox (module docstring) and collect its output.

    Calls may overlap (each has its own sandbox); cancelling the awaiting task kills the
    sandbox.

    Args:
        code: The program's source (run as ``__main__`` from ``/tmp/main.py`` in the sandbox).
        config: Limits and layout (default :class:`SandboxConfig`).

    Returns:
        A :class:`SandboxResult`. Every failure of the code or of the sandbox is reported there
        (``incident="sandbox_error"`` when bwrap is missing or cannot start); this function does
        not raise for them.

    Raises:
        TypeError: If ``code`` is not a ``str``.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    cfg = config or SandboxConfig()
    source = code.encode("utf-8", "replace")
    if len(source) > cfg.max_code_bytes:
        return _result(
            cfg,
            exit_code=None,
            incident=None,
            observation=f"Error: the program is too long ({len(source)} bytes; at most "
            f"{cfg.max_code_bytes}).",
        )
    t0 = time.monotonic()
    status_r, status_w = os.pipe()
    os.set_blocking(status_r, False)
    try:
        try:
            args = build_command(cfg, status_w)
        except FileNotFoundError as exc:
            return _result(cfg, exit_code=None, incident="sandbox_error", stderr=str(exc).encode())
        user_kwargs: dict[str, Any] = {}
        if _running_as_root():
            user_kwargs = {"user": cfg.host_uid, "group": cfg.host_uid, "extra_groups": []}
        try:
            proc = await asyncio.create_subprocess_exec(
                *args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(status_w,),
                start_new_session=True,
                cwd="/",
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                **user_kwargs,
            )
        except OSError as exc:
            message = f"cannot start bwrap: {exc}".encode()
            return _result(cfg, exit_code=None, incident="sandbox_error", stderr=message)
        finally:
            os.close(status_w)
            status_w = -1
        return await _supervise(proc, source, cfg, status_r, t0)
    finally:
        if status_w >= 0:
            os.close(status_w)
        os.close(status_r)


async def _supervise(
    proc: asyncio.subprocess.Process, source: bytes, cfg: SandboxConfig, status_r: int, t0: float
) -> SandboxResult:
    out, err = bytearray(), bytearray()
    over = asyncio.Event()
    status_raw = bytearray()

    async def feed() -> None:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(source)
            await proc.stdin.drain()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.close()

    async def pump(stream: asyncio.StreamReader, buf: bytearray) -> None:
        # reads to EOF even past the cap (discarding): a stream left unread stops its transport
        # from seeing EOF, and asyncio's Process.wait() then never returns
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                return
            room = cfg.max_output_bytes - len(out) - len(err)
            if room > 0:
                buf += chunk[:room]
            if len(chunk) > room:
                over.set()

    assert proc.stdout is not None and proc.stderr is not None
    tasks = [
        asyncio.ensure_future(feed()),
        asyncio.ensure_future(pump(proc.stdout, out)),
        asyncio.ensure_future(pump(proc.stderr, err)),
    ]
    waiter = asyncio.ensure_future(proc.wait())
    over_waiter = asyncio.ensure_future(over.wait())
    killed_for: Literal["timeout", "output"] | None = None
    processes_at_kill = 0
    try:
        remaining = cfg.wall_s - (time.monotonic() - t0)
        await asyncio.wait(
            {waiter, over_waiter}, timeout=max(remaining, 0), return_when=asyncio.FIRST_COMPLETED
        )
        if not waiter.done():
            killed_for = "output" if over.is_set() else "timeout"
            status_raw += _read_available(status_r)
            ns = _parse_status(bytes(status_raw)).get("pid-namespace")
            processes_at_kill = _count_pidns_processes(ns)
            _kill_group(proc.pid)
        await waiter
        # the sandbox is gone (its init died with bwrap): the pipes reach EOF promptly
        await asyncio.wait(tasks[1:], timeout=5.0)
    finally:
        if proc.returncode is None:
            _kill_group(proc.pid)
        for task in (*tasks, over_waiter):
            task.cancel()
        if not waiter.done():
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(waiter), 5.0)
            waiter.cancel()
    status_raw += _read_available(status_r)
    status = _parse_status(bytes(status_raw))
    started = "child-pid" in status
    exit_code: int | None = None
    if killed_for is None:
        exit_code = status.get("exit-code") if started else None
        if exit_code is None:  # bwrap itself failed, or was killed by someone else
            rc = proc.returncode
            exit_code = 128 - rc if rc is not None and rc < 0 else rc
    truncated = over.is_set()
    stderr_text = err.decode("utf-8", "replace")
    incident = classify(
        started=started,
        exit_code=exit_code,
        stderr=stderr_text,
        killed_for=killed_for,
        truncated=truncated,
        processes_at_kill=processes_at_kill,
        max_processes=cfg.max_processes,
    )
    return _result(
        cfg,
        stdout=bytes(out),
        stderr=bytes(err),
        exit_code=exit_code,
        incident=incident,
        truncated=truncated,
        killed_for=killed_for,
        elapsed_s=time.monotonic() - t0,
    )


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run code on this host (bwrap missing, no user namespaces, ...)."""


async def check_sandbox(config: SandboxConfig | None = None) -> float:
    """Run ``print(1)`` in the sandbox to prove it works here.

    Args:
        config: The configuration to check.

    Returns:
        The run's wall-clock seconds.

    Raises:
        SandboxUnavailable: If bwrap is missing (message: :data:`BWRAP_INSTALL_HINT`) or the run
            did not print ``1`` (message: the run's observation, e.g. bwrap's complaint about
            user namespaces).
    """
    cfg = config or SandboxConfig()
    if bwrap_path(cfg) is None:
        raise SandboxUnavailable(BWRAP_INSTALL_HINT)
    result = await run_python("print(1)", cfg)
    if not result.ok or result.stdout.strip() != "1":
        raise SandboxUnavailable(f"the Python sandbox does not work here: {result.observation}")
    return result.elapsed_s


class PythonTool:
    """The ``python`` tool: runs the model's code in the sandbox (:func:`run_python`).

    Each call is a fresh sandbox: nothing (variables, files) survives between calls, so the
    model must print what it needs and repeat definitions. Calls overlap up to
    ``max_concurrency``; waiting for a slot does not count against the wall-time limit.

    Args:
        config: Sandbox limits and layout (default :class:`SandboxConfig`).
        max_concurrency: Sandboxes running at once (>= 1); None means ``os.cpu_count()``.
        name: The tool name (default ``"python"``).

    Attributes:
        calls: Calls made (including rejected arguments).
        failures: Calls that did not return ``ok`` (bad arguments, code that raised or exited
            non-zero, incidents).
        incidents: Count of each contained incident kind, every kind of
            :data:`INCIDENT_KINDS` present (0 until it happens), for the run's metrics.

    Raises:
        ValueError: If ``max_concurrency`` is not an int >= 1.
    """

    def __init__(
        self,
        config: SandboxConfig | None = None,
        *,
        max_concurrency: int | None = None,
        name: str = "python",
    ):
        if max_concurrency is None:
            max_concurrency = os.cpu_count() or 1
        _check_int("max_concurrency", max_concurrency, 1)
        self.config = config or SandboxConfig()
        self.name = name
        self.max_concurrency = max_concurrency
        cfg = self.config
        libraries = "the standard library" + (
            " and installed packages" if cfg.site_packages else ""
        )
        self.description = (
            "Run a Python 3 program and return what it prints (stdout, then stderr). Each call "
            "starts fresh: no variables or files are kept, so print() every value you need. "
            f"Has {libraries}; no network; limits: {cfg.wall_s:g} s, "
            f"{_format_bytes(cfg.memory_bytes)} memory, {_format_bytes(cfg.max_output_bytes)} output."
        )
        self.parameters: dict[str, Any] = {
            "type": "object",
            "properties": {
                "code": {
                    "type": "string",
                    "description": "The complete Python program to run.",
                }
            },
            "required": ["code"],
            "additionalProperties": False,
        }
        self.calls = 0
        self.failures = 0
        self.incidents: dict[str, int] = dict.fromkeys(INCIDENT_KINDS, 0)
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(self.max_concurrency))
        return self._slots[1]

    async def run(self, code: str) -> SandboxResult:
        """Run ``code`` in the sandbox under this tool's concurrency limit and count the
        outcome.

        Args:
            code: The program.

        Returns:
            The :class:`SandboxResult`.

        Raises:
            TypeError: If ``code`` is not a ``str``.
        """
        async with self._semaphore():
            result = await run_python(code, self.config)
        self.calls += 1
        if not result.ok:
            self.failures += 1
        if result.incident is not None:
            self.incidents[result.incident] += 1
        return result

    async def call(self, arguments: Mapping[str, Any]) -> ToolResult:
        """Run ``arguments["code"]``; the :class:`~conveyor.envs.tools.Tool` entry point.

        Args:
            arguments: ``{"code": str}``.

        Returns:
            A :class:`~conveyor.envs.tools.ToolResult` with the run's observation, ``ok`` and
            incident; invalid arguments give ``ok=False`` and an ``"Error: ..."`` observation.
        """
        problem = check_arguments(self.parameters, arguments)
        if problem is not None:
            self.calls += 1
            self.failures += 1
            return ToolResult(f"Error: {problem}", ok=False)
        result = await self.run(arguments["code"])
        return ToolResult(result.observation, result.ok, result.incident, result.elapsed_s)

    def metrics(self) -> dict[str, float]:
        """Counters as flat metric names: ``calls``, ``failures`` and ``incident/<kind>``."""
        out: dict[str, float] = {"calls": float(self.calls), "failures": float(self.failures)}
        out.update({f"incident/{k}": float(v) for k, v in self.incidents.items()})
        return out
