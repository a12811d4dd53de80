"""Plot several runs side by side: reward, wall-clock, trainer-busy fraction, staleness; with
``--table``, print one markdown row per run instead (the main job's before / after,
docs/results/main_job.md).

Usage: python scripts/compare_runs.py RUN_DIR[=LABEL] ... --out compare.png
       python scripts/compare_runs.py RUN_DIR[=LABEL] ... --table
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from conveyor.runlog import read_metrics  # noqa: E402

TABLE_HEADER = ("| run | updates | training loop | held-out before -> after | busy trainer / engine / cpu | dropped as stale "
                "| mean staleness | generated tokens/s | engine dtype |\n|---|---|---|---|---|---|---|---|---|")


def check_run(run: Path, *, finished: bool = False) -> Path:
    """``run`` if it is a run directory with a ``metrics.jsonl`` (and, with ``finished``, a
    ``summary.json``); else SystemExit naming it (fresh-user trial 5: a mistyped run was an
    empty curve, or a traceback with ``--table``)."""
    if not run.is_dir():
        raise SystemExit(f"error: {run}: no such run directory")
    if not (run / "metrics.jsonl").is_file():
        raise SystemExit(f"error: {run}: no metrics.jsonl (not a run directory, or no step logged yet)")
    if finished and not (run / "summary.json").is_file():
        raise SystemExit(f"error: {run}: no summary.json (the run has not finished; --table needs its totals)")
    return run


def run_elapsed(rows: list[dict]) -> list[float]:
    """Seconds since the run started for each metrics row, over all its processes: a resumed
    run's ``time/elapsed_s`` restarts at 0 in each process ``segment``, so each segment is
    offset by the last elapsed time of the segments before it (the time between a stop and
    its resume is not counted)."""
    last: dict[int, float] = {}
    for r in rows:
        seg = int(r.get("segment", 0))
        last[seg] = max(last.get(seg, 0.0), float(r["time/elapsed_s"]))
    offset, acc = {}, 0.0
    for seg in sorted(last):
        offset[seg] = acc
        acc += last[seg]
    return [offset[int(r.get("segment", 0))] + float(r["time/elapsed_s"]) for r in rows]


def table_row(run: Path, label: str) -> str:
    """One markdown row: the training loop's wall-clock (``summary.json``'s ``wall_seconds``, s),
    held-out pass@1 before and after, the busy fractions, the share of accepted trajectories
    dropped as stale (last step's ``rollout/dropped_stale_share``), the mean staleness over the
    run's steps, the tokens generated per second of the training steps (evaluations excluded),
    the engine's dtype.

    Raises:
        FileNotFoundError: the run has no ``summary.json`` (not finished) or ``metrics.jsonl``.
    """
    summ = json.loads((run / "summary.json").read_text())
    rows = read_metrics(run / "metrics.jsonl")
    eng = json.loads((run / "engine_stats.json").read_text()) if (run / "engine_stats.json").is_file() else {}
    wall = summ["wall_seconds"]

    def acc(x):
        return "-" if x is None else f"{x:.3f}"

    stale = sum(r["staleness/mean"] for r in rows) / len(rows)
    cpu = summ.get("cpu_busy")  # the cores' busy share (summary.json; rows' busy/cpu since 221f6a7)
    if cpu is None and len(summ.get("segments", [])) <= 1:  # one process: its last row covers the loop
        cpu = rows[-1].get("busy/cpu")
    cpu = "-" if cpu is None else f"{cpu:.2f}"
    dropped = rows[-1].get("rollout/dropped_stale", 0.0)
    share = rows[-1].get("rollout/dropped_stale_share")
    if share is None:  # runs before the metric: dropped over accepted trajectories
        group = json.loads((run / "config.json").read_text())["rollout"]["group_size"]
        share = dropped / max(1.0, rows[-1]["rollout/episodes_accepted"] * group)
    # generated tokens during the training steps (each step's rate x its wall-clock): evaluations
    # on the rollout engine are not counted
    timed = [r for r in rows if "throughput/generated_tokens_per_s" in r and "time/step_wall_s" in r]
    gen = sum(r["throughput/generated_tokens_per_s"] * r["time/step_wall_s"] for r in timed) if timed else None
    steps_s = sum(r["time/step_wall_s"] for r in timed)
    return (f"| {label} | {summ['steps']} | {wall:,.0f} s | {acc(summ['heldout_before'])} -> {acc(summ['heldout_after'])} "
            f"| {summ['trainer_busy']:.2f} / {summ['engine_busy']:.2f} / {cpu} "
            f"| {100 * share:.1f}% ({dropped:.0f}) "
            f"| {stale:.2f} | {'-' if gen is None else f'{gen / steps_s:.1f}'} | {eng.get('dtype', '-')} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", default="compare.png")
    ap.add_argument("--table", action="store_true", help="print a markdown table row per run, no plot")
    a = ap.parse_args()
    for spec in a.runs:  # every run checked before anything is printed or drawn
        check_run(Path(spec.partition("=")[0]), finished=a.table)
    if a.table:
        print(TABLE_HEADER)
        for spec in a.runs:
            path, _, label = spec.partition("=")
            print(table_row(Path(path), label or Path(path).name))
        return
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for spec in a.runs:
        path, _, label = spec.partition("=")
        rows = read_metrics(Path(path) / "metrics.jsonl")
        label = label or Path(path).name
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r["reward/mean"] for r in rows], label=label)
        axes[1].plot(run_elapsed(rows), steps, label=label)
        axes[2].plot(steps, [r["busy/trainer"] for r in rows], label=label)
        axes[3].plot(steps, [r["staleness/mean"] for r in rows], label=label)
    for ax, title, xl in zip(axes, ["reward of training batches", "policy version vs wall-clock",
                                    "trainer-busy fraction (cumulative per process)", "mean staleness (versions)"],
                             ["policy version", "seconds (the processes of a resumed run added up)", "policy version",
                              "policy version"]):
        ax.set_title(title)
        ax.set_xlabel(xl)
        ax.legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=90)
    print(a.out)


if __name__ == "__main__":
    main()
