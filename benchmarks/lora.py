"""LoRA against full fine-tuning: trainable parameters, optimizer state and weight-sync cost per
version (issue 15 section 2), every figure measured in this one process run.

Usage: python benchmarks/lora.py [--model smollm2-135m-instruct|tiny] [--rank 8] [--alpha 16]
       [--target-modules q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]
       [--trajectories 8] [--repeats 5] [--threads 2] [--quick] [--json FILE.json]

Three configurations of the same model (each a fresh ``copy.deepcopy`` of it, its trainer and
AdamW; fp32, ``trainer.bf16=false``, ``loss.kl_coef=0``):

- ``full``: full fine-tuning (every parameter trains, the engine receives every tensor, tied
  embeddings once);
- ``lora_merged``: LoRA (``lora.enabled=true``), the engine receives the adapted weight matrices
  ``W0 + (alpha / r) B A`` of the targeted modules (``lora.sync=merged``);
- ``lora_adapter``: the same trainer, the engine receives only ``A``, ``B`` and the scale and
  merges them onto its own copy of ``W0`` (``lora.sync=adapter``).

Each trainer takes one policy update on ``--trajectories`` synthetic responses (random token ids,
groups of 4 with different rewards, so every group has non-zero advantages), which allocates
AdamW's moments. Then per configuration:

- ``trainable_parameters``: elements of the optimizer's parameters;
- ``optimizer_state_bytes``: bytes of every tensor in the optimizer state (AdamW: ``exp_avg``,
  ``exp_avg_sq``, ``step``);
- ``message_bytes``: :attr:`conveyor.sync.WeightUpdate.num_bytes` of the trainer's message for
  one version;
- ``sync_s``: seconds per sync, median over ``--repeats``: building the message
  (``Trainer.weight_update``, ``snapshot_s``) plus an idle in-process engine applying it
  (``InferenceEngine.update_weights``, ``apply_s``: the copy, or the merge for ``lora_adapter``);
  the engine's interruption of in-flight requests (``benchmarks/weight_sync.py``) comes on top
  and is the same for every row;
- ``lora_adapter`` also reports ``engine_lora_base_bytes``: the copy of ``W0`` of every adapted
  matrix that an engine receiving adapters keeps (its ``lora_base``).

``ratios`` divide the LoRA rows by ``full``; ``engine_max_abs_diff`` is the largest difference
between the weights of the two LoRA engines after the last sync (both modes must give the
engine the same weights). Prints one JSON line (also written to ``--json``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def synthetic_batch(n: int, vocab: int, seed: int = 0):
    """``n`` trajectories in groups of 4 (prompts of 40 tokens, responses of 24-48 tokens, random
    ids), rewards 0, 0.25, 0.5, 0.75 within each group (non-zero GRPO advantages)."""
    import torch

    from conveyor.types import Sample, Trajectory

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        k = i // 4
        prompt = torch.randint(3, vocab, (40,), generator=torch.Generator().manual_seed(seed * 1000 + k)).tolist()
        resp = torch.randint(3, vocab, (24 + (i * 7) % 25,), generator=g).tolist()
        out.append(Trajectory(sample=Sample(f"s{k}", "q", "1", "bench"), group_id=f"g{k}", prompt_ids=prompt,
                              response_ids=resp, behaviour_logprobs=[-10.0] * len(resp), versions=[0] * len(resp),
                              reward=0.25 * (i % 4)))
    return out


def optimizer_state_bytes(opt) -> int:
    """Bytes of every tensor in ``opt.state``."""
    import torch

    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def time_syncs(engine, make_update, repeats: int, version: int) -> tuple[dict, int]:
    """Median seconds of building (``make_update(version)``) and applying a message; the message
    size; the next free version."""
    snaps, applies, nbytes = [], [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        upd = make_update(version)
        t1 = time.perf_counter()
        engine.update_weights(upd)
        t2 = time.perf_counter()
        snaps.append(t1 - t0)
        applies.append(t2 - t1)
        nbytes = upd.num_bytes
        version += 1
    s, a = statistics.median(snaps), statistics.median(applies)
    return {"message_bytes": nbytes, "sync_s": s + a, "snapshot_s": s, "apply_s": a}, version


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--target-modules", default=DEFAULT_TARGETS)
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny model, 4 trajectories, 2 repeats (CI smoke run)")
    ap.add_argument("--json", default=None, help="also write the result to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.trajectories, args.repeats = "tiny", 4, 2

    import torch

    from conveyor.config import LoraConfig, LossConfig, TrainerConfig
    from conveyor.models import load_model
    from conveyor.rollout.engine import InferenceEngine
    from conveyor.sync import WeightUpdate
    from conveyor.trainer.trainer import Trainer

    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    vocab = lm.model.get_input_embeddings().num_embeddings
    batch = synthetic_batch(args.trajectories, vocab)
    tc = TrainerConfig(lr=1e-5, warmup_steps=0, bf16=False)
    lc = LossConfig(kl_coef=0.0)
    total = sum(p.numel() for p in lm.model.parameters())

    def plain_engine(model, **kw):
        model = model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return InferenceEngine(model, lm.tokenizer, num_threads=1, **kw)

    # full fine-tuning
    tr = Trainer(copy.deepcopy(lm.model), tc, lc)
    m = tr.train_step(batch)
    full = {"trainable_parameters": sum(p.numel() for p in tr.policy.params),
            "optimizer_state_bytes": optimizer_state_bytes(tr.optimizer), "train_step_s": m["time/train_step_s"]}
    # Trainer.weight_update, stamped with increasing versions (the engine accepts nothing else)
    sync, _ = time_syncs(plain_engine(copy.deepcopy(lm.model)), lambda v: WeightUpdate.from_model(tr.model, v),
                         args.repeats, 1)
    full.update(sync)
    del tr
    gc.collect()

    # LoRA: one trainer, both sync modes
    lcfg = LoraConfig(enabled=True, rank=args.rank, alpha=args.alpha, target_modules=args.target_modules.split(","))
    tr = Trainer(copy.deepcopy(lm.model), tc, lc, lora_cfg=lcfg)
    m = tr.train_step(batch)
    lora = {"trainable_parameters": sum(p.numel() for p in tr.policy.params),
            "optimizer_state_bytes": optimizer_state_bytes(tr.optimizer), "train_step_s": m["time/train_step_s"],
            "adapted_modules": len(tr.lora.layers)}
    engines = {"merged": plain_engine(copy.deepcopy(lm.model)),
               "adapter": plain_engine(copy.deepcopy(lm.model), lora_base=tr.lora.base_weights())}
    rows = {}
    for sync_mode, eng in engines.items():
        rows[f"lora_{sync_mode}"], _ = time_syncs(eng, lambda v, s=sync_mode: tr.lora.weight_update(v, s),
                                                  args.repeats, 1)
    # adapter mode's price on the engine side: it keeps W0 of every adapted matrix
    rows["lora_adapter"]["engine_lora_base_bytes"] = sum(t.numel() * t.element_size()
                                                         for t in tr.lora.base_weights().values())
    a, b = engines["merged"].model.state_dict(), engines["adapter"].model.state_dict()
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)

    def ratio(x: float, y: float) -> float | None:
        return x / y if y else None

    res = {
        "model": args.model, "rank": args.rank, "alpha": args.alpha, "target_modules": lcfg.target_modules,
        "parameters": total, "threads": args.threads, "repeats": args.repeats,
        "full": full, "lora": lora, **rows,
        "ratios": {
            "trainable_parameters_lora_over_full": ratio(lora["trainable_parameters"], full["trainable_parameters"]),
            "optimizer_state_lora_over_full": ratio(lora["optimizer_state_bytes"], full["optimizer_state_bytes"]),
            "message_bytes_merged_over_full": ratio(rows["lora_merged"]["message_bytes"], full["message_bytes"]),
            "message_bytes_adapter_over_full": ratio(rows["lora_adapter"]["message_bytes"], full["message_bytes"]),
            "sync_s_merged_over_full": ratio(rows["lora_merged"]["sync_s"], full["sync_s"]),
            "sync_s_adapter_over_full": ratio(rows["lora_adapter"]["sync_s"], full["sync_s"]),
        },
        "engine_max_abs_diff": diff,
        "cpu_count": os.cpu_count(), "torch": torch.__version__,
    }
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res



if __name__ == "__main__":
    main(sys.argv[1:])
