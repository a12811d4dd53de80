"""Summarise a py-spy ``--native --format raw`` profile of a training run's engine thread
(``scripts/engine_native_profile.sh``; docs/results/main_job.md section 11): samples per engine
phase (decode, cache-miss prefill, prefix-hit prefill, joins, merges), and within each phase the
innermost native frames and the innermost Python frames.

Usage: python scripts/summarise_native_profile.py /tmp/prof/native.txt [--top 12]
"""
from __future__ import annotations

import argparse
import collections

PHASES = ("_join_from_prefix", "_prefill_from_prefix", "_prefill_chunk", "_decode", "_sample_and_record", "_merge",
          "_select", "_cache_finished", "_reap", "_cached_rows")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    phases: collections.Counter[str] = collections.Counter()
    native: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    python: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in open(args.path):
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")  # root first; a frame is "name (file:line)" or "name (library)"
        if not any("_loop (conveyor/rollout/engine/local.py" in f for f in frames):
            continue  # not the engine's decode thread
        phase = "other"
        for f in frames:
            name = f.split(" (")[0].rsplit(".", 1)[-1]
            if name in PHASES:
                phase = name
        phases[phase] += int(n)
        native[phase][frames[-1].split(" (")[0][:80]] += int(n)
        py = [f for f in frames if ".py:" in f]
        python[phase][py[-1][:110] if py else "-"] += int(n)
    total = sum(phases.values())
    print(f"engine thread: {total} samples")
    for phase, n in phases.most_common():
        print(f"{n:6d} {100 * n / max(1, total):5.1f}%  {phase}")
    for phase, _ in phases.most_common(3):
        print(f"\n== {phase}: innermost native frames")
        for s, n in native[phase].most_common(args.top):
            print(f"{n:6d} {s}")
        print(f"== {phase}: innermost Python frames")
        for s, n in python[phase].most_common(args.top):
            print(f"{n:6d} {s}")


if __name__ == "__main__":
    main()
