"""Cost of critic-based (SAO) training against GRPO: seconds and peak memory of one update on the
same tokens, every row measured in this one process run (MISSION.md section 3).

Usage: python benchmarks/critic.py [--model smollm2-135m-instruct|tiny] [--trajectories 16]
       [--repeats 3] [--threads 2] [--bf16 auto|true|false] [--critic-layers 2] [--lr 1e-6]
       [--seed 0] [--quick] [--json FILE.json]

The batch: ``--trajectories`` responses of SmolLM2-like lengths (random token ids, fixed seed):
prompts of 60-110 tokens, responses long-tailed over 20-96 tokens (log-normal, median 35); half
of them carry a tool observation of 8-12 tokens inside the response (``action_mask`` 0 there: no
policy loss, no value loss, skipped by GAE). Rewards 0/1. Behaviour log-probs are the loaded
model's own (fp32, at the sampling temperature), so importance ratios start near 1 as in a real
run. Two layouts of the same token counts:

- **GRPO**: groups of 4 responses to one prompt (``group_id`` shared; the trainer packs a group's
  prompt once, ``trainer.share_prompts``, the default);
- **single responses** (SAO: one response per prompt): every response its own prompt, of the
  length its GRPO group's prompt has, so prompt, response and action token counts are identical.

Rows (each builds a fresh ``copy.deepcopy`` of the loaded model, its trainer and optimizer, so
rows do not influence each other; one warm-up update, then ``--repeats`` timed updates, median):

1. ``grpo``: ``loss.name=decoupled_ppo``, ``loss.advantage=grpo``, the GRPO layout;
2. ``grpo, prompts not shared``: the same with ``trainer.share_prompts=false`` (every response
   packed behind its own prompt copy: the transformer work of the single-response layout, without
   a critic; separates the cost of the critic from the cost of not sharing prompts);
3. ``sao``: ``loss.name=dis``, ``loss.advantage=gae``, ``CriticConfig(updates_per_step=2,
   freeze_attention=True)`` (the critic a full copy of the policy), the single-response layout;
   this and every other SAO row run the critic's value pass of their own
   (``critic.separate_value_pass=true``), so the split below separates value inference;
4. ``sao, values from the first update``: row 3 with ``critic.separate_value_pass=false`` (the
   default): the values come from the first of the K updates' forward passes, one critic forward
   pass per step fewer (its ``score s`` is 0: the values are inside ``critic s``);
5. ``sao K=1``; 6. ``sao attention trained`` (``freeze_attention=False``); 7. ``sao critic
   policy:L`` (the critic's backbone the policy's first ``--critic-layers`` layers); 8. ``sao critic
   head`` (AsyPPO's lightweight critic: a two-layer head on the policy's detached hidden states,
   ``critic.backbone=head``); 9. ``sao 2 head critics (asyppo)`` (``critic.num_critics=2``);
10. ``sao critic lora r8`` (row 3 with LoRA adapters of rank 8 on the critic's backbone,
   ``critic.lora_rank=8``: only the adapters and the value head train; needs peft).

KL is off in every row (``loss.kl_coef=0``: no reference model, no reference pass), so the
comparison isolates the critic. Per row: seconds per update (wall clock around
``Trainer.train_step``) and its ratio to the GRPO row; for the SAO rows the split from the step's
metrics: the K critic updates (``time/critic_s`` minus ``time/critic_values_s``), the critic's
value forward pass in the score phase (``time/critic_values_s``) and the rest (policy
forward / backward / AdamW step, GAE, packing, metrics); ``critic/updates`` (critic optimiser steps
taken per update, the fewest over the row's updates: K unless one was skipped); peak memory;
tokens (loss tokens = action tokens; forward positions = packed non-padding positions).

FLOPs (``torch.utils.flop_counter.FlopCounterMode``: matrix products and attention, counted from
the shapes, so exact and independent of the machine's load; elementwise work is not counted):
``gflop_step``, one more update after the timed ones; ``gflop_values``, the score phase alone,
which with KL off and the proximal log-probs taken from the update's own forward pass is the
critic's value inference (0 where the values come from the first critic update);
``critic_gflop``, a row's update minus the update of row 2 (no critic, the same single-response
layout), i.e. the critic's value inference plus its K updates (needs row 2 in the run).

Peak memory: the process's resident-set high-water mark (``VmHWM``) over the row (model copy,
trainer construction, warm-up and timed updates) minus the resident set just before the row,
after ``gc.collect()`` and ``malloc_trim``. ``ru_maxrss`` (what ``benchmarks/trainer.py`` reads,
one child process per figure) cannot be reset within a process, so the mark is reset per row by
writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0); where that is not possible the memory
columns are null. Allocator reuse across rows can make a later row's delta slightly optimistic.

Prints a markdown table and a final JSON line (also written to ``--json``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

GROUP = 4  # GRPO responses per prompt


# ----------------------------------------------------------------------------- memory
def _status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset the resident-set high-water mark (``VmHWM``) to the current resident set."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _gb(kb: int | None) -> float | None:
    return None if kb is None else kb / 1024**2


# ----------------------------------------------------------------------------- batch
def make_batches(model, *, n: int, vocab: int, temperature: float, seed: int):
    """The GRPO layout and the single-response layout of the same token counts (module doc)."""
    import torch

    from conveyor.types import Sample, Trajectory

    rng = random.Random(seed)
    n_groups = math.ceil(n / GROUP)
    group_prompt_len = [rng.randint(60, 110) for _ in range(n_groups)]
    group_prompts = [[rng.randrange(vocab) for _ in range(p)] for p in group_prompt_len]
    specs = []
    for i in range(n):
        g = i // GROUP
        r_len = min(96, max(20, round(math.exp(rng.gauss(math.log(35), 0.5)))))
        response = [rng.randrange(vocab) for _ in range(r_len)]
        mask = [1] * r_len
        if i % 2:  # a tool observation inside the response: action_mask 0
            obs = rng.randint(8, 12)
            start = rng.randint(r_len // 4, r_len // 2)
            mask[start : start + obs] = [0] * obs
        own_prompt = [rng.randrange(vocab) for _ in range(group_prompt_len[g])]
        specs.append((g, own_prompt, response, mask, float(rng.random() < 0.5)))

    def behaviour(prompt: list[int], response: list[int]) -> list[float]:
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        return lp.tolist()

    def traj(i: int, gid: str, prompt: list[int], response: list[int], mask: list[int], reward: float):
        sample = Sample(id=f"bench/{gid}", question="q", answer="0", dataset="bench")
        return Trajectory(sample=sample, group_id=gid, prompt_ids=list(prompt), response_ids=list(response),
                          behaviour_logprobs=behaviour(prompt, response), versions=[0] * len(response),
                          reward=reward, action_mask=list(mask))

    model.eval()
    grpo = [traj(i, f"g{g}", group_prompts[g], resp, mask, rew) for i, (g, _, resp, mask, rew) in enumerate(specs)]
    single = [traj(i, f"s{i}", own, resp, mask, rew) for i, (_, own, resp, mask, rew) in enumerate(specs)]
    return grpo, single


# ----------------------------------------------------------------------------- rows
def rows_spec(critic_layers: int) -> list[dict]:
    sao = {"loss": "dis", "advantage": "gae", "layout": "single"}
    return [
        {"name": "grpo", "loss": "decoupled_ppo", "advantage": "grpo", "layout": "grpo"},
        {"name": "grpo, prompts not shared", "loss": "decoupled_ppo", "advantage": "grpo", "layout": "grpo",
         "share_prompts": False},
        {"name": "sao", **sao, "K": 2, "freeze_attention": True, "backbone": "policy"},
        # the default since 2026-12-04: the values from the first critic update's forward pass
        {"name": "sao, values from the first update", **sao, "K": 2, "freeze_attention": True, "backbone": "policy",
         "separate_value_pass": False},
        {"name": "sao K=1", **sao, "K": 1, "freeze_attention": True, "backbone": "policy"},
        {"name": "sao attention trained", **sao, "K": 2, "freeze_attention": False, "backbone": "policy"},
        {"name": f"sao critic policy:{critic_layers}", **sao, "K": 2, "freeze_attention": True,
         "backbone": f"policy:{critic_layers}"},
        # AsyPPO's lightweight critics (MISSION.md section 4): a two-layer head on the policy's
        # detached hidden states, alone and as an ensemble of two (issue 13)
        {"name": "sao critic head", **sao, "K": 2, "freeze_attention": True, "backbone": "head"},
        {"name": "sao 2 head critics (asyppo)", **sao, "K": 2, "freeze_attention": True, "backbone": "head",
         "num_critics": 2},
        # LoRA on the full critic's backbone (critic.lora_rank; issue 15); skipped without peft
        *([{"name": "sao critic lora r8", **sao, "K": 2, "freeze_attention": True, "backbone": "policy",
            "lora_rank": 8}] if importlib.util.find_spec("peft") is not None else []),
    ]


def run_row(base_model, batch, spec: dict, *, repeats: int, bf16, lr: float, temperature: float,
            seed: int) -> dict:
    """One row: a fresh model copy and trainer, one warm-up update, ``repeats`` timed updates."""
    import torch

    from conveyor.config import CriticConfig, LossConfig, TrainerConfig
    from conveyor.memory import release_free_memory
    from conveyor.trainer import critic as critic_lib
    from conveyor.trainer.trainer import Trainer

    gc.collect()
    release_free_memory()
    rss_before = _status_kb("VmRSS")
    can_peak = _reset_peak()
    torch.manual_seed(seed)
    model = copy.deepcopy(base_model)
    tcfg = TrainerConfig(lr=lr, warmup_steps=0, bf16=bf16, share_prompts=spec.get("share_prompts", True))
    lcfg = LossConfig(name=spec["loss"], advantage=spec["advantage"], kl_coef=0.0)
    ccfg = None
    if spec["advantage"] == "gae":
        ccfg = CriticConfig(updates_per_step=spec["K"], freeze_attention=spec["freeze_attention"],
                            backbone=spec["backbone"], num_critics=spec.get("num_critics", 1),
                            separate_value_pass=spec.get("separate_value_pass", True),
                            lora_rank=spec.get("lora_rank", 0))
    trainer = Trainer(model, tcfg, lcfg, temperature=temperature, critic_cfg=ccfg)

    mbs = trainer.pack(batch).micro_batches
    positions = sum(int((mb.seq_index >= 0).sum()) for mb in mbs)
    loss_tokens = sum(mb.num_tokens for mb in mbs)

    steps = []
    for _ in range(1 + repeats):  # the first is the warm-up
        t0 = time.perf_counter()
        m = trainer.train_step(batch)
        steps.append((time.perf_counter() - t0, m))
    peak = _status_kb("VmHWM") if can_peak else None
    # FLOPs (matrix products and attention, torch.utils.flop_counter): one more update, untimed,
    # and the score phase alone (KL off and the proximal log-probs from the update's own forward:
    # the critic's value inference, 0 where the values come from the first critic update)
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        trainer.train_step(batch)
    flop_step = fc.get_total_flops()
    with FlopCounterMode(display=False) as fc:
        trainer.score(trainer.pack(batch), skip_values=trainer.folds_value_pass)
    flop_score = fc.get_total_flops()
    timed = steps[1:]
    secs = [s for s, _ in timed]
    # time/critic_s = the K updates + the score phase's value forward (time/critic_values_s)
    sc = [m.get("time/critic_values_s", 0.0) for _, m in timed]
    critic_s = [m.get("time/critic_s", 0.0) - v for (_, m), v in zip(timed, sc)]
    med = statistics.median(secs)
    row = {
        **spec,
        "seconds": med,
        "seconds_all": secs,
        "critic_s": statistics.median(critic_s),
        "score_s": statistics.median(sc),
        "rest_s": statistics.median([s - c - v for s, c, v in zip(secs, critic_s, sc)]),
        "warmup_s": steps[0][0],
        "gflop_step": flop_step / 1e9,
        "gflop_values": flop_score / 1e9,
        "tokens": loss_tokens,
        "positions": positions,
        "trajectories": len(batch),
        "peak_rss_gb": _gb(peak),
        "peak_delta_gb": _gb(peak - rss_before) if peak is not None and rss_before is not None else None,
        "train/skipped_nonfinite": max(m["train/skipped_nonfinite"] for _, m in steps),
    }
    if trainer.critic is not None:
        row["critic/updates"] = min(m["critic/updates"] for _, m in steps)
        row["critic/skipped_nonfinite"] = max(m["critic/skipped_nonfinite"] for _, m in steps)
        row["critic/value_loss"] = timed[-1][1].get("critic/value_loss")
        row["critic_params"] = sum(sum(critic_lib.param_count_by_kind(c).values()) for c in trainer.critics)
        row["critic_trainable_params"] = sum(sum(critic_lib.param_count_by_kind(c, trainable_only=True).values())
                                             for c in trainer.critics)
    row["precision_note"] = trainer.precision_note
    del trainer, model, steps, timed, mbs
    gc.collect()
    release_free_memory()
    return row


def table(rows: list[dict]) -> str:
    """The markdown table of the rows (ratios against the first row, GRPO)."""
    head = ("| row | s / update | x GRPO | critic s (K updates) | score s (value fwd) | rest s | peak GB | x GRPO "
            "| critic/updates | loss tokens | forward positions | GFLOP / update | critic GFLOP | value GFLOP |")
    out = [head, "|" + "---|" * 14]

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    for r in rows:
        out.append(
            f"| {r['name']} | {r['seconds']:.3f} | {r['ratio_seconds']:.2f} | {r['critic_s']:.3f} "
            f"| {r['score_s']:.3f} | {r['rest_s']:.3f} | {f(r['peak_delta_gb'], '.3f')} "
            f"| {f(r['ratio_memory'], '.2f')} | {f(r.get('critic/updates'), '.0f')} | {r['tokens']} | {r['positions']} "
            f"| {r['gflop_step']:.1f} | {f(r.get('critic_gflop'), '.1f')} | {r['gflop_values']:.1f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="timed updates per row after one warm-up (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", choices=["auto", "true", "false"], default="auto",
                    help="trainer.bf16 (auto: bf16 autocast where the CPU computes it fast)")
    ap.add_argument("--critic-layers", type=int, default=2, help="L of the 'policy:L' critic row")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny model, 8 trajectories, 1 repeat (CI smoke run)")
    ap.add_argument("--rows", default=None,
                    help="comma-separated row numbers of the list above (e.g. 3,4); row 1 (GRPO, the ratios' "
                         "reference) always runs")
    ap.add_argument("--json", default=None, help="also write the result to this file")
    args = ap.parse_args(argv)
    if args.quick:
        # the tiny model has 2 layers: policy:1 keeps the truncated-critic row distinct
        args.model, args.trajectories, args.repeats, args.critic_layers = "tiny", 8, 1, 1
    specs = rows_spec(args.critic_layers)
    if args.rows:
        try:
            wanted = {int(x) for x in args.rows.split(",") if x.strip()}
        except ValueError:
            ap.error(f"--rows {args.rows!r}: comma-separated row numbers 1-{len(specs)} expected")
        if not wanted <= set(range(1, len(specs) + 1)):
            ap.error(f"--rows {args.rows!r}: row numbers 1-{len(specs)} expected")
        specs = [s for i, s in enumerate(specs, 1) if i == 1 or i in wanted]

    import torch

    from conveyor.models import load_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    bf16 = {"auto": "auto", "true": True, "false": False}[args.bf16]
    lm = load_model(args.model)
    base = lm.model
    grpo, single = make_batches(base, n=args.trajectories, vocab=base.config.vocab_size,
                                temperature=args.temperature, seed=args.seed)
    rows = []
    for spec in specs:
        r = run_row(base, grpo if spec["layout"] == "grpo" else single, spec, repeats=args.repeats, bf16=bf16,
                    lr=args.lr, temperature=args.temperature, seed=args.seed)
        ref = rows[0] if rows else r
        r["ratio_seconds"] = r["seconds"] / ref["seconds"]
        r["ratio_memory"] = (r["peak_delta_gb"] / ref["peak_delta_gb"]
                             if r["peak_delta_gb"] is not None and ref["peak_delta_gb"] else None)
        print(json.dumps({k: v for k, v in r.items() if k != "precision_note"}), flush=True)
        rows.append(r)
    # the critic's FLOPs: a row's update minus the no-critic update on the same single-response layout
    nocritic = next((r for r in rows if r["name"] == "grpo, prompts not shared"), None)
    for r in rows:
        if nocritic is not None and r["advantage"] == "gae":
            r["critic_gflop"] = r["gflop_step"] - nocritic["gflop_step"]
    print(f"\nmodel {args.model}, {args.trajectories} trajectories, {args.threads} threads, "
          f"{rows[0]['precision_note']}; KL off (loss.kl_coef=0) in every row, so the comparison isolates the critic; "
          f"median of {args.repeats} update(s) after one warm-up; peak GB = resident-set high-water mark over the "
          "row minus the resident set before it; ratios against the grpo row, all measured in this run.\n")
    print(table(rows))
    result = {
        "model": args.model,
        "trajectories": args.trajectories,
        "group_size": GROUP,
        "repeats": args.repeats,
        "threads": args.threads,
        "bf16": args.bf16,
        "precision_note": rows[0]["precision_note"],
        "kl_coef": 0.0,
        "lr": args.lr,
        "temperature": args.temperature,
        "seed": args.seed,
        "cpu_count": os.cpu_count(),
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
