"""Curves and a table of the SAO experiment runs (scripts/sao_experiments.sh; issue 11 section 5).

Reads every run directory under ``docs/results/runs/sao`` (or the directories given) and writes
``docs/results/sao_curves.png``: training reward and held-out pass@1 against responses sampled
(warm-up responses included, so runs with the same sample budget end at the same x), and the
critic's value loss / explained variance (warm-up steps at negative steps). Prints a markdown
table: held-out pass@1 before / at each evaluation / after, training wall-clock without the
evaluations, responses sampled, trajectories dropped as stale.

    python scripts/plot_sao.py [RUN_DIR ...] [--out docs/results/sao_curves.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _jsonl(p: Path) -> list[dict]:
    if not p.is_file():
        return []
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def load(run: Path) -> dict:
    cfg = json.loads((run / "config.json").read_text())
    per_step = cfg["rollout"]["group_size"] * cfg["trainer"]["batch_size"]
    warm = _jsonl(run / "critic_warmup.jsonl")
    metrics = _jsonl(run / "metrics.jsonl")
    events = _jsonl(run / "events.jsonl")
    evals = [e for e in events if e.get("event") == "eval" and not e.get("superseded")]
    n_warm = len(warm)
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    # summary.json's wall-clock is the training loop's: it holds the evaluations during training
    # (eval_step_N), not the ones before and after
    eval_s = sum(e.get("wall_seconds", 0.0) for e in evals if str(e.get("label", "")).startswith("step_"))
    return {
        "name": run.name, "per_step": per_step, "warm": warm, "metrics": metrics, "n_warm": n_warm,
        # "before" is at 0 responses (runs logged before the warm-up offset stamped it version 0)
        "evals": [(0 if e["label"] == "before" else (n_warm + e["version"]) * per_step, e["label"], e["pass_at_1"])
                  for e in evals],
        "responses": (n_warm + len(metrics)) * per_step,
        "train_s": summary.get("wall_seconds", float("nan")) - eval_s if summary else float("nan"),
        "dropped": metrics[-1].get("rollout/dropped_stale", float("nan")) if metrics else float("nan"),
        "cfg": cfg,
    }


def smooth(ys: list[float], w: int = 5) -> list[float]:
    return [sum(ys[max(0, i - w + 1): i + 1]) / len(ys[max(0, i - w + 1): i + 1]) for i in range(len(ys))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", type=Path)
    ap.add_argument("--out", type=Path, default=ROOT / "docs/results/sao_curves.png")
    a = ap.parse_args(argv)
    runs = a.runs or sorted(p for p in (ROOT / "docs/results/runs/sao").iterdir() if (p / "config.json").is_file())
    data = [load(r) for r in runs]
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    # one colour per method (the run name without its _sN seed suffix), one line style per seed
    split = {d["name"]: d["name"].rsplit("_s", 1) for d in data}  # [method, seed] or [name]
    methods = sorted({parts[0] for parts in split.values()})
    styles = ["-", "--", ":", "-."]
    for d in data:
        method, seed = (split[d["name"]] + [""])[:2]
        look = {"color": f"C{methods.index(method) % 10}",
                "linestyle": styles[int(seed) % len(styles)] if seed.isdigit() else "-"}
        xs = [(d["n_warm"] + m["step"]) * d["per_step"] for m in d["metrics"]]
        ax[0].plot(xs, smooth([m["reward/mean"] for m in d["metrics"]]), label=d["name"], **look)
        ex = [x for x, _, _ in d["evals"]]
        ax[1].plot(ex, [p for _, _, p in d["evals"]], marker="o", label=d["name"], **look)
        if d["warm"] or any("critic/value_loss" in m for m in d["metrics"]):
            steps = [w["step"] for w in d["warm"]] + [m["step"] for m in d["metrics"]]
            vl = [w.get("critic/value_loss") for w in d["warm"]] + [m.get("critic/value_loss") for m in d["metrics"]]
            ax[2].plot(steps, vl, label=f"{d['name']} value loss", **look)
    ax[0].set_title("training reward (mean of 5 steps)")
    ax[1].set_title("held-out MAWPS pass@1 (greedy, 110 problems)")
    for x in ax[:2]:
        x.set_xlabel("responses sampled (warm-up included)")
    ax[2].set_title("critic value loss (steps <= 0: warm-up)")
    ax[2].set_xlabel("step")
    for x in ax:
        x.legend(fontsize=7)
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}\n")
    print("| run | responses | warm-up steps | updates | held-out pass@1 (before -> ... -> after) | training s (no evals) | dropped stale |")
    print("|---|---|---|---|---|---|---|")
    for d in data:
        ev = " -> ".join(f"{p:.3f}" for _, _, p in d["evals"])
        print(f"| {d['name']} | {d['responses']} | {d['n_warm']} | {len(d['metrics'])} | {ev} | {d['train_s']:.0f} | "
              f"{d['dropped']:.0f} |")


if __name__ == "__main__":
    main()
