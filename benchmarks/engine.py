"""Engine throughput: conveyor's continuous-batching engine vs transformers ``generate`` with static
batches, same model, prompts, threads and response lengths (issue 5, bar >= 2x tokens/s).

Usage: python benchmarks/engine.py [--model smollm2-135m-instruct|tiny] [--requests 64]
       [--max-batch 32] [--threads 1] [--dtype float32|bfloat16] [--baseline] [--quick]
       [--engine local|vllm] [--output FILE.json]

Response lengths are drawn from a long-tailed distribution (log-normal, median ``--median``
tokens, sigma ``--sigma``, capped at ``--max-len``): many short responses and a few long ones, as
in reasoning rollouts. Both sides generate exactly those lengths (end-of-sequence ignored: the
engine's ``ignore_eos``, HF's ``min_new_tokens``), sampling at temperature 0.7. All requests
arrive at t = 0. The HF side runs static batches of ``--max-batch`` requests in arrival order;
each batch decodes until its longest request is done, so only the requested tokens count as
useful. Latency = time from t = 0 until a request's response is complete.

``--dtype bfloat16`` runs the engine with bf16 weights (``rollout.engine_dtype``); ``--baseline``
also runs today's engine settings (float32) on the same requests in the same process, so the
speed-up is a ratio measured in one run (issue 16). The HF side always runs float32.

``--engine vllm`` runs a vLLM server (``conveyor.rollout.engine.vllm.VllmServer``, the same dtype,
``--max-batch`` sequences, started before the clock) on the same requests through
:class:`~conveyor.rollout.engine.vllm.VllmEngine`, beside conveyor's engine in the same run, instead
of the HF side: tokens/s of each, their ratio, and tokens/s per core used (the CPU seconds of the
engine's process, or of the server's processes, over the wall time: a vLLM server runs a compute
thread plus its API server and scheduler).

Prints one JSON line with tokens/s of both, their ratio (engine / HF), the baseline engine's
tokens/s and the ratio engine / baseline when asked, and latency percentiles (s).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, max(0, math.ceil(p * len(xs)) - 1))]

    return {"p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "max": xs[-1]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads for both sides")
    ap.add_argument("--median", type=float, default=24.0, help="median response length (tokens)")
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the response length")
    ap.add_argument("--max-len", type=int, default=256, help="longest response (tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the engine's weights (rollout.engine_dtype); the HF side stays float32")
    ap.add_argument("--baseline", action="store_true",
                    help="also run today's engine settings (float32) on the same requests: ratio in one run")
    ap.add_argument("--quick", action="store_true", help="tiny model, 16 requests, short responses (CI smoke run)")
    ap.add_argument("--engine", choices=("local", "vllm"), default="local",
                    help="vllm: a vLLM server beside conveyor's engine (instead of the HF side)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.requests, args.max_batch, args.median, args.max_len = "tiny", 16, 8, 8.0, 48

    import torch

    from conveyor.data import load_dataset
    from conveyor.models import load_model
    from conveyor.prompts import build_prompt_ids
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    model, tok = lm.model.eval(), lm.tokenizer
    rng = random.Random(args.seed)
    samples = load_dataset("mawps:singleop")
    rng.shuffle(samples)
    prompts = [build_prompt_ids(tok, s, "Give the final answer as a number after 'Answer:'.") for s in samples[: args.requests]]
    lengths = [max(1, min(args.max_len, round(args.median * math.exp(args.sigma * rng.gauss(0, 1))))) for _ in prompts]
    useful = sum(lengths)

    # --- conveyor engine: all requests at once, continuous batching
    dtype = getattr(torch, args.dtype)
    eng_model = copy.deepcopy(model) if dtype != torch.float32 else model  # the engine casts in place
    cpu0 = time.process_time()
    outs, done_at, eng_wall = _run_engine(eng_model, tok, prompts, lengths, args, dtype)
    eng_cores = (time.process_time() - cpu0) / eng_wall
    del eng_model
    got = [len(o.token_ids) for o in outs]
    if got != lengths:
        raise SystemExit(f"engine produced {sum(got)} tokens, expected {useful} (lengths differ)")
    baseline = None
    if args.baseline:  # today's engine settings (float32), same requests, same run
        b_outs, b_done, b_wall = _run_engine(model, tok, prompts, lengths, args, torch.float32)
        baseline = {"dtype": "float32", "tokens_per_s": useful / b_wall, "wall_s": b_wall,
                    "latency_s": _percentiles(b_done), "ratio_engine_over_baseline": b_wall / eng_wall}

    if args.engine == "vllm":
        v_outs, v_done, v_wall, v_cores = _run_vllm(args.model, tok, prompts, lengths, args)
        got = [len(o.token_ids) for o in v_outs]
        if got != lengths:
            raise SystemExit(f"vLLM produced {sum(got)} tokens, expected {useful} (lengths differ)")
        res = {
            "model": args.model, "requests": len(prompts), "max_batch": args.max_batch, "threads": args.threads,
            "dtype": args.dtype, "useful_tokens": useful, "length_mean": statistics.fmean(lengths),
            "engine_tokens_per_s": useful / eng_wall, "vllm_tokens_per_s": useful / v_wall,
            "ratio_vllm_over_engine": eng_wall / v_wall,
            "engine_cores_used": eng_cores, "vllm_cores_used": v_cores,
            "engine_tokens_per_s_per_core": useful / eng_wall / max(eng_cores, 1e-9),
            "vllm_tokens_per_s_per_core": useful / v_wall / max(v_cores, 1e-9),
            "engine_wall_s": eng_wall, "vllm_wall_s": v_wall,
            "engine_latency_s": _percentiles(done_at), "vllm_latency_s": _percentiles(v_done),
            "torch": torch.__version__, "cpu_count": os.cpu_count(),
        }
        print(json.dumps(res))
        if args.output:
            with open(args.output, "w") as f:
                json.dump(res, f, indent=2)
        return res

    # --- transformers generate, static batches in arrival order
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    tok.padding_side = "left"
    hf_done: list[float] = []
    hf_tokens = 0
    with torch.inference_mode():
        b0 = prompts[:2]
        _hf_batch(model, b0, 4, pad)  # warm-up
        t0 = time.perf_counter()
        for i in range(0, len(prompts), args.max_batch):
            batch, lens = prompts[i : i + args.max_batch], lengths[i : i + args.max_batch]
            n = max(lens)
            out = _hf_batch(model, batch, n, pad)
            hf_tokens += out
            t = time.perf_counter() - t0
            hf_done.extend([t] * len(batch))
        hf_wall = time.perf_counter() - t0
    res = {
        "model": args.model, "requests": len(prompts), "max_batch": args.max_batch, "threads": args.threads,
        "engine_dtype": args.dtype, "baseline": baseline,
        "useful_tokens": useful, "length_mean": statistics.fmean(lengths), "length_p50": sorted(lengths)[len(lengths) // 2],
        "length_max": max(lengths),
        "engine_tokens_per_s": useful / eng_wall, "hf_tokens_per_s": useful / hf_wall,
        "ratio_engine_over_hf": hf_wall / eng_wall,
        "engine_wall_s": eng_wall, "hf_wall_s": hf_wall, "hf_generated_tokens_incl_waste": hf_tokens,
        "engine_latency_s": _percentiles(done_at), "hf_latency_s": _percentiles(hf_done),
        "torch": torch.__version__, "cpu_count": os.cpu_count(),
    }
    print(json.dumps(res))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(res, f, indent=2)
    return res


def _run_engine(model, tok, prompts, lengths, args, dtype):
    """All requests at t = 0 through one :class:`InferenceEngine` (weights cast to ``dtype``):
    ``(outputs, completion time of each request (s from t = 0), wall seconds)``."""
    import torch

    from conveyor.rollout.engine import InferenceEngine, SamplingParams

    engine = InferenceEngine(model, tok, max_batch_size=args.max_batch, seed=args.seed, num_threads=args.threads,
                             dtype=None if dtype == torch.float32 else dtype)
    engine.start()
    try:
        engine.generate_batch(prompts[:2], SamplingParams(max_new_tokens=4, temperature=0.7))  # warm-up
        t0 = time.perf_counter()
        futs = [engine.submit(p, SamplingParams(max_new_tokens=n, temperature=0.7, ignore_eos=True))
                for p, n in zip(prompts, lengths, strict=True)]
        done_at = [0.0] * len(futs)
        for i, f in enumerate(futs):
            f.add_done_callback(lambda _f, i=i: done_at.__setitem__(i, time.perf_counter() - t0))
        outs = [f.result() for f in futs]
        wall = time.perf_counter() - t0
    finally:
        engine.stop()
    return outs, done_at, wall


def _run_vllm(model_name, tok, prompts, lengths, args):
    """All requests at t = 0 through a vLLM server started here (not timed; stopped after):
    ``(outputs, completion times (s), wall seconds, cores used)``; cores used = the server's CPU
    seconds during the run over the wall time."""
    import asyncio

    from conveyor.models import resolve_model_dir
    from conveyor.rollout.engine import SamplingParams
    from conveyor.rollout.engine.vllm import VllmEngine, VllmServer

    server = VllmServer(str(resolve_model_dir(model_name)), dtype=args.dtype, max_num_seqs=args.max_batch,
                        seed=args.seed, kv_cache_gb=2)
    engine = VllmEngine(server=server, tokenizer=tok)
    try:
        engine.start()

        async def run():
            await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=4, temperature=0.7))
                                   for p in prompts[:2]])  # warm-up
            cpu0, t0 = server.cpu_seconds(), time.perf_counter()
            done_at = [0.0] * len(prompts)

            async def one(i, p, n):
                out = await engine.generate(p, SamplingParams(max_new_tokens=n, temperature=0.7, ignore_eos=True))
                done_at[i] = time.perf_counter() - t0
                return out

            outs = await asyncio.gather(*[one(i, p, n) for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))])
            wall = time.perf_counter() - t0
            return outs, done_at, wall, (server.cpu_seconds() - cpu0) / wall

        return asyncio.run(run())
    finally:
        engine.close()


def _hf_batch(model, batch: list[list[int]], n: int, pad: int) -> int:
    """One static batch through ``model.generate``: left-padded, exactly ``n`` new tokens each.
    Returns the generated tokens including the padding waste (rows x n)."""
    import torch

    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, p in enumerate(batch):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=True,
                         temperature=0.7, top_p=1.0, top_k=0, pad_token_id=pad)
    return (out.shape[1] - width) * len(batch)


if __name__ == "__main__":
    main(sys.argv[1:])
