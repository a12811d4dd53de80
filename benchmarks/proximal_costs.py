"""Cost ledger of the proximal ("old logits") strategies (issue 4): extra memory as a multiple of
one parameter copy and extra time as a fraction of a plain training step, at eta = 1, 2, 4.

Usage: python benchmarks/proximal_costs.py [--model tiny|smollm2-135m-instruct] [--etas 1,2,4]
       [--sequences 16] [--response-len 48] [--steps 3] [--threads 2] [--quick] [--output FILE.json]

For every (eta, method) a fresh :class:`~conveyor.trainer.trainer.Trainer` runs ``--steps``
updates (after one warm-up update) on synthetic trajectories whose tokens carry versions spread
over the whole window ``v - eta .. v`` (each trajectory spans several versions), so ``snapshot``
really recomputes one forward per version. The plain step is ``recompute`` with one minibatch
(the proximal log-probs come free from the gradient pass), measured in the same run. Extra
memory is the strategy's own ledger (``proximal/extra_bytes``: snapshots + scratch model, the
EWMA copy), divided by the bytes of one parameter copy.

``partial_sync`` and ``dedicated`` live in the runtime (they pause the engine / run a worker next
to it), so they are measured in real ``conveyor train`` runs (``--runtime-steps`` updates, same
config, eta as above) against a ``recompute`` run: extra time = wall-clock per update (steady
state, from the second update on) relative to recompute's, extra memory from the ledger.

Prints one JSON line per cell and a final JSON table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

METHODS = ("recompute", "behavior", "interpolate", "ewma", "snapshot")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--etas", default="1,2,4")
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--response-len", type=int, default=48)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runtime-steps", type=int, default=8, help="updates of each partial_sync / dedicated / recompute run (0 skips them)")
    ap.add_argument("--runtime-model", default="tiny", help="model of the runtime runs")
    ap.add_argument("--quick", action="store_true", help="tiny model, eta 1, 1 step, 4 sequences (CI smoke run)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.etas, args.steps, args.sequences, args.response_len = "tiny", "1", 1, 4, 8
        args.runtime_steps = 3

    import torch

    from conveyor.config import LossConfig, ProximalConfig, TrainerConfig
    from conveyor.models import load_model
    from conveyor.trainer.proximal import param_bytes
    from conveyor.trainer.trainer import Trainer
    from conveyor.types import Sample, Trajectory

    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    base_model = lm.model
    one = param_bytes(base_model)
    V = base_model.config.vocab_size

    def batch(version: int, eta: int, seed: int) -> list[Trajectory]:
        rng = random.Random(seed)
        out = []
        for i in range(args.sequences):
            P = max(4, round(args.prompt_len * rng.uniform(0.5, 1.5)))
            R = max(2, round(args.response_len * rng.uniform(0.5, 1.5)))
            lo = max(0, version - eta)
            vers = sorted(rng.randint(lo, version) for _ in range(R))  # a trajectory spanning versions
            out.append(Trajectory(
                sample=Sample(f"b/{i // 4}", "q", "0", "bench"), group_id=f"g{seed}-{i // 4}",
                prompt_ids=[rng.randrange(V) for _ in range(P)], response_ids=[rng.randrange(V) for _ in range(R)],
                behaviour_logprobs=[-3.0] * R, versions=vers, reward=float(rng.random() < 0.3)))
        return out

    rows = []
    for eta in [int(e) for e in args.etas.split(",")]:
        plain = None
        for method in METHODS:
            model = copy.deepcopy(base_model)
            tr = Trainer(model, TrainerConfig(lr=1e-7, warmup_steps=0, num_threads=args.threads),
                         LossConfig(kl_coef=0.0), proximal_cfg=ProximalConfig(method=method, ewma_reset_keep_rate=0.0), eta=eta)
            # warm-up updates fill the snapshot window (versions 0..eta) before timing
            for w in range(max(1, eta)):
                tr.train_step(batch(tr.version, eta, seed=100 + w))
            times, prox_times, extra = [], [], []
            for k in range(args.steps):
                m = tr.train_step(batch(tr.version, eta, seed=k))
                times.append(m["time/train_step_s"])
                prox_times.append(m["time/proximal_s"])
                extra.append(m["proximal/extra_bytes"])
            step = statistics.median(times)
            if method == "recompute":
                plain = step
            row = {"model": args.model, "eta": eta, "method": method, "step_s": step,
                   "proximal_s": statistics.median(prox_times),
                   "extra_time_frac": step / plain - 1.0 if plain else 0.0,
                   "extra_bytes": max(extra), "extra_memory_copies": max(extra) / one, "param_copy_bytes": one}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del tr, model
    if args.runtime_steps > 0:
        rows += _runtime_rows(args, [int(e) for e in args.etas.split(",")], one if args.runtime_model == args.model else None)
    res = {"model": args.model, "sequences": args.sequences, "threads": args.threads, "rows": rows, "cpu_count": os.cpu_count()}
    print(json.dumps({"table": [(r["eta"], r["method"], r["extra_memory_copies"] and round(r["extra_memory_copies"], 2),
                                 round(r["extra_time_frac"], 3)) for r in rows]}))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(res, f, indent=2)
    return res


def _runtime_rows(args, etas: list[int], one: int | None) -> list[dict]:
    """partial_sync / dedicated vs recompute in real tiny-config ``conveyor train`` runs."""
    import subprocess
    import tempfile
    from pathlib import Path

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for eta in etas:
            walls = {}
            for method in ("recompute", "partial_sync", "dedicated"):
                run = Path(tmp) / f"{method}_{eta}"
                cmd = [sys.executable, "-m", "conveyor.cli", "train", f"model.name={args.runtime_model}",
                       f"trainer.total_steps={args.runtime_steps}", "trainer.batch_size=4", "rollout.group_size=4",
                       "rollout.max_new_tokens=32", f"async.eta={eta}", f"proximal.method={method}", "rollout.tool=none",
                       "async.wait_for_expiring=false",  # as recorded
                       "run.eval_before=false", "run.eval_after=false", "run.export=false", "run.progress=false",
                       "run.checkpoint_every=1000", f"run.dir={run}"]
                p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
                if p.returncode != 0:
                    raise SystemExit(f"{method} run failed:\n{p.stderr[-3000:]}")
                ms = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
                steady = ms[1:] or ms
                wall = statistics.fmean(m["time/step_wall_s"] for m in steady)
                walls[method] = wall
                summ = json.loads((run / "summary.json").read_text())
                extra = summ["proximal"]["extra_bytes"]
                row = {"model": args.runtime_model, "eta": eta, "method": method, "step_wall_s": wall,
                       "proximal_s": statistics.fmean(m["time/proximal_s"] for m in steady),
                       "extra_time_frac": wall / walls["recompute"] - 1.0, "extra_bytes": extra,
                       "extra_memory_copies": extra / one if one else None, "runtime": True,
                       "missing_frac": max(m.get("proximal/partial_sync_missing_frac", 0.0) for m in ms)}
                if method == "dedicated":
                    row["dedicated_wait_s"] = statistics.fmean(m.get("proximal/dedicated_wait_s", 0.0) for m in steady)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
