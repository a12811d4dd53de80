"""Asynchronous vs synchronous training: the same task, model, batch and number of trainer steps
at eta = 0, 1, 2, 4, with two rollout profiles (issue 5):

- **(a) generation**: real generation on this CPU, nothing else (the main job's rollouts);
- **(b) agent-like**: every episode also waits on a simulated environment (a tool call) with a
  long-tailed, log-normal latency (``rollout.env_latency``): waiting, not computing.

Usage: python benchmarks/async_vs_sync.py [--model smollm2-135m-instruct] [--steps 8]
       [--profiles a,b] [--etas 0,1,2,4] [--quick] [--out DIR]

Every run is a real ``conveyor train`` (subprocess, fresh run directory) with the same
resources: the engine and the trainer get one intra-op thread each at every eta, so the figures
isolate overlap. One extra run per profile, ``eta=0 (all cores)``, gives the synchronous trainer
every core, as ``conveyor train`` does by default at eta = 0; speed-ups are reported against both.
Wall-clock is the training loop's (model loading and evaluation excluded). Trainer busy is
reported over the whole loop and in steady state (from the end of the first update on, once the
pipeline is full, as AReaL reports it).

The simulator (``conveyor simulate``) is calibrated from ONE run per profile (``--calibrate-eta``,
default 2) and predicts the wall-clock of the other same-resource runs; the prediction error is
printed next to the measurement.

Prints a JSON line per run and a final JSON summary; writes ``summary.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _run(out: Path, name: str, overrides: list[str], reuse: bool = False) -> dict:
    run_dir = out / name
    t0 = time.perf_counter()
    if not (reuse and (run_dir / "summary.json").is_file()):
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, "-m", "conveyor.cli", "train", *overrides, f"run.dir={run_dir}"]
        p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
        if p.returncode != 0:
            raise SystemExit(f"run {name} failed ({' '.join(cmd)}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    summ = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = metrics[-max(1, len(metrics) // 4):]
    # steady state: from the end of the first update on (the pipeline is full), as AReaL reports
    busy_steady = None
    if len(metrics) > 1:
        span = metrics[-1]["time/elapsed_s"] - metrics[0]["time/elapsed_s"]
        work = sum(m["time/train_step_s"] + m.get("time/weight_sync_s", 0.0) for m in metrics[1:])
        busy_steady = work / span if span > 0 else None
    rec = {
        "run": name, "wall_s": summ["wall_seconds"], "process_s": time.perf_counter() - t0, "steps": summ["steps"],
        "trainer_busy": summ["trainer_busy"], "trainer_busy_steady": busy_steady, "engine_busy": summ["engine_busy"],
        "final_reward": sum(m["reward/mean"] for m in last) / len(last),
        "reward_curve": [round(m["reward/mean"], 4) for m in metrics],
        "staleness_max": max(m["staleness/max"] for m in metrics),
        "run_dir": str(run_dir),
    }
    print(json.dumps({k: v for k, v in rec.items() if k != "reward_curve"}), flush=True)
    return rec


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4, help="prompts per update (x group size 4)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--etas", default="0,1,2,4")
    ap.add_argument("--profiles", default="a,b")
    ap.add_argument("--latency-median", type=float, default=10.0, help="profile (b): median environment wait (s)")
    ap.add_argument("--latency-sigma", type=float, default=1.0, help="profile (b): log-normal sigma")
    ap.add_argument("--calibrate-eta", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 steps, eta 0 and 2 (CI smoke run)")
    ap.add_argument("--out", default="runs/bench_async_vs_sync")
    ap.add_argument("--reuse", action="store_true", help="reuse finished runs under --out (recompute the analysis only)")
    ap.add_argument("--sim-seeds", type=int, default=5, help="simulator predictions: mean over this many seeds")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.batch_size, args.max_new_tokens, args.etas = "tiny", 2, 2, 8, "0,2"
        args.latency_median, args.calibrate_eta = 0.2, 2
    etas = [int(e) for e in args.etas.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [
        f"model.name={args.model}", f"trainer.total_steps={args.steps}", f"trainer.batch_size={args.batch_size}",
        f"rollout.max_new_tokens={args.max_new_tokens}", "run.eval_before=false", "run.eval_after=false",
        "run.export=false", "run.progress=false", "run.checkpoint_every=1000", "trainer.warmup_steps=0",
        # the settings these figures were measured with (the main job's defaults before the calculator)
        "rollout.group_size=4", "rollout.temperature=0.7", "reward.fn=math", "loss.kl_coef=0", "rollout.tool=none",
        "async.wait_for_expiring=false",  # the plain hand-out these figures (and the simulator) assume
        "trainer.lr=1e-5",
    ]
    from conveyor.simulate import calibrate, simulate

    results: dict = {"args": vars(args), "profiles": {}}
    for prof in args.profiles.split(","):
        extra = list(common)
        if prof == "b":
            extra += [f"rollout.env_latency.median_s={args.latency_median}", f"rollout.env_latency.sigma={args.latency_sigma}"]
        elif prof != "a":
            raise SystemExit(f"--profiles: unknown profile {prof!r} (a, b)")
        runs = {}
        for eta in etas:
            runs[eta] = _run(out, f"{prof}_eta{eta}", extra + [f"async.eta={eta}", "trainer.num_threads=1", "rollout.engine_threads=1"],
                             args.reuse)
        allcores = _run(out, f"{prof}_eta0_allcores", extra + ["async.eta=0"], args.reuse)
        base = runs[0]["wall_s"] if 0 in runs else None
        cal = calibrate(Path(runs[args.calibrate_eta]["run_dir"]))
        for eta, rec in runs.items():
            preds = [simulate(cal.model_copy(update={"eta": eta, "mode": "async", "seed": s})).wall_seconds
                     for s in range(args.sim_seeds)]
            pred = sum(preds) / len(preds)
            rec["simulated_wall_s"] = pred
            rec["simulation_error"] = pred / rec["wall_s"] - 1.0
            rec["calibration_run"] = eta == args.calibrate_eta
            if base:
                rec["speedup_vs_eta0"] = base / rec["wall_s"]
            rec["speedup_vs_eta0_allcores"] = allcores["wall_s"] / rec["wall_s"]
        results["profiles"][prof] = {"runs": {str(k): v for k, v in runs.items()}, "eta0_allcores": allcores,
                                     "calibrated_from": f"eta={args.calibrate_eta}", "sim_config": cal.model_dump()}
        for eta, rec in runs.items():
            print(json.dumps({"profile": prof, "eta": eta, "wall_s": round(rec["wall_s"], 1),
                              "speedup_vs_eta0": round(rec.get("speedup_vs_eta0", float("nan")), 2),
                              "speedup_vs_eta0_allcores": round(rec["speedup_vs_eta0_allcores"], 2),
                              "trainer_busy": round(rec["trainer_busy"], 3),
                              "trainer_busy_steady": rec["trainer_busy_steady"] and round(rec["trainer_busy_steady"], 3),
                              "final_reward": round(rec["final_reward"], 3),
                              "simulated_wall_s": round(rec["simulated_wall_s"], 1),
                              "simulation_error": round(rec["simulation_error"], 3)}), flush=True)
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
