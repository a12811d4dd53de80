"""Trainer throughput and peak memory of one policy update: conveyor's trainer vs a naive
baseline, same model, data and threads, each in a fresh process (issue 5; bars: peak memory
<= 3 GB and >= 2x tokens/s against the baseline, both measured in the same run).

Usage: python benchmarks/trainer.py [--model smollm2-135m-instruct|tiny] [--sequences 32]
       [--prompt-len 60] [--response-len 50] [--threads 2] [--updates 1] [--allocator glibc|tcmalloc|jemalloc]
       [--quick] [--output FILE.json]

- **naive** (the prototype of MEASURED.md): fp32, the batch padded to its longest sequence,
  full-vocabulary ``log_softmax`` over all positions, then gather; PPO-clip loss; AdamW step.
- **conveyor**: :class:`conveyor.trainer.trainer.Trainer` with the default config (packed rows,
  chunked log-probs under checkpointing of the vocabulary projection, bf16 autocast, decoupled PPO).
- **conveyor lean**: the same with ``trainer.activation_checkpointing=true`` (transformer layers
  recomputed in the backward pass; this also turns the autocast weight cache off) and
  ``trainer.logprob_chunk_tokens=128``; with glibc's malloc also ``trainer.malloc_trim=true`` and
  ``trainer.malloc_mmap_threshold=8388608`` (glibc's heap otherwise fragments: ~3.5-4.3 GB
  resident for ~2.8 GB of live tensors; its remedy costs page faults). Both conveyor variants use
  the fused AdamW kernel (the default).

``--allocator tcmalloc|jemalloc`` preloads that malloc into every child (naive included): the
allocator is part of the environment, as in PyTorch's CPU performance-tuning guide.

Both run one warm-up update and then ``--updates`` timed updates on the same synthetic batch
(random token ids of the given lengths, lengths varying +-50% around the mean, rewards 0/1;
``--group-size`` responses share one prompt, as in a GRPO batch: conveyor packs the prompt once
per group, ``trainer.share_prompts``; ``--group-size 1`` gives every sequence its own prompt). Tokens/s counts response tokens (the loss tokens). Peak memory is the child
process's maximum resident set size (``ru_maxrss``: model, optimizer state, activations and the
Python / torch runtime). A third child measures the log-prob error of the conveyor path against
fp32 full log-softmax on the same batch and weights (max / mean absolute difference, nats).

Prints one JSON line with both figures and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

CHILD = r"""
import json, math, random, resource, sys, time
import torch
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
torch.manual_seed(0)
from conveyor.models import load_model
lm = load_model(args["model"])
model = lm.model.train()
V = model.config.vocab_size
rng = random.Random(0)
seqs = []
for i in range(args["sequences"]):
    P = max(4, round(args["prompt_len"] * rng.uniform(0.5, 1.5)))
    R = max(2, round(args["response_len"] * rng.uniform(0.5, 1.5)))
    prompt = [rng.randrange(V) for _ in range(P)]
    if args["group_size"] > 1 and i % args["group_size"]:
        prompt = seqs[i - i % args["group_size"]][0]  # GRPO: a group's responses answer one prompt
    seqs.append((prompt, [rng.randrange(V) for _ in range(R)], float(rng.random() < 0.3)))
resp_tokens = sum(len(r) for _, r, _ in seqs)

def rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2

base_rss = rss_gb()

