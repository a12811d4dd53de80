"""Start cost of the Python tool sandbox (issue 14, section 2): wall-clock milliseconds per call.

Usage: python benchmarks/sandbox.py [--n 50] [--concurrency 4] [--output FILE.json]

Measures, one after another (``--n`` calls each, after 3 warm-up calls):

* ``sandbox``: :func:`conveyor.envs.sandbox.run_python` on ``print(1)`` with the default
  configuration: bwrap start, namespaces, mounts, the interpreter's start, the runner's limits,
  reading the output; what a tool call costs beyond the code itself.
* ``bare``: the same interpreter started directly, ``python -I -c "print(1)"`` (asyncio
  subprocess, no sandbox): the floor that any fresh-process design pays.
* ``concurrent``: ``--n`` sandboxed calls with ``--concurrency`` in flight at once (the
  :class:`~conveyor.envs.sandbox.PythonTool` default is one per core): calls per second.

Prints one JSON line: per-call median / p90 / max milliseconds of ``sandbox`` and ``bare``, the
sandbox overhead (median difference) and the concurrent throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

from conveyor.envs.sandbox import PythonTool, SandboxConfig, resolve_python, run_python


def _summary(ms: list[float]) -> dict[str, float]:
    xs = sorted(ms)

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, max(0, math.ceil(p * len(xs)) - 1))]

    return {
        "median_ms": round(statistics.median(xs), 1),
        "p90_ms": round(q(0.90), 1),
        "max_ms": round(xs[-1], 1),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


async def _sandbox_once(cfg: SandboxConfig) -> float:
    t0 = time.perf_counter()
    result = await run_python("print(1)", cfg)
    elapsed = (time.perf_counter() - t0) * 1e3
    if not result.ok or result.stdout.strip() != "1":
        raise SystemExit(f"sandbox call failed: {result.observation}")
    return elapsed


async def _bare_once(python: str) -> float:
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        python, "-I", "-c", "print(1)", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    elapsed = (time.perf_counter() - t0) * 1e3
    if out.strip() != b"1":
        raise SystemExit("bare interpreter call failed")
    return elapsed


async def _main(args: argparse.Namespace) -> dict:
    cfg = SandboxConfig()
    python, _ = resolve_python(cfg)
    for _ in range(3):
        await _sandbox_once(cfg)
        await _bare_once(python)
    sandbox = [await _sandbox_once(cfg) for _ in range(args.n)]
    bare = [await _bare_once(python) for _ in range(args.n)]
    tool = PythonTool(cfg, max_concurrency=args.concurrency)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(tool.call({"code": "print(1)"}) for _ in range(args.n)))
    wall = time.perf_counter() - t0
    if not all(r.ok for r in results):
        raise SystemExit("a concurrent call failed")
    s, b = _summary(sandbox), _summary(bare)
    return {
        "benchmark": "sandbox_start",
        "n": args.n,
        "python": python,
        "python_version": subprocess.run(
            [python, "-I", "-c", "import platform; print(platform.python_version())"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip(),
        "machine": f"{_cpu_model()}, {platform.machine()}, Linux {platform.release()}",
        "cpus": os.cpu_count(),
        "sandbox": s,
        "bare": b,
        "overhead_median_ms": round(s["median_ms"] - b["median_ms"], 1),
        "concurrent": {
            "concurrency": args.concurrency,
            "calls_per_s": round(args.n / wall, 1),
            "wall_s": round(wall, 2),
        },
    }


def main() -> None:
    """Parse arguments, run the three measurements and print (and optionally write) the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50, help="calls per measurement")
    parser.add_argument("--concurrency", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args()
    out = asyncio.run(_main(args))
    line = json.dumps(out)
    print(line)
    if args.output:
        with open(args.output, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
