"""Scaling the rollout side: 1 vs N inference engines behind the router (``rollout.num_engines``),
measured on this machine, and the simulator's prediction for clusters of 8 and 64 nodes from the
calibrated 1-engine run (issue 12, section 4, "Scaling"). Every figure is measured in this one run.

Usage: python benchmarks/engine_scaling.py [--model tiny|smollm2-135m-instruct] [--runtime ray|inline]
       [--engines 1,2] [--steps 6] [--rounds 1] [--set KEY=VALUE ...] [--quick] [--json FILE.json]

``--quick``: the tiny model, 1 step of 16 trajectories, 1 round, the inline runtime unless
``--runtime`` is given (the test that the script runs).

**Measured.** The same ``conveyor train`` job (no evaluations, no export, no final checkpoint) per
engine count, as separate processes, rounds in alternating order (1, 2, 2, 1, ...). Per run, from
its run directory: the training loop's wall-clock per update (``summary.json``, model loading and
start-up excluded), generation throughput (generated tokens / loop wall-clock), the busy fraction
per engine and of the trainer, and the engines' counters (``engine_stats.json``). The ratio is
N-engine throughput (updates per second) over 1-engine, medians of the rounds. On a machine with
fewer cores than ``N`` engines + the trainer the engines share cores: the ratio then measures the
contention, not the scaling.

**Predicted** (``conveyor.simulate``): the simulator calibrated from the first 1-engine run
(:func:`~conveyor.simulate.calibrate`: its decode profile, lengths and trainer times) first
predicts the measured N-engine run (``rollout.workers=N``; its error is printed), then clusters
of 8 and 64 nodes, each node like the measured one (one engine; the trainer data-parallel over the
nodes, ``trainer.devices = nodes``) at the same batch per node (``batch_size x nodes``): updates
per second, trajectories per second, and per-node efficiency against one node. The simulator
models compute and queueing, not the network or weight broadcast across machines (the measured
weight-sync seconds are kept per update), so the cluster figures are an upper bound.

Prints a markdown table and one JSON line (also written to ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_overhead import run_job  # noqa: E402  (the same timing job)


def _train(model: str, runtime: str, engines: int, steps: int, out: Path, extra: list[str]) -> dict:
    """One ``conveyor train`` process with ``engines`` engines (:func:`runtime_overhead.run_job`);
    its loop's figures.

    Raises:
        RuntimeError: the run failed (its console output's tail in the message).
    """
    summary, total_s = run_job(f"{engines}-engine {runtime}", model, steps, out,
                               [f"runtime.name={runtime}", f"rollout.num_engines={engines}", *extra])
    seg = summary["segments"][0]
    eng = json.loads((out / "engine_stats.json").read_text())
    wall = seg["wall_seconds"]
    return {"engines": engines, "runtime": runtime, "s_per_update": wall / seg["steps"], "steps": seg["steps"],
            "loop_s": wall, "process_s": total_s, "gen_tokens_per_s": eng["generated_tokens"] / wall,
            "engine_busy": summary["engine_busy"], "trainer_busy": summary["trainer_busy"],
            "per_engine_tokens": [e["generated_tokens"] for e in eng.get("engines", [eng])],
            "routed_by_affinity": eng.get("routed_by_affinity", 0), "dropped_stale":
                summary.get("controller", {}).get("rollout/dropped_stale", 0), "run_dir": str(out)}


def _predict(run_dir: Path, engines: list[int], nodes: list[int], seeds: int = 3) -> dict:
    """The simulator calibrated from ``run_dir`` (a 1-engine run): predictions for N engines on
    one machine and for clusters of ``nodes`` nodes (weak scaling). Means over ``seeds`` seeds."""
    from conveyor.simulate import calibrate, simulate

    base = calibrate(run_dir)

    def run(cfg) -> dict:
        res = [simulate(cfg.model_copy(update={"seed": s})) for s in range(seeds)]
        return {"wall_s": statistics.fmean(r.wall_seconds for r in res),
                "updates_per_s": statistics.fmean(cfg.steps / r.wall_seconds for r in res),
                "trajectories_per_s": statistics.fmean(r.trajectories_per_s for r in res),
                "rollout_busy": statistics.fmean(r.rollout_busy for r in res),
                "trainer_busy": statistics.fmean(r.trainer_busy for r in res)}

    out: dict = {"one_machine": {}, "cluster": {}}
    for n in engines:
        cfg = base.model_copy(deep=True)
        cfg.rollout.workers = n
        out["one_machine"][n] = run(cfg)
    one = None
    for n in [1, *nodes]:
        cfg = base.model_copy(deep=True)
        cfg.rollout.workers = n
        cfg.trainer.devices = n
        cfg.batch_size = base.batch_size * n
        cfg.max_concurrent = base.max_concurrent * n
        pred = run(cfg)
        if n == 1:
            one = pred
        pred["efficiency_per_node"] = pred["trajectories_per_s"] / (n * one["trajectories_per_s"])
        out["cluster"][n] = pred
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--runtime", default=None, choices=("ray", "inline"), help="default: ray")
    ap.add_argument("--engines", default="1,2", help="comma-separated engine counts (the first must be 1)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--nodes", default="8,64", help="cluster sizes to predict")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config overrides")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.rounds = "tiny", 1, 1
        args.runtime = args.runtime or "inline"
        args.set = ["trainer.batch_size=4", "rollout.group_size=4", *args.set]  # 16 trajectories per update
    args.runtime = args.runtime or "ray"
    counts = [int(x) for x in args.engines.split(",")]
    if counts[0] != 1:
        ap.error("--engines must start with 1 (the reference run)")
    nodes = [int(x) for x in args.nodes.split(",") if x]
    extra = list(args.set)  # ray: the local cluster is sized for the actors (runtime.num_cpus unset)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = counts if r % 2 == 0 else counts[::-1]
            for n in order:
                res = _train(args.model, args.runtime, n, args.steps, Path(tmp) / f"e{n}_{r}", extra)
                runs.append(res)
                print(f"  round {r}, {n} engine(s): {res['s_per_update']:.2f} s/update, "
                      f"{res['gen_tokens_per_s']:.1f} generated tokens/s, engine busy {res['engine_busy']:.2f}, "
                      f"trainer busy {res['trainer_busy']:.2f}", file=sys.stderr)
        ref = next(x for x in runs if x["engines"] == 1)
        predicted = _predict(Path(ref["run_dir"]), counts, nodes)
    med = {n: {k: statistics.median(x[k] for x in runs if x["engines"] == n)
               for k in ("s_per_update", "gen_tokens_per_s", "engine_busy", "trainer_busy")} for n in counts}
    ratio = {n: med[1]["s_per_update"] / med[n]["s_per_update"] for n in counts}
    sim_err = {n: predicted["one_machine"][n]["wall_s"] / (med[n]["s_per_update"] * args.steps) - 1 for n in counts}
    out = {"model": args.model, "runtime": args.runtime, "steps": args.steps, "rounds": args.rounds,
           "overrides": args.set, "cpus": os.cpu_count(), "runs": runs, "median": med,
           "updates_per_s_over_1_engine": ratio, "predicted": predicted, "simulator_error_one_machine": sim_err}
    print("| engines | s / update | generated tokens / s | busy per engine | trainer busy | updates/s vs 1 engine "
          "| simulator's wall error |")
    print("|---|---|---|---|---|---|---|")
    for n in counts:
        m = med[n]
        print(f"| {n} | {m['s_per_update']:.2f} | {m['gen_tokens_per_s']:.1f} | {m['engine_busy']:.2f} | "
              f"{m['trainer_busy']:.2f} | {ratio[n]:.2f}x | {sim_err[n]:+.0%} |")
    print("\n| nodes (predicted) | updates / s | trajectories / s | efficiency per node | rollout busy | trainer busy |")
    print("|---|---|---|---|---|---|")
    for n, p in predicted["cluster"].items():
        print(f"| {n} | {p['updates_per_s']:.3f} | {p['trajectories_per_s']:.1f} | {p['efficiency_per_node']:.2f} | "
              f"{p['rollout_busy']:.2f} | {p['trainer_busy']:.2f} |")
    for r in out["runs"]:
        r.pop("run_dir")
    print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