if args["mode"] == "naive":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    L = max(len(p) + len(r) for p, r, _ in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    attn = torch.zeros(len(seqs), L, dtype=torch.long)
    lmask = torch.zeros(len(seqs), L, dtype=torch.float32)
    rewards = torch.tensor([x for _, _, x in seqs])
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    for b, (p, r, _) in enumerate(seqs):
        s = p + r
        ids[b, : len(s)] = torch.tensor(s)
        attn[b, : len(s)] = 1
        lmask[b, len(p) : len(s)] = 1
    old = None
    def update():
        global old
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        m = lmask[:, 1:]
        if old is None:
            old = logp.detach()
        ratio = torch.exp(logp - old)
        a = adv[:, None]
        loss = -(torch.min(ratio * a, ratio.clamp(0.8, 1.28) * a) * m).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
else:
    from conveyor.config import LossConfig, TrainerConfig
    from conveyor.trainer.trainer import Trainer
    from conveyor.types import Sample, Trajectory
    trainer = Trainer(model, TrainerConfig(lr=1e-6, warmup_steps=0, num_threads=args["threads"], **args.get("overrides", {})),
                      LossConfig(kl_coef=0.0), temperature=0.7)
    sample = Sample(id="bench/0", question="q", answer="0", dataset="bench")
    trajs = []
    for i, (p, r, x) in enumerate(seqs):
        trajs.append(Trajectory(sample=sample, group_id=f"g{i // 4}", prompt_ids=p, response_ids=r,
                                behaviour_logprobs=[-2.0] * len(r), versions=[0] * len(r), reward=x))
    def update():
        trainer.train_step(trajs)
    if args["mode"] == "accuracy":
        from conveyor.trainer.batch import pack, plan_micro_batches
        from conveyor.trainer.logprobs import token_logprobs
        model.eval()
        errs = []
        real = []  # real text (MAWPS questions) as well: typical log-probs, not those of random tokens
        if args["model"] != "tiny":
            from conveyor.data import load_dataset
            qs = [lm.tokenizer.encode(s.question, add_special_tokens=False) for s in load_dataset("mawps:singleop")[:16]]
            real = [(qs[i], qs[i + 1], 0.0) for i in range(0, 16, 2)]
        real_errs = []
        with torch.no_grad():
            for p, r, _reward in seqs[:8] + real:
                s = torch.tensor([p + r])
                ref = torch.log_softmax(model(input_ids=s).logits.float()[0, :-1] / 0.7, -1).gather(-1, s[0, 1:, None])[:, 0]
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    ours, _ = token_logprobs(model, s, torch.arange(s.shape[1])[None], torch.cat([s[:, 1:], s[:, :1]], 1),
                                             temperature=0.7, chunk_tokens=512)
                ours = ours[0, :-1]
                (real_errs if any(p is q for q, _r, _x in real) else errs).append((ours.float() - ref)[len(p) - 1 :].abs())
        e = torch.cat(errs)
        out = {"logprob_abs_err_max": e.max().item(), "logprob_abs_err_mean": e.mean().item(), "tokens": e.numel()}
        if real_errs:
            e = torch.cat(real_errs)
            out.update({"real_text_abs_err_max": e.max().item(), "real_text_abs_err_mean": e.mean().item(), "real_text_tokens": e.numel()})
        print(json.dumps(out))
        sys.exit(0)

update()  # warm-up (allocations, autocast caches)
times = []
for _ in range(args["updates"]):
    t0 = time.perf_counter()
    update()
    times.append(time.perf_counter() - t0)
sec = sorted(times)[len(times) // 2]
from conveyor.memory import active_allocator
print(json.dumps({"mode": args["mode"], "allocator": active_allocator(), "update_s": sec, "updates": times, "response_tokens": resp_tokens,
                  "tokens_per_s": resp_tokens / sec, "peak_rss_gb": rss_gb(), "rss_after_load_gb": base_rss}))
"""


ALLOCATORS = {"jemalloc": "libjemalloc.so.2", "tcmalloc": "libtcmalloc_minimal.so.4"}


def _allocator_path(name: str) -> str | None:
    """Shared-library path of ``name`` (``glibc`` = None: the C library's malloc)."""
    if name == "glibc":
        return None
    import ctypes.util
    import glob

    lib = ALLOCATORS[name]
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        hits = glob.glob(os.path.join(d, lib))
        if hits:
            return hits[0]
    found = ctypes.util.find_library(lib.split(".so")[0].removeprefix("lib"))
    if found is None:
        raise SystemExit(f"--allocator {name}: {lib} not found (Debian/Ubuntu: apt-get install "
                         f"{'libjemalloc2' if name == 'jemalloc' else 'libtcmalloc-minimal4'})")
    return found


def _child(cfg: dict) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    lib = _allocator_path(cfg.get("allocator", "glibc"))
    if lib:
        env["LD_PRELOAD"] = lib
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{cfg['mode']} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=60)
    ap.add_argument("--response-len", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4,
                    help="responses per prompt, as in a GRPO batch (1 = every sequence has its own prompt)")
    ap.add_argument("--updates", type=int, default=1, help="timed updates after the warm-up (median reported)")
    ap.add_argument("--lean-micro-batch-tokens", type=int, default=4096,
                    help="micro-batch budget of the memory-lean variant (with activation checkpointing)")
    ap.add_argument("--lean-logprob-chunk-tokens", type=int, default=128)
    ap.add_argument("--lean-malloc-threshold", type=int, default=None,
                    help="trainer.malloc_mmap_threshold of the memory-lean variant (bytes; 0 = none; "
                         "default 8 MiB with glibc, none with a preloaded allocator)")
    ap.add_argument("--allocator", choices=["glibc", *ALLOCATORS], default="glibc",
                    help="malloc of every child (naive and conveyor alike), preloaded with LD_PRELOAD")
    ap.add_argument("--quick", action="store_true", help="tiny model, 8 sequences (CI smoke run)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.sequences, args.prompt_len, args.response_len = "tiny", 8, 20, 16
        args.lean_micro_batch_tokens, args.lean_logprob_chunk_tokens = 64, 16
    cfg = {"model": args.model, "sequences": args.sequences, "prompt_len": args.prompt_len,
           "response_len": args.response_len, "threads": args.threads, "updates": args.updates,
           "allocator": args.allocator, "group_size": args.group_size}
    naive = _child({**cfg, "mode": "naive"})
    ours = _child({**cfg, "mode": "conveyor"})
    glibc = args.allocator == "glibc"
    threshold = args.lean_malloc_threshold if args.lean_malloc_threshold is not None else (8 * 2**20 if glibc else 0)
    lean_overrides = {"micro_batch_tokens": args.lean_micro_batch_tokens, "activation_checkpointing": True,
                      "logprob_chunk_tokens": args.lean_logprob_chunk_tokens, "malloc_trim": glibc,
                      "malloc_mmap_threshold": threshold or None}
    lean = _child({**cfg, "mode": "conveyor", "overrides": lean_overrides})
    acc = _child({**cfg, "mode": "accuracy"})
    res = {
        **cfg, "naive": naive, "conveyor": ours, "conveyor_lean": lean, "lean_overrides": lean_overrides, "logprob_error": acc,
        "speedup_tokens_per_s": ours["tokens_per_s"] / naive["tokens_per_s"],
        "memory_ratio_naive_over_conveyor": naive["peak_rss_gb"] / ours["peak_rss_gb"],
        "conveyor_peak_rss_gb": ours["peak_rss_gb"], "naive_peak_rss_gb": naive["peak_rss_gb"],
        "lean_speedup_tokens_per_s": lean["tokens_per_s"] / naive["tokens_per_s"], "lean_peak_rss_gb": lean["peak_rss_gb"],
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(res))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
