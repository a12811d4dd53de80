"""The Ray runtime's overhead against the inline runtime, and weight-sync time per version through
Ray's object store and through disk (issue 12, section 4), every figure measured in this one run.

Usage: python benchmarks/runtime_overhead.py [--model tiny|smollm2-135m-instruct] [--steps 6]
       [--rounds 2] [--runtimes inline,ray[,ray_trainer_actor]] [--set KEY=VALUE ...] [--quick]
       [--json FILE.json]

``--quick``: the tiny model, 1 step of 16 trajectories, 1 round, 2 sync repeats (the test that
the script runs).

**Overhead.** The same ``conveyor train`` job (no evaluations, no export, no final checkpoint;
``runtime.num_cpus=2``) is run ``--rounds`` times per runtime, as separate processes, in the
order inline, ray, ray, inline, ... (so a slow drift of the machine's load hits both sides
alike). Per run: the training loop's wall-clock per update (``summary.json``: the segment's
``wall_seconds / steps``; model loading, the Ray cluster's start and the actor's setup are not
in it: they are once per run) and the mean ``time/weight_sync_s`` of its steps (the trainer's
blocking publish: snapshot of the weights, the transfer, the engine's load). The ratio is
ray / inline of the medians (``--runtimes``: each against the first; ``ray_trainer_actor`` is
``runtime.trainer=actor``, the trainer in a Ray actor of its own).

**Weight sync, two transports, one process** (the model's fp32 :class:`~conveyor.sync.WeightUpdate`):
- object store: ``ray.put`` in the driver + ``ray.get`` in a separate actor process (the
  rollout actor's path: the actor then loads it into its engine, not counted here);
- disk: :func:`~conveyor.sync.write_weights` (safetensors, fsync, atomic rename) +
  :func:`~conveyor.sync.read_weights` (what a remote engine's ``/update_weights_from_disk`` does);
- object store in bf16: the same after :meth:`~conveyor.sync.WeightUpdate.cast` (the wire dtype
  the Ray runtime uses for bf16 engines), cast included, and its ratio to fp32.
Medians of 5 after one warm-up; the message size in MB.

Prints a markdown table and one JSON line (also written to ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

CONVEYOR = [sys.executable, "-m", "conveyor.cli"]


def run_job(what: str, model: str, steps: int, out: Path, overrides: list[str]) -> tuple[dict, float]:
    """One ``conveyor train`` process of the timing job (no evaluations, export or final
    checkpoint) with ``overrides``, in run directory ``out`` (also used by engine_scaling.py).

    Returns:
        ``(summary.json, seconds of the whole process)``.

    Raises:
        RuntimeError: the run failed (``what`` and its console output's tail in the message).
    """
    cmd = [*CONVEYOR, "train", f"model.name={model}", f"trainer.total_steps={steps}", "run.eval_before=false",
           "run.eval_after=false", "run.export=false", "run.progress=false", "run.final_checkpoint=none",
           "run.checkpoint_every=1000", f"run.dir={out}", *overrides]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    total_s = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{what} run failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return json.loads((out / "summary.json").read_text()), total_s


RUNTIMES = {
    "inline": ["runtime.name=inline"],
    "ray": ["runtime.name=ray"],
    # the trainer in a Ray actor of its own (runtime/ray_trainer.py): 1 CPU for it, 1 for the
    # rollout actor, the driver only orchestrates
    "ray_trainer_actor": ["runtime.name=ray", "runtime.trainer=actor"],
}
"""The runtimes ``--runtimes`` can compare, as config overrides."""


def _train(model: str, runtime: str, steps: int, out: Path, extra: list[str]) -> dict:
    """One run on ``runtime`` (a :data:`RUNTIMES` key); its loop's seconds per update and mean
    weight-sync seconds."""
    summary, total_s = run_job(runtime, model, steps, out, [*RUNTIMES[runtime], "runtime.num_cpus=2", *extra])
    seg = summary["segments"][0]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    sync = [r["time/weight_sync_s"] for r in rows if "time/weight_sync_s" in r]
    return {"runtime": runtime, "s_per_update": seg["wall_seconds"] / seg["steps"], "steps": seg["steps"],
            "weight_sync_s": statistics.mean(sync) if sync else float("nan"), "process_s": total_s}


def _sync_transports(model: str, repeats: int = 5) -> dict:
    """Median seconds of one version through the object store and through disk."""
    import ray
    import torch

    from conveyor.models import load_model
    from conveyor.sync import WeightUpdate, read_weights, write_weights

    lm = load_model(model)
    update = WeightUpdate.from_model(lm.model, version=1)
    size_mb = sum(t.numel() * t.element_size() for t in update.state_dict().values()) / 2**20

    @ray.remote(num_cpus=0)
    class Receiver:
        def fetch(self, refs) -> int:
            u = ray.get(refs[0])  # the object store's copy into this process
            return sum(t.numel() for t in u.state_dict().values())

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        rx = Receiver.remote()
        ray.get(rx.fetch.remote([ray.put(update)]))  # warm-up (actor start, first put)
        store, store_bf16 = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ray.get(rx.fetch.remote([ray.put(update)]))  # in a list: the actor fetches, not Ray's argument resolution
            store.append(time.perf_counter() - t0)
            # the wire dtype of bf16 engines (runtime/ray.py wire_dtype): cast, put, fetch
            t0 = time.perf_counter()
            ray.get(rx.fetch.remote([ray.put(update.cast(torch.bfloat16))]))
            store_bf16.append(time.perf_counter() - t0)
    finally:
        if started:
            ray.shutdown()
    disk = []
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "weights"
        write_weights(path, update)
        read_weights(path)
        for _ in range(repeats):
            t0 = time.perf_counter()
            write_weights(path, update)
            got = read_weights(path)
            disk.append(time.perf_counter() - t0)
        assert torch.equal(next(iter(got.state_dict().values())), next(iter(update.state_dict().values())))
    return {"message_mb": size_mb, "object_store_s": statistics.median(store), "disk_s": statistics.median(disk),
            "object_store_bf16_s": statistics.median(store_bf16),
            "bf16_over_fp32": statistics.median(store_bf16) / statistics.median(store)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config overrides")
    ap.add_argument("--runtimes", default="inline,ray", help=f"comma-separated, of {', '.join(RUNTIMES)}; the "
                    "ratios are against the first")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.rounds = "tiny", 1, 1
        args.set = ["trainer.batch_size=4", "rollout.group_size=4", *args.set]  # 16 trajectories per update
    names = [x.strip() for x in args.runtimes.split(",") if x.strip()]
    bad = [x for x in names if x not in RUNTIMES]
    if bad or len(names) < 2:
        ap.error(f"--runtimes: two or more of {', '.join(RUNTIMES)} (got {args.runtimes!r})")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]  # alternated: neither side always runs first
            for rt in order:
                res = _train(args.model, rt, args.steps, Path(tmp) / f"{rt}_{r}", args.set)
                runs.append(res)
                print(f"  round {r} {rt}: {res['s_per_update']:.2f} s/update, weight sync {res['weight_sync_s']:.3f} s",
                      file=sys.stderr)
    med = {rt: statistics.median(x["s_per_update"] for x in runs if x["runtime"] == rt) for rt in names}
    sync = {rt: statistics.median(x["weight_sync_s"] for x in runs if x["runtime"] == rt) for rt in names}
    transports = _sync_transports(args.model, repeats=2 if args.quick else 5)
    base = names[0]
    out = {"model": args.model, "steps": args.steps, "rounds": args.rounds, "overrides": args.set, "runs": runs,
           "runtimes": names, "s_per_update": med, "weight_sync_s": sync,
           "over_first": {rt: med[rt] / med[base] for rt in names[1:]},
           "transport": transports, "cpus": os.cpu_count()}
    if "ray" in med and "inline" in med:
        out["ray_over_inline"] = med["ray"] / med["inline"]
    print(f"| runtime | s / update (median of {args.rounds}) | weight sync s / version (publish) |")
    print("|---|---|---|")
    for rt in names:
        print(f"| {rt} | {med[rt]:.2f} | {sync[rt]:.3f} |")
    print()
    for rt in names[1:]:
        print(f"{rt} / {base}: {out['over_first'][rt]:.3f}x per update")
    print(f"one version ({transports['message_mb']:.0f} MB): object store {transports['object_store_s']:.3f} s, "
          f"disk (safetensors write + read) {transports['disk_s']:.3f} s; object store in bf16 (cast included) "
          f"{transports['object_store_bf16_s']:.3f} s = {transports['bf16_over_fp32']:.2f}x")
    print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
