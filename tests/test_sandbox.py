"""The Python tool sandbox (issue 14, section 2) against hostile code.

Each test fails if its containment is broken: the infinite loop returns within the limit, the
fork bomb hits the process limit and leaves no process behind, the memory bomb hits the memory
limit, nothing written reaches the host, host secrets cannot be read, no socket connects, 100 MB
of output is cut at the cap, killing the parent does not reach this process, and every incident
is counted. Every test also checks that no sandboxed process outlives it. About 20 s on 2 cores.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from conveyor.envs.sandbox import (
    BWRAP_INSTALL_HINT,
    INCIDENT_KINDS,
    PythonTool,
    SandboxConfig,
    SandboxUnavailable,
    bwrap_path,
    check_sandbox,
    classify,
    run_python,
)
from conveyor.envs.tools import ToolRegistry

pytestmark = pytest.mark.skipif(
    bwrap_path() is None,
    reason=f"skipped: {BWRAP_INSTALL_HINT} (see README, 'Python tool sandbox')",
)

FAST = SandboxConfig(cpu_s=2, wall_s=4.0)


def run(code: str, config: SandboxConfig = FAST):
    return asyncio.run(run_python(code, config))


def _own_pidns() -> str:
    return os.readlink("/proc/self/ns/pid")


def sandboxed_processes() -> int:
    """Live host processes in a PID namespace other than ours: the sandboxes' processes.

    Zombies are dead and left out: bwrap's init in the sandbox is reaped by the host's init
    (bwrap's outer process exits without waiting for it), which can take a second or two here.
    """
    own, count = _own_pidns(), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") != own:
                    with open(f"/proc/{entry}/stat") as f:
                        state = f.read().rpartition(")")[2].split()[0]
                    count += state not in ("Z", "X")
            except (OSError, IndexError):
                pass
    return count


@pytest.fixture(scope="module", autouse=True)
def sandbox_works():
    try:
        asyncio.run(check_sandbox())
    except SandboxUnavailable as exc:  # bwrap is installed but cannot sandbox: a real failure
        pytest.fail(str(exc))


@pytest.fixture(autouse=True)
def no_leftover_processes():
    before = sandboxed_processes()
    yield
    deadline = time.monotonic() + 3.0
    while sandboxed_processes() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandboxed_processes() <= before, "a sandboxed process outlived its call"


def test_normal_code_returns_its_value():
    r = run("import math\nprint(math.comb(10, 3) * 2)")
    assert r.ok and r.incident is None and r.exit_code == 0
    assert r.stdout == "240\n" and r.observation == "240"


def test_exception_gives_traceback_of_the_program_only():
    r = run("def f():\n    return 1 / 0\nf()")
    assert not r.ok and r.incident is None and r.exit_code == 1
    assert 'File "/tmp/main.py", line 2, in f' in r.observation
    assert "ZeroDivisionError: division by zero" in r.observation
    assert "<string>" not in r.observation  # the runner's frame is hidden


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    t0 = time.monotonic()
    r = run("while True:\n    pass")
    assert time.monotonic() - t0 < FAST.wall_s + 1.0
    assert r.incident == "cpu_limit" and "CPU time limit 2 s exceeded" in r.observation


def test_sleeping_forever_is_killed_at_the_wall_time_limit():
    # wall_s leaves a loaded machine time to start Python in the sandbox and print (at 1.5 s a busy
    # 2-core machine printed nothing first, issue 44 section 6); the bound on the elapsed time only
    # has to tell a kill from the 1,000 s sleep
    cfg = SandboxConfig(wall_s=6.0)
    t0 = time.monotonic()
    r = run("import time\nprint('started')\ntime.sleep(1000)", cfg)
    assert time.monotonic() - t0 < 120.0
    assert r.incident == "timeout" and r.exit_code is None
    assert r.observation.startswith("started\n")  # unbuffered: output before the kill survives
    assert "Error: time limit 6 s exceeded" in r.observation


def test_fork_bomb_hits_the_process_limit_and_leaves_nothing():
    before = sandboxed_processes()
    r = run("import os\nwhile True:\n    os.fork()", SandboxConfig(wall_s=5.0))
    assert r.incident == "fork_limit", r.observation[-300:]
    assert "process limit (64 processes and threads) reached" in r.observation
    deadline = time.monotonic() + 3.0
    while sandboxed_processes() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandboxed_processes() <= before


def test_silent_fork_bomb_is_counted_when_killed():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = run(code, SandboxConfig(wall_s=2.0))
    assert r.incident == "fork_limit" and "the program was killed" in r.observation


def test_memory_bomb_hits_the_memory_limit():
    r = run("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))")
    assert r.incident == "memory" and "memory limit 512 MB exceeded" in r.observation


def test_writes_outside_the_working_directory_do_not_reach_the_host(tmp_path):
    name = f"conveyor_sandbox_{uuid.uuid4().hex}"
    targets = [Path("/etc"), Path("/tmp"), Path("/work"), Path.cwd(), tmp_path, Path.home()]
    paths = [str(d / name) for d in targets] + ["/" + name, "/usr/" + name, "/dev/" + name]
    code = (
        f"paths = {paths!r}\n"
        "for p in paths:\n"
        "    try:\n"
        "        with open(p, 'w') as f:\n"
        "            f.write('pwned')\n"
        "        print('wrote', p)\n"
        "    except OSError as e:\n"
        "        print('refused', p, e.errno)\n"
        f"open({name!r}, 'w').write('inside')\n"  # the private working directory is writable
        f"print(open({name!r}).read())\n"
    )
    try:
        r = run(code)
        assert r.ok, r.observation
        assert r.stdout.rstrip().endswith("inside")
        leaked = [p for p in paths if os.path.exists(p)]
        assert leaked == []
        # written in the sandbox's own /tmp, which is gone; everything else refused
        assert sorted(
            line.split()[1] for line in r.stdout.splitlines() if line.startswith("wrote")
        ) == [f"/tmp/{name}"]
    finally:
        for p in paths:
            if os.path.exists(p) and name in p:
                os.unlink(p)


def test_host_secrets_cannot_be_read(tmp_path):
    token = uuid.uuid4().hex
    run_dir_secret = tmp_path / "run" / "secret.txt"
    run_dir_secret.parent.mkdir()
    run_dir_secret.write_text(token)
    home_secret = Path.home() / f".conveyor_sandbox_secret_{uuid.uuid4().hex}"
    home_secret.write_text(token)
    try:
        code = (
            f"import os\n"
            f"for p in [{str(run_dir_secret)!r}, {str(home_secret)!r}]:\n"
            "    try:\n"
            "        print('read', open(p).read())\n"
            "    except OSError as e:\n"
            "        print('no', p, e.errno)\n"
            "for d in ['/root', '/home', '/work', os.path.dirname("
            f"{str(run_dir_secret)!r})]:\n"
            "    print(d, os.path.exists(d))\n"
        )
        r = run(code)
        assert r.ok, r.observation
        assert token not in r.observation
        assert r.stdout.count("\nno ") + r.stdout.startswith("no ") == 2
        assert "True" not in r.stdout  # none of those directories exists inside
    finally:
        home_secret.unlink()


def test_no_socket_reaches_localhost_or_the_internet():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.settimeout(0.2)
    accepted: list[object] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, addr = server.accept()
            except (TimeoutError, OSError):
                continue
            accepted.append(addr)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    code = (
        "import socket\n"
        f"for host, port in [('127.0.0.1', {port}), ('8.8.8.8', 53), ('1.1.1.1', 443)]:\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=2).close()\n"
        "        print('CONNECTED', host)\n"
        "    except OSError as e:\n"
        "        print('failed', host, e.errno)\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "try:\n"
        "    s.sendto(b'x', ('8.8.8.8', 53))\n"
        "    print('SENT udp')\n"
        "except OSError as e:\n"
        "    print('failed udp', e.errno)\n"
    )
    try:
        r = run(code)
    finally:
        stop.set()
        thread.join(2.0)
        server.close()
    assert r.ok, r.observation
    assert "CONNECTED" not in r.stdout and "SENT" not in r.stdout
    assert r.stdout.count("failed") == 4
    assert accepted == []


def test_100_mb_of_output_is_capped():
    t0 = time.monotonic()
    r = run("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)")
    assert time.monotonic() - t0 < 3.0
    assert r.incident == "output_limit" and r.truncated
    assert len(r.stdout) + len(r.stderr) <= FAST.max_output_bytes
    assert "[output truncated at 64 KB]" in r.observation
    assert "output limit 64 KB exceeded; output truncated" in r.observation


def test_killing_its_parent_does_not_reach_the_caller():
    r = run("import os\nos.kill(os.getppid(), 9)\nprint('still here')")
    # this process survived to get here; getppid() is the sandbox's init, which ignores signals
    # sent from inside its PID namespace, so the program even goes on
    assert r.ok and r.stdout == "still here\n"
    r = run("import os\nos.killpg(0, 9)\nprint('not reached')")
    # its own process group (--new-session): the program dies, nothing else does
    assert r.incident == "killed" and "SIGKILL" in r.observation
    assert run("print(7)").stdout == "7\n"  # the next call works


def test_calls_overlap():
    tool = PythonTool(max_concurrency=2)

    async def two():
        return await asyncio.gather(
            *(tool.run("import time\ntime.sleep(1)\nprint(1)") for _ in range(2))
        )

    t0 = time.monotonic()
    results = asyncio.run(two())
    assert all(r.ok for r in results)
    assert time.monotonic() - t0 < 1.9  # two 1 s sleeps ran at the same time


def test_incidents_are_counted_per_kind():
    tool = PythonTool(SandboxConfig(cpu_s=1, wall_s=3.0))
    broken = PythonTool(SandboxConfig(bwrap="/nonexistent/bwrap"))
    registry = ToolRegistry([tool])
    codes = {
        "ok": "print(1)",
        "cpu_limit": "while True:\n    pass",
        "memory": "x = bytearray(10**10)",
        "output_limit": "print('x' * 10**6)",
        "fork_limit": "import os\nwhile True:\n    os.fork()",
        "killed": "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)",
    }

    async def go():
        out = {k: await registry.call("python", {"code": c}) for k, c in codes.items()}
        out["timeout"] = await PythonTool(SandboxConfig(wall_s=1.0)).call(
            {"code": "import time\ntime.sleep(60)"}
        )
        out["sandbox_error"] = await broken.call({"code": "print(1)"})
        out["bad_args"] = await registry.call("python", '{"source": "print(1)"}')
        return out

    out = asyncio.run(go())
    assert out["ok"].ok and out["ok"].observation == "1" and out["ok"].incident is None
    for kind in ("cpu_limit", "memory", "output_limit", "fork_limit", "killed", "timeout"):
        assert out[kind].incident == kind and not out[kind].ok, (kind, out[kind].observation[-200:])
    assert out["sandbox_error"].incident == "sandbox_error"
    assert "bubblewrap" in out["sandbox_error"].observation
    assert not out["bad_args"].ok and "missing argument(s): 'code'" in out["bad_args"].observation
    expected = dict.fromkeys(INCIDENT_KINDS, 0)
    expected.update({"cpu_limit": 1, "memory": 1, "output_limit": 1, "fork_limit": 1, "killed": 1})
    assert tool.incidents == expected
    assert tool.calls == 6 and tool.failures == 5  # the registry refused the bad arguments
    assert broken.incidents["sandbox_error"] == 1
    assert tool.metrics()["incident/memory"] == 1.0


def test_classify_precedence():
    base = dict(
        started=True,
        stderr="",
        killed_for=None,
        truncated=False,
        processes_at_kill=0,
        max_processes=64,
    )
    assert classify(**{**base, "exit_code": 0}) is None
    assert classify(**{**base, "exit_code": 0, "stderr": "MemoryError"}) is None  # caught
    assert classify(**{**base, "exit_code": 1, "stderr": "MemoryError\n"}) == "memory"
    assert classify(**{**base, "exit_code": 152}) == "cpu_limit"
    assert classify(**{**base, "exit_code": None, "killed_for": "timeout"}) == "timeout"
    assert (
        classify(**{**base, "exit_code": None, "killed_for": "timeout", "processes_at_kill": 64})
        == "fork_limit"
    )
    assert (
        classify(**{**base, "exit_code": None, "killed_for": "output", "truncated": True})
        == "output_limit"
    )
    assert classify(**{**base, "started": False, "exit_code": 1}) == "sandbox_error"


def test_config_is_validated():
    with pytest.raises(ValueError, match="host_uid"):
        SandboxConfig(host_uid=0)
    with pytest.raises(ValueError, match="wall_s"):
        SandboxConfig(wall_s=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        PythonTool(max_concurrency=0)


def test_site_packages_are_opt_in():
    import sysconfig

    code = "import sympy\nprint(sympy.Rational(1, 3) + sympy.Rational(1, 6))"
    assert "No module named 'sympy'" in run(code).observation
    pytest.importorskip("sympy")
    r = run(code, SandboxConfig(site_packages=(sysconfig.get_paths()["purelib"],)))
    assert r.ok and r.stdout == "1/2\n", r.observation


def test_cancelling_a_call_kills_its_sandbox():
    async def go():
        task = asyncio.ensure_future(run_python("import time\ntime.sleep(60)", FAST))
        await asyncio.sleep(0.5)
        assert sandboxed_processes() >= 1  # it is running
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    t0 = time.monotonic()
    asyncio.run(go())
    assert time.monotonic() - t0 < 2.0  # the autouse fixture then checks nothing is left
