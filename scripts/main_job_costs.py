"""Where a main-job run's trainer time went, per trained token (docs/results/main_job.md section 13):
the training loop, trained tokens, the trainer's seconds per 1,000 trained tokens, the KL
reference's seconds (``time/reference_s``) and the share of it scored before the update
(``reference/precomputed_frac``, weighted by tokens), the reference scorer's counters, busy
fractions (the trainer's, the engine's and the cores' ``busy/cpu``), generated tokens, the engine's mean decode step, stale drops, the seconds the trainer
ran with the idle engine's threads (``trainer.elastic_threads``: ``time/borrowed_threads_s``,
the engine's ``lends`` and ``reclaim_wait_seconds``; section 14) and the peak resident memory
(``/usr/bin/time -v`` in ``console.log``, when present).

    python scripts/main_job_costs.py docs/results/runs/main_job/amd_ref_*
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from conveyor.runlog import read_metrics


def costs(run: Path) -> str:
    """One line for a finished run directory (summary.json, metrics.jsonl, engine_stats.json).

    Raises:
        FileNotFoundError: a run file is missing (named in the message).
    """
    for name in ("summary.json", "metrics.jsonl", "engine_stats.json"):
        if not (run / name).is_file():
            raise FileNotFoundError(f"{run / name}: missing (not a finished run directory?)")
    s = json.loads((run / "summary.json").read_text())
    rows = read_metrics(run / "metrics.jsonl")  # one row per step (a resumed run's repeats resolved)
    e = json.loads((run / "engine_stats.json").read_text())
    train_s = sum(r["time/train_step_s"] for r in rows)
    ref_s = sum(r.get("time/reference_s", 0.0) for r in rows)
    tokens = sum(r["train/tokens"] for r in rows)
    pre = sum(r.get("reference/precomputed_frac", 0.0) * r["train/tokens"] for r in rows) / max(1.0, tokens)
    last = rows[-1]
    log = (run / "console.log").read_text() if (run / "console.log").is_file() else ""
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log)
    peak = f"{int(m.group(1)) / 1e6:.1f} GB" if m else "-"
    decode = (e["busy_seconds"] - e["prefill_seconds"]) / max(1, e["decode_steps"])
    borrowed = sum(r.get("time/borrowed_threads_s", 0.0) for r in rows)
    # the cores' busy share: summary.json's cpu_busy, else (a run from 221f6a7, one process) the last row's busy/cpu
    cpu = s.get("cpu_busy", last.get("busy/cpu"))
    cpu = "-" if cpu is None else f"{cpu:.2f}"
    return (f"{run.name}: loop {s['wall_seconds']:.0f} s | trained tokens {tokens:.0f} | trainer s per 1k tokens "
            f"{1000 * train_s / tokens:.2f} | reference {ref_s:.0f} s ({ref_s / len(rows):.2f} per update), precomputed "
            f"{pre:.2f} | scorer busy {last.get('reference/scorer_busy_s', 0.0):.0f} s "
            f"({last.get('reference/scored_trajectories', 0):.0f} scored, {last.get('reference/attached_trajectories', 0):.0f} "
            f"attached) | busy trainer {s['trainer_busy']:.2f} engine {s['engine_busy']:.2f} cpu {cpu} | generated "
            f"{e['generated_tokens']} | decode step {decode:.3f} s | dropped {last.get('rollout/dropped_stale', 0):.0f} | "
            f"borrowed {borrowed:.0f} s ({e.get('lends', 0)} lends, engine waited {e.get('reclaim_wait_seconds', 0.0):.1f} s) | "
            f"peak {peak}")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        for r in argv:
            print(costs(Path(r)))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
