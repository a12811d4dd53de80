"""One table row per run of the controller comparison (issue 13 section 6, docs/results/asyppo.md,
"The controller on vs off"): held-out pass@1 at every evaluation, the training loop's seconds
without the periodic evaluations, updates at each eta, eta changes, trajectories dropped as stale,
mean staleness, and the update at which the 10-update mean training reward first reaches a mark.

    python scripts/controller_table.py docs/results/runs/controller/asyppo_*_s0 [--mark 0.15] [--window 10]

Reads each run directory's summary.json, metrics.jsonl and events.jsonl (a finished run: the
script names a missing file and stops).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from conveyor.runlog import read_jsonl, read_metrics


def row(run: Path, mark: float, window: int) -> dict:
    """The table's columns for one finished run directory (see the module docstring).

    Raises:
        FileNotFoundError: a run file is missing (named in the message).
    """
    for name in ("summary.json", "metrics.jsonl", "events.jsonl"):
        if not (run / name).is_file():
            raise FileNotFoundError(f"{run / name}: missing (not a finished run directory?)")
    summary = json.loads((run / "summary.json").read_text())
    metrics = read_metrics(run / "metrics.jsonl")  # one row per step (a resumed run's repeats resolved)
    events = read_jsonl(run / "events.jsonl")
    evals = [e for e in events if e.get("event") == "eval"]
    periodic = sum(e.get("wall_seconds", 0.0) for e in evals if str(e.get("label", "")).startswith("step_"))
    etas = Counter(int(m["staleness/eta"]) for m in metrics if m.get("staleness/eta") == m.get("staleness/eta"))
    rewards = [m["reward/mean"] for m in metrics]
    reached = next((i + 1 for i in range(len(rewards))
                    if i + 1 >= window and sum(rewards[i + 1 - window : i + 1]) / window >= mark), None)
    last = metrics[-1]
    return {
        "run": run.name,
        "heldout": [round(e["pass_at_1"], 3) for e in evals],
        "training_s": round(summary["wall_seconds"] - periodic),
        "updates_at_eta": dict(sorted(etas.items())),
        "eta_changes": sum(1 for e in events if e.get("event") == "eta_change"),
        "dropped_stale": int(last.get("rollout/dropped_stale", 0)),
        "dropped_share": round(float(last.get("rollout/dropped_stale_share", 0.0)), 3),
        "mean_staleness": round(sum(m["staleness/mean"] for m in metrics) / len(metrics), 2),
        f"update_reward_{mark}": reached,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories")
    ap.add_argument("--mark", type=float, default=0.15, help="training-reward mark (10-update mean)")
    ap.add_argument("--window", type=int, default=10, help="updates in the trailing mean")
    args = ap.parse_args(argv)
    try:
        rows = [row(r, args.mark, args.window) for r in args.runs]
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
