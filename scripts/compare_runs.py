"""Plot several runs side by side: reward, wall-clock, trainer-busy fraction, staleness.

Usage: python scripts/compare_runs.py RUN_DIR[=LABEL] ... --out compare.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from conveyor.runlog import read_metrics  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", default="compare.png")
    a = ap.parse_args()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for spec in a.runs:
        path, _, label = spec.partition("=")
        rows = read_metrics(Path(path) / "metrics.jsonl")
        label = label or Path(path).name
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r["reward/mean"] for r in rows], label=label)
        axes[1].plot([r["time/elapsed_s"] for r in rows], steps, label=label)
        axes[2].plot(steps, [r["busy/trainer"] for r in rows], label=label)
        axes[3].plot(steps, [r["staleness/mean"] for r in rows], label=label)
    for ax, title, xl in zip(axes, ["reward of training batches", "policy version vs wall-clock",
                                    "trainer-busy fraction (cumulative)", "mean staleness (versions)"],
                             ["policy version", "seconds", "policy version", "policy version"]):
        ax.set_title(title)
        ax.set_xlabel(xl)
        ax.legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=90)
    print(a.out)


if __name__ == "__main__":
    main()
