"""Behaviour weight under truncated sampling (issue 10, section 1): at staleness 0 the trainer's
log-probs must equal the engine's, whatever top-p / top-k / min-p the engine samples with.

Usage: python benchmarks/behaviour_weight.py [--model smollm2-135m-instruct] [--updates 3]
       [--batch-size 2] [--group-size 4] [--max-new-tokens 64] [--temperature 0.6]
       [--top-p 1.0,0.9,0.5] [--top-k 0,20] [--min-p 0] [--lr 1e-7] [--kl-coef 0]
       [--fp32] [--threads 2] [--engine-dtype float32|bfloat16] [--no-replay | --compare] [--quick]
       [--output FILE.json]

For every cell (top_p x top_k x min_p) a fresh trainer and engine (copies of the same initial
weights) run ``--updates`` synchronous updates (``async.eta=0``: every token is sampled by the
trainer's current parameters) with the two-ratio loss (``loss.name=two_ratio``, proximal
``recompute``) and a tiny learning rate, through the real rollout path: the MAWPS training
prompts, the default workflow (calculator tool, rewards in the isolated reward service), the
engine's ``SamplingParams`` and ``Trainer.train_step``. Per cell it reports the token-weighted
mean and std of the behaviour weight ``pi_proximal / pi_behaviour`` (the loss's discrepancy
ratio, ``loss/discrepancy_mean``; at staleness 0 the proximal policy is the current one), the
discrepancy keep-rate (share of tokens with the ratio in ``[loss.discrepancy_low,
loss.discrepancy_high]`` = [0.8, 1.25], ``loss/discrepancy_keep_frac``) and the size of the kept
sets (ids per action token; 0 cells are untruncated) with their storage cost.

Precision: the trainer runs its forward passes under bf16 autocast where the CPU computes bf16
fast (``trainer.bf16=auto``, the default; ``--bf16`` forces it) while the engine samples in fp32,
so the ratio then also carries bf16 rounding noise (on SmolLM2 at T = 0.6 a std of ~0.05-0.17 and
a few % of tokens outside the band, with or without truncation); ``--fp32``
(``trainer.bf16=false``) isolates the sampling semantics: the ratio is then 1 to float rounding. ``--kl-coef`` (default 0: no reference model
pass, to save time; the replay of the reference pass is unit-tested).

``--no-replay`` drops the recorded sampling masks before training, reproducing the defect the
replay fixes (trainer log-probs over the full vocabulary). ``--compare`` trains with replay and
also measures, on the same batches and parameters, the ratio the trainer would see without it
(one extra no-grad pass over the full vocabulary: the figures of the old defect at half the
cost of a second run).

Prints one JSON line per cell, a markdown table and a final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _unreplayed_ratios(trainer, trajs):
    """``pi_trainer / pi_behav`` over the FULL vocabulary (the sets dropped) for every action
    token of ``trajs``, with the trainer's current parameters, packing and numerics: ``[n]``."""
    import dataclasses

    import torch

    from conveyor.trainer.batch import pack, plan_micro_batches

    stripped = [dataclasses.replace(t, sampling_mask=None) for t in trajs]
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in stripped]
    cfg = trainer.cfg
    out = []
    for rows in plan_micro_batches(lengths, cfg.micro_batch_tokens, cfg.pack_row_tokens):
        mb = pack(stripped, torch.zeros(len(stripped)), rows)
        with torch.no_grad():
            lp, _ = trainer._logprobs(trainer.model, mb)
        m = mb.mask > 0
        out.append(torch.exp(lp[m] - mb.behaviour_logprobs[m]))
    return torch.cat(out)


