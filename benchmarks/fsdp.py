"""FSDP2 data parallelism against one trainer process: memory per process and time per update
(issue 15 section 1), both sides measured in this one run on the same batch.

Usage: python benchmarks/fsdp.py [--model smollm2-135m-instruct|tiny] [--world 2] [--threads 2]
       [--trajectories 16] [--micro-batch-tokens 512] [--steps 3] [--quick] [--json FILE.json]

- ``single``: one process, one :class:`~conveyor.trainer.trainer.Trainer` with ``--threads``
  intra-op threads;
- ``fsdp``: ``--world`` processes on the gloo backend (``trainer.world_size``), each with
  ``--threads / --world`` threads (the same cores in all), each holding 1/W of every parameter,
  gradient and AdamW moment (:mod:`conveyor.trainer.distributed`).

Each side takes ``--steps`` policy updates on the same synthetic batch (``--trajectories``
responses in groups of 4, packed into micro-batches of ``--micro-batch-tokens``; fp32,
``loss.kl_coef=0``), then gathers the weights once as a weight update (``weight_gather_s``).
Per process (rank 0 and the largest over ranks): ``param_bytes``, ``grad_bytes`` and
``optimizer_state_bytes`` (the tensors this process holds: its shards), ``step_s`` (median update
after the first), ``peak_rss_bytes`` (the process's high-water mark, model loading included: each
process loads the full model before sharding it, and rank 0 keeps an unsharded copy to publish
weights from). ``ratios``: fsdp / single. The first step's loss must agree (``loss_abs_diff``).
Prints one JSON line (also written to ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _local_bytes(t) -> int:
    """Bytes this process holds of ``t`` (its shard for a DTensor)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def measure(rank: int, world: int, port: int, args: dict, out: str) -> None:
    """One trainer process (world 1: no process group); writes its figures to ``out/rank<r>.json``."""
    import torch
    from lora import synthetic_batch

    from conveyor.config import LossConfig, TrainerConfig
    from conveyor.models import load_model
    from conveyor.trainer.distributed import init_process_group
    from conveyor.trainer.trainer import Trainer

    torch.set_num_threads(max(1, args["threads"] // world))
    dp = init_process_group(rank, world, port=port, timeout_s=600) if world > 1 else None
    model = load_model(args["model"], seed=0).model
    vocab = model.get_input_embeddings().num_embeddings
    batch = synthetic_batch(args["trajectories"], vocab)
    tc = TrainerConfig(lr=1e-5, warmup_steps=0, bf16=False, micro_batch_tokens=args["micro_batch_tokens"])
    tr = Trainer(model, tc, LossConfig(kl_coef=0.0), data_parallel=dp)
    times, losses = [], []
    for _ in range(args["steps"]):
        t0 = time.perf_counter()
        m = tr.train_step(batch)
        times.append(time.perf_counter() - t0)
        losses.append(m["loss/loss"])
    t0 = time.perf_counter()
    tr.weight_update()
    gather = time.perf_counter() - t0
    res = {
        "rank": rank, "micro_batches": m["train/micro_batches"], "loss_first": losses[0],
        "param_bytes": sum(_local_bytes(p) for p in model.parameters()),
        "grad_bytes": sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None),
        "optimizer_state_bytes": sum(_local_bytes(v) for st in tr.optimizer.state.values() for v in st.values()
                                     if isinstance(v, torch.Tensor)),
        "step_s": statistics.median(times[1:] or times), "weight_gather_s": gather,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    if dp is not None:
        torch.distributed.destroy_process_group()


def run_side(world: int, args: dict) -> dict:
    """Run one side in fresh processes; its per-rank figures."""
    import torch.multiprocessing as mp

    from conveyor.trainer.distributed import free_port

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(measure, args=(world, free_port(), args, out), nprocs=world, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    keys = ("param_bytes", "grad_bytes", "optimizer_state_bytes", "step_s", "weight_gather_s", "peak_rss_bytes")
    return {"processes": world, "threads_per_process": max(1, args["threads"] // world),
            "micro_batches": ranks[0]["micro_batches"], "loss_first": ranks[0]["loss_first"],
            "rank0": {k: ranks[0][k] for k in keys}, "max_over_ranks": {k: max(r[k] for r in ranks) for k in keys}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--micro-batch-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny model, 8 trajectories, 2 steps (CI smoke run)")
    ap.add_argument("--json", default=None, help="also write the result to this file")
    a = ap.parse_args(argv)
    if a.quick:
        a.model, a.trajectories, a.steps, a.micro_batch_tokens = "tiny", 8, 2, 128
    args = {"model": a.model, "threads": a.threads, "trajectories": a.trajectories,
            "micro_batch_tokens": a.micro_batch_tokens, "steps": a.steps}
    single = run_side(1, args)
    fsdp = run_side(a.world, args)
    ratios = {f"{k}_per_process": fsdp["max_over_ranks"][k] / single["rank0"][k]
              for k in ("param_bytes", "grad_bytes", "optimizer_state_bytes", "peak_rss_bytes")}
    ratios["step_s"] = fsdp["rank0"]["step_s"] / single["rank0"]["step_s"]
    result = {"benchmark": "fsdp", **args, "world": a.world, "single": single, "fsdp": fsdp, "ratios": ratios,
              "loss_abs_diff": abs(fsdp["loss_first"] - single["loss_first"])}
    line = json.dumps(result)
    print(line)
    if a.json:
        Path(a.json).write_text(line + "\n")
    return result


if __name__ == "__main__":
    main()
