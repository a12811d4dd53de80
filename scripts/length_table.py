"""The length drift of agent runs as a markdown table (issue 45 section 4, docs/results/critics.md):
per run, the training episodes' turns, tool-call share, response tokens, reward and the summed
advantage of the unrewarded episodes, each averaged over windows of ``--width`` updates (first
window -> ... -> last), and the held-out pass@1 after training.

Runs that see the same prompt order (the same ``data.shuffle_seed``) are paired by update: an
update's episode lengths depend on its prompts as much as on the policy, so compare runs window
by window, not one run's windows against another's.

Usage: python scripts/length_table.py RUN_DIR[=LABEL] ... [--width 4]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from conveyor.runlog import read_metrics

#: (metrics.jsonl key, column title, format)
COLUMNS = (
    ("agent/turns_mean", "turns / episode", "{:.2f}"),
    ("agent/tool_call_rate", "turns calling the tool", "{:.2f}"),
    ("response/length_mean", "response tokens / episode", "{:.0f}"),
    ("reward/mean", "training reward", "{:.3f}"),
    ("advantage/sum_unrewarded", "summed advantage, unrewarded episodes", "{:.2f}"),
)


def window_means(values: list[float | None], width: int) -> list[float | None]:
    """Means of consecutive windows of ``width`` values (the last window may be shorter); a
    window's None / NaN entries (a metric an update did not log) are left out, and a window with
    none left is None.

    Raises:
        ValueError: ``width`` < 1.
    """
    if width < 1:
        raise ValueError(f"--width must be >= 1, got {width}")
    out: list[float | None] = []
    for i in range(0, len(values), width):
        kept = [float(v) for v in values[i:i + width] if v is not None and not math.isnan(float(v))]
        out.append(sum(kept) / len(kept) if kept else None)
    return out


def run_row(run: Path, label: str, width: int) -> str:
    """One markdown row for ``run``: ``label``, the number of updates, each column's window means
    joined by " -> ", and ``eval_after.json``'s pass@1 ("-" without one).

    Raises:
        SystemExit: ``run`` is not a run directory with a metrics.jsonl.
    """
    if not (run / "metrics.jsonl").is_file():
        raise SystemExit(f"error: {run}: no metrics.jsonl (not a run directory, or no update logged yet)")
    rows = read_metrics(run / "metrics.jsonl")
    cells = []
    for key, _, fmt in COLUMNS:
        means = window_means([r.get(key) for r in rows], width)
        cells.append(" -> ".join("-" if m is None else fmt.format(m) for m in means))
    after = run / "eval_after.json"
    heldout = f"{json.loads(after.read_text())['pass_at_1']:.3f}" if after.is_file() else "-"
    return f"| {label} | {len(rows)} | " + " | ".join(cells) + f" | {heldout} |"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="RUN_DIR or RUN_DIR=LABEL")
    ap.add_argument("--width", type=int, default=4, help="updates per window (default 4)")
    a = ap.parse_args(argv)
    print(f"| run | updates | {' | '.join(title for _, title, _ in COLUMNS)} | held-out after |")
    print("|---" * (len(COLUMNS) + 3) + "|")
    for spec in a.runs:
        path, _, label = spec.partition("=")
        print(run_row(Path(path), label or Path(path).name, a.width))


if __name__ == "__main__":
    main()