def run_cell(
    base_model,
    tokenizer,
    cfg,
    samples,
    reward_service,
    *,
    top_p: float,
    top_k: int,
    min_p: float,
    updates: int,
    replay: bool,
    threads: int,
    compare: bool = False,
) -> dict:
    """``updates`` synchronous updates with one sampling setting; returns the cell's figures."""
    import torch

    from conveyor.rollout.engine import InferenceEngine, SamplingParams
    from conveyor.rollout.workflow import SingleTurnMathWorkflow
    from conveyor.trainer.trainer import Trainer

    rc, B = cfg.rollout, cfg.trainer.batch_size
    policy = copy.deepcopy(base_model)
    engine_model = copy.deepcopy(base_model).eval()
    for p in engine_model.parameters():
        p.requires_grad_(False)
    trainer = Trainer(
        policy,
        cfg.trainer,
        cfg.loss,
        temperature=rc.temperature,
        proximal_cfg=cfg.proximal,
        eta=0,
        max_new_tokens=rc.max_new_tokens,
    )
    engine = InferenceEngine(
        engine_model,
        tokenizer,
        max_batch_size=rc.max_batch_size,
        seed=cfg.run.seed,
        num_threads=threads,
        dtype=getattr(torch, rc.engine_dtype),  # rollout.engine_dtype (--engine-dtype)
    )
    params = SamplingParams(
        max_new_tokens=rc.max_new_tokens,
        temperature=rc.temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
    )
    workflow = SingleTurnMathWorkflow(
        tokenizer,
        reward_service,
        params,
        group_size=rc.group_size,
        instruction=cfg.data.instruction or "",
        tool=rc.tool,
        max_tool_calls=rc.max_tool_calls,
    )
    steps, sizes, unreplayed = [], [], []
    t0 = time.perf_counter()
    engine.start()
    try:
        for u in range(updates):
            batch_samples = samples[u * B : (u + 1) * B]

            async def episodes(batch_samples=batch_samples):
                return await asyncio.gather(
                    *[workflow.run_episode(engine, s) for s in batch_samples]
                )

            trajs = [t for group in asyncio.run(episodes()) if group for t in group]
            for t in trajs:
                act = (
                    torch.ones(len(t.response_ids), dtype=torch.bool)
                    if t.action_mask is None
                    else torch.as_tensor(t.action_mask, dtype=torch.bool)
                )
                s = (
                    t.sampling_mask.sizes()
                    if t.sampling_mask is not None
                    else torch.zeros(len(act), dtype=torch.long)
                )
                sizes += s[act].tolist()
                if not replay:
                    t.sampling_mask = None  # the old defect: full-vocabulary trainer log-probs
            if compare:
                unreplayed.append(_unreplayed_ratios(trainer, trajs))
            m = trainer.train_step(trajs)
            steps.append(
                {
                    k: m[k]
                    for k in (
                        "loss/num_tokens",
                        "loss/discrepancy_mean",
                        "loss/discrepancy_std",
                        "loss/discrepancy_keep_frac",
                        "loss/discrepancy_min",
                        "loss/discrepancy_max",
                        "reward/mean",
                        "train/entropy",
                    )
                }
            )
            engine.update_weights(trainer.weight_update())
    finally:
        engine.stop()
    n = sum(s["loss/num_tokens"] for s in steps)
    mean = sum(s["loss/discrepancy_mean"] * s["loss/num_tokens"] for s in steps) / n
    second = (
        sum(
            (s["loss/discrepancy_std"] ** 2 + s["loss/discrepancy_mean"] ** 2)
            * s["loss/num_tokens"]
            for s in steps
        )
        / n
    )
    qs = (
        statistics.quantiles(sizes, n=100, method="inclusive")
        if len(sizes) > 1
        else [float(sizes[0])] * 99
    )
    size_mean = sum(sizes) / len(sizes)
    without = None
    if unreplayed:  # the same batches, the sets dropped (the old defect)
        r = torch.cat(unreplayed).double()
        lo, hi = cfg.loss.discrepancy_low, cfg.loss.discrepancy_high
        without = {
            "weight_mean": float(r.mean()),
            "weight_std": float(r.std(unbiased=False)),
            "keep_frac": float(((r >= lo) & (r <= hi)).double().mean()),
        }
    return {
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "replay": replay,
        "updates": updates,
        "tokens": int(n),
        "weight_mean": mean,
        "weight_std": math.sqrt(max(second - mean * mean, 0.0)),
        "weight_min": min(s["loss/discrepancy_min"] for s in steps),
        "weight_max": max(s["loss/discrepancy_max"] for s in steps),
        "keep_frac": sum(s["loss/discrepancy_keep_frac"] * s["loss/num_tokens"] for s in steps) / n,
        "support_mean": size_mean,
        "support_p50": qs[49],
        "support_p99": qs[98],
        "support_max": max(sizes),
        # CSR: 4 bytes per kept id + 8 bytes of offset per token (0 when nothing is truncated)
        "mask_bytes_per_token": 4 * size_mean + 8 if size_mean > 0 else 0.0,
        "reward_mean": sum(s["reward/mean"] for s in steps) / len(steps),
        "seconds": time.perf_counter() - t0,
        "without_replay_same_batches": without,
    }


