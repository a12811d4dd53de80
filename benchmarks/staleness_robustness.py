"""Staleness robustness of the proximal strategies (issue 4): eta in {0, 4, 8} x {plain PPO on
the behaviour ratio, decoupled PPO + recompute, snapshot, ewma, interpolate}.

Usage: python benchmarks/staleness_robustness.py [--model smollm2-135m-instruct] [--steps 15]
       [--etas 0,4,8] [--batch-size 3] [--group-size 8] [--heldout 40] [--quick] [--out DIR]

Recorded run: ``--steps 12`` (docs/results/proximal.md, "Staleness robustness").

Task: a policy-improvement signal that is visible on a 2-core CPU within minutes -- the format
reward (``reward.fn=format``: 1 when the response ends with "Answer: <number>") on MAWPS
singleop prompts; SmolLM2 follows that format ~3% of the time before training and learns it in
~10 updates at lr 3e-5 (see docs/results/training.md, run r3). Generation is kept short
(``rollout.max_new_tokens=32``) and the trainer slow relative to it (one thread), so the engine
runs ahead up to eta; the realised staleness is reported per cell (in short runs it stays below
large bounds while the pipeline fills). After training, the final policy is scored greedily on
``--heldout`` held-out prompts (format rate, pass@1).

Methods (MISSION.md sections 1-2):
- ``ppo``: ``loss.name=ppo``, ratio ``pi_theta / pi_behav`` clipped (no proximal policy);
- ``recompute``: decoupled PPO, proximal = current parameters (AReaL);
- ``snapshot``: two-ratio loss, old log-probs from the parameter snapshot of each token's version;
- ``ewma``: two-ratio loss, old log-probs from the EWMA policy (adaptive decay, auto-reset);
- ``interpolate``: decoupled PPO, proximal = AReaL's loglinear interpolation.

Each cell reports the final reward (mean of the last quarter of updates), the reward curve, the
realised staleness (mean / max), clip fractions and KL, and a stability note (reward dropped by
more than 0.2 from its best, or a non-finite step). Writes ``summary.json`` and ``curves.png``
under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

METHODS = {
    "ppo": ["loss.name=ppo", "proximal.method=recompute"],
    "recompute": ["loss.name=decoupled_ppo", "proximal.method=recompute"],
    "snapshot": ["loss.name=two_ratio", "proximal.method=snapshot"],
    "ewma": ["loss.name=two_ratio", "proximal.method=ewma"],
    "interpolate": ["loss.name=decoupled_ppo", "proximal.method=interpolate"],
}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--etas", default="0,4,8")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--batch-size", type=int, default=3, help="prompts per update (trainer.batch_size)")
    ap.add_argument("--group-size", type=int, default=8, help="responses per prompt (rollout.group_size)")
    ap.add_argument("--heldout", type=int, default=40,
                    help="held-out prompts scored greedily after training (format rate of the final policy); 0 = none")
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 steps, eta 0 and 2, two methods (CI smoke run)")
    ap.add_argument("--out", default="runs/bench_staleness")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.etas, args.methods = "tiny", 2, "0,2", "ppo,snapshot"
        args.batch_size, args.group_size, args.heldout = 2, 4, 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [f"model.name={args.model}", f"trainer.total_steps={args.steps}", f"trainer.batch_size={args.batch_size}", f"rollout.group_size={args.group_size}",
              "rollout.max_new_tokens=32", "reward.fn=format", f"trainer.lr={args.lr}", "trainer.warmup_steps=0",
              "trainer.num_threads=1", "rollout.engine_threads=1", "rollout.temperature=0.7",
              "rollout.tool=none", "loss.kl_coef=0", "async.wait_for_expiring=false",  # as recorded (proximal.md)
              "run.eval_before=false", f"run.eval_after={'true' if args.heldout else 'false'}",
              f"data.heldout_limit={max(1, args.heldout)}", "run.eval_max_new_tokens=32", "run.export=false", "run.progress=false",
              "run.checkpoint_every=1000"]
    cells = []
    for eta in [int(e) for e in args.etas.split(",")]:
        for method in args.methods.split(","):
            run = out / f"eta{eta}_{method}"
            shutil.rmtree(run, ignore_errors=True)
            cmd = [sys.executable, "-m", "conveyor.cli", "train", *common, *METHODS[method], f"async.eta={eta}", f"run.dir={run}"]
            p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
            if p.returncode != 0:
                raise SystemExit(f"{method} eta={eta} failed:\n{p.stderr[-3000:]}")
            ms = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            rewards = [m["reward/mean"] for m in ms]
            last = rewards[-max(1, len(rewards) // 4):]
            final = sum(last) / len(last)
            best = max(rewards)
            notes = []
            if best - final > 0.2:
                notes.append(f"reward fell from its best {best:.2f} to {final:.2f}")
            if any(m["train/skipped_nonfinite"] for m in ms):
                notes.append("non-finite steps")
            after = json.loads((run / "eval_after.json").read_text()) if (run / "eval_after.json").is_file() else {}
            cell = {
                "eta": eta, "method": method, "final_reward": final,
                "heldout_format_rate": after.get("format_rate"), "heldout_pass_at_1": after.get("pass_at_1"), "best_reward": best, "reward_curve": rewards,
                "staleness_mean": sum(m["staleness/mean"] for m in ms) / len(ms),
                "staleness_max": max(m["staleness/max"] for m in ms),
                "clip_frac": sum(m.get("loss/clip_low_frac", 0.0) + m.get("loss/clip_high_frac", 0.0) for m in ms) / len(ms),
                "approx_kl": sum(m.get("loss/approx_kl_mean", 0.0) for m in ms) / len(ms),
                "discrepancy_keep_frac": (sum(m["loss/discrepancy_keep_frac"] for m in ms) / len(ms)
                                          if "loss/discrepancy_keep_frac" in ms[0] else None),
                "stability": "; ".join(notes) or "stable",
                "wall_s": ms[-1]["time/elapsed_s"],
            }
            cells.append(cell)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in cell.items() if k != "reward_curve"}), flush=True)
    res = {"args": vars(args), "cells": cells}
    (out / "summary.json").write_text(json.dumps(res, indent=2))
    try:
        _plot(cells, out / "curves.png")
    except Exception as e:  # the numbers matter more than the picture
        print(f"plot failed: {e!r}", file=sys.stderr)
    return res


def _plot(cells: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas = sorted({c["eta"] for c in cells})
    fig, axes = plt.subplots(1, len(etas), figsize=(5 * len(etas), 3.6), sharey=True, squeeze=False)
    for ax, eta in zip(axes[0], etas, strict=True):
        for c in (c for c in cells if c["eta"] == eta):
            ax.plot(range(1, len(c["reward_curve"]) + 1), c["reward_curve"], label=c["method"])
        ax.set_title(f"eta = {eta}")
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("reward (format)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