def table(cells: list[dict]) -> str:
    """The markdown table of the cells."""
    head = (
        "| top_p | top_k | min_p | replay | tokens | mean weight | std | min | max | keep-rate "
        "| kept ids / token (mean, p50, p99, max) | mask bytes / token |"
    )
    compare = any(c.get("without_replay_same_batches") for c in cells)
    if compare:
        head += " without replay, same batches: mean weight, keep-rate |"
    rows = [head, "|" + "---|" * (13 if compare else 12)]
    for c in cells:
        replay = "yes" if c["replay"] else "no"
        sizes = f"{c['support_mean']:.1f}, {c['support_p50']:.0f}, {c['support_p99']:.0f}, "
        sizes += str(c["support_max"])
        rows.append(
            f"| {c['top_p']} | {c['top_k']} | {c['min_p']} | {replay} | {c['tokens']} "
            f"| {c['weight_mean']:.4f} | {c['weight_std']:.4f} | {c['weight_min']:.3f} "
            f"| {c['weight_max']:.3f} | {c['keep_frac']:.4f} | {sizes} "
            f"| {c['mask_bytes_per_token']:.0f} |"
        )
        w = c.get("without_replay_same_batches")
        if compare:
            rows[-1] += f" {w['weight_mean']:.4f}, {w['keep_frac']:.4f} |" if w else " |"
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--updates", type=int, default=3, help="synchronous updates per cell")
    ap.add_argument("--batch-size", type=int, default=2, help="prompts per update")
    ap.add_argument("--group-size", type=int, default=4, help="responses per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top-p", default="1.0,0.9,0.5")
    ap.add_argument("--top-k", default="0,20")
    ap.add_argument("--min-p", default="0")
    ap.add_argument("--lr", type=float, default=1e-7)
    ap.add_argument("--kl-coef", type=float, default=0.0)
    ap.add_argument("--fp32", action="store_true", help="trainer.bf16=false (fp32 trainer passes)")
    ap.add_argument("--bf16", action="store_true",
                    help="trainer.bf16=true (default: auto, bf16 where the CPU computes it fast)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="rollout.engine_dtype: the engine's weights (bfloat16: faster decoding, wider spread)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--no-replay", action="store_true", help="drop the sampling masks (the old defect)"
    )
    mode.add_argument(
        "--compare",
        action="store_true",
        help="train with replay; also measure the unreplayed ratio on the same batches",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny model, 1 update, 1 x 2 responses, top_p {1, 0.5} x top_k {0, 20}",
    )
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.updates, args.batch_size, args.group_size, args.max_new_tokens = (
            "tiny",
            1,
            1,
            2,
            12,
        )
        args.top_p, args.top_k = "1.0,0.5", "0,20"

    import torch

    from conveyor.config import load_config
    from conveyor.data import load_dataset
    from conveyor.models import load_model
    from conveyor.rewards import ANSWER_METRICS, RewardService

    torch.set_num_threads(args.threads)
    cfg = load_config(
        None,
        [
            f"model.name={args.model}",
            "async.eta=0",
            "loss.name=two_ratio",
            "proximal.method=recompute",
            f"trainer.lr={args.lr}",
            "trainer.warmup_steps=0",
            f"trainer.batch_size={args.batch_size}",
            f"rollout.group_size={args.group_size}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            f"rollout.temperature={args.temperature}",
            f"loss.kl_coef={args.kl_coef}",
            f"trainer.bf16={'false' if args.fp32 else ('true' if args.bf16 else 'auto')}",
            f"rollout.engine_dtype={args.engine_dtype}",
        ],
    )
    samples = load_dataset(cfg.data.train, split_seed=cfg.data.split_seed)[
        : args.updates * args.batch_size
    ]
    lm = load_model(cfg.model.name, seed=cfg.model.seed)
    cells = []
    with RewardService(
        cfg.reward.fn,
        timeout_s=cfg.reward.timeout_s,
        failure_score=cfg.reward.failure_score,
        max_workers=1,
        metrics=ANSWER_METRICS,
    ) as rewards:
        for top_p, top_k, min_p in itertools.product(
            _floats(args.top_p), _floats(args.top_k), _floats(args.min_p)
        ):
            c = run_cell(
                lm.model,
                lm.tokenizer,
                cfg,
                samples,
                rewards,
                top_p=top_p,
                top_k=int(top_k),
                min_p=min_p,
                updates=args.updates,
                replay=not args.no_replay,
                threads=args.threads,
                compare=args.compare,
            )
            print(json.dumps(c), flush=True)
            cells.append(c)
    print(table(cells))
    result = {
        "model": args.model,
        "temperature": args.temperature,
        "updates": args.updates,
        "batch": [args.batch_size, args.group_size],
        "max_new_tokens": args.max_new_tokens,
        "lr": args.lr,
        "engine_dtype": cfg.rollout.engine_dtype,
        "bf16": cfg.trainer.bf16,  # as configured ("auto" is resolved by the trainer, see its log)
        "kl_coef": cfg.loss.kl_coef,
        "cells": cells,
    }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
