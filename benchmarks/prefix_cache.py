"""The engine's prefix cache on the main job's rollouts (issue 16): the same episodes with
``rollout.prefix_cache_tokens`` 0 (today) and N, in one run.

Usage: python benchmarks/prefix_cache.py [--model smollm2-135m-instruct|tiny] [--prompts 8]
       [--cache-tokens 4096] [--threads 1] [--update-every S] [--feed-baseline] [--on-only] [--quick]
       [--output FILE.json]

``--on-only`` runs only the side with the cache (its counts, e.g. padded tokens per re-encoded
token, without the ratios): for a quick look at an engine change.

``--feed-baseline`` (always with ``--quick``) adds a third side, the cache on with
``prefix_feed_tokens=1`` (the engine before hits with a few tokens left were fed through decode
steps: each ran a prefill pass of its own), and the ratios of that side over the cache with the
default feeding. ``--update-every S`` publishes the same weights as a new version every ``S``
seconds during each side: every update re-encodes the rows in flight, whole without the cache, a
group's shared prompt once with it; reported per side (``reencode_profile``) and as the ratio of
re-encode seconds per re-encoded token (the sides see different numbers of updates: compare per
token).

Each side runs the default main job's workflow (``build_workflow`` of the default config: MAWPS
prompts, 8 responses per prompt, the calculator tool whose every call ends an engine request and
starts the next turn as a new one) on the same ``--prompts`` training prompts with a fresh engine
(same weights, same seed, all episodes at once) and reports the engine's busy seconds, prefill
seconds and tokens, prefix-cache hits and the tokens they did not run, the tokens generated, and
the ratios off / on. The responses of both sides are compared token for token: they are the same
computation (a cached prefix holds the keys / values a full prefill would compute, up to float
rounding), so they differ only where rounding flips a sampled token (reported).

Prints one JSON line per side and a final JSON line with the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import sys
import threading
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _side(model, tok, workflow, samples, cache_tokens: int, threads: int,
          feed_tokens: int | None = None, update_every: float = 0.0) -> tuple[dict, list]:
    from conveyor.rollout.engine import InferenceEngine
    from conveyor.sync import WeightUpdate

    feed = {} if feed_tokens is None else {"prefix_feed_tokens": feed_tokens}
    engine = InferenceEngine(copy.deepcopy(model), tok, max_batch_size=32, seed=0, num_threads=threads,
                             prefix_cache_tokens=cache_tokens, **feed)
    done = threading.Event()

    def publish():  # the same weights as a new version every update_every s: each one re-encodes the rows in flight
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        version = 0
        while not done.wait(update_every):
            version += 1
            engine.update_weights(WeightUpdate(version=version, tensors=weights))

    publisher = threading.Thread(target=publish, daemon=True) if update_every > 0 else None
    engine.start()
    try:
        async def episodes():
            return await asyncio.gather(*[workflow.run_episode(engine, s) for s in samples])

        if publisher is not None:
            publisher.start()
        t0 = time.perf_counter()
        groups = asyncio.run(episodes())
        wall = time.perf_counter() - t0
        done.set()
        if publisher is not None:
            publisher.join()
        st = engine.stats()
    finally:
        done.set()
        engine.stop()
    trajs = [t for g in groups for t in g]
    out = {
        "prefix_cache_tokens": cache_tokens, "wall_s": wall, "engine_busy_s": st["busy_seconds"],
        "prefill_s": st["prefill_seconds"], "prefill_tokens": st["prefill_tokens"],
        "prefill_dedup_tokens": st["prefill_dedup_tokens"], "prefix_cache_hits": st["prefix_cache_hits"],
        "prefix_cache_hit_tokens": st["prefix_cache_hit_tokens"],
        # hits with a few tokens left: decode steps ran them (no prefill pass, no hit tokens)
        "prefix_hits_joined": st["prefix_hits_joined"], "prefix_fed_tokens": st["prefix_fed_tokens"],
        "prefill_forwards": st["prefill_forwards"], "decode_steps": st["decode_steps"],
        # weight updates (--update-every): rows re-encoded, their tokens taken from a shared
        # prefix prefilled once, and the re-encode passes' [passes, rows, padded tokens, seconds]
        "weight_updates": st["num_weight_updates"], "reencoded_tokens": st["reencoded_tokens"],
        "reencode_prefix_tokens": st["reencode_prefix_tokens"],
        "reencode_profile": st["prefill_profile"].get("reencode", [0, 0, 0, 0.0]),
        "engine_requests": st["num_requests"],
        "generated_tokens": st["generated_tokens"], "trajectories": len(trajs),
        # responses with at least one calculator result inserted (a second engine request or more)
        "trajectories_with_tool_results": sum(1 for t in trajs if t.action_mask and not all(t.action_mask)),
    }
    return out, [t.response_ids for t in trajs]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--cache-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--update-every", type=float, default=0.0,
                    help="publish the same weights as a new version every S seconds (each re-encodes the rows in flight)")
    ap.add_argument("--feed-baseline", action="store_true",
                    help="a third side: the cache on with prefix_feed_tokens=1 (each hit runs a pass of its own)")
    ap.add_argument("--on-only", action="store_true", help="only the side with the cache (no ratios)")
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 prompts, 24 new tokens (CI smoke run)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)

    import torch

    from conveyor.config import load_config
    from conveyor.data import load_dataset
    from conveyor.models import load_model
    from conveyor.rewards import ANSWER_METRICS, RewardService
    from conveyor.runtime.inline import build_workflow

    overrides = [f"model.name={'tiny' if args.quick else args.model}"] + (["rollout.max_new_tokens=24"] if args.quick else [])
    prompts = 2 if args.quick else args.prompts
    torch.set_num_threads(args.threads)
    cfg = load_config(None, overrides)
    lm = load_model(cfg.model.name, seed=cfg.model.seed)
    samples = load_dataset(cfg.data.train, split_seed=cfg.data.split_seed)[:prompts]
    with RewardService(cfg.reward.fn, timeout_s=600.0, max_workers=1, metrics=ANSWER_METRICS) as rewards:
        workflow = build_workflow(cfg, lm.tokenizer, rewards, version=0)
        if args.on_only:
            on, _ = _side(lm.model, lm.tokenizer, workflow, samples, args.cache_tokens, args.threads,
                          update_every=args.update_every)
            on["reencode_padded_per_reencoded_token"] = on["reencode_profile"][2] / max(on["reencoded_tokens"], 1)
            res = {"model": cfg.model.name, "prompts": prompts, "threads": args.threads,
                   "update_every_s": args.update_every, "on": on, "torch": torch.__version__}
            print(json.dumps(res))
            if args.output:
                with open(args.output, "w") as f:
                    json.dump(res, f, indent=2)
            return res
        off, resp_off = _side(lm.model, lm.tokenizer, workflow, samples, 0, args.threads,
                              update_every=args.update_every)
        print(json.dumps(off), flush=True)
        on, resp_on = _side(lm.model, lm.tokenizer, workflow, samples, args.cache_tokens, args.threads,
                            update_every=args.update_every)
        print(json.dumps(on), flush=True)
        if args.feed_baseline or args.quick:
            feed1, resp_feed1 = _side(lm.model, lm.tokenizer, workflow, samples, args.cache_tokens, args.threads, 1,
                                      update_every=args.update_every)
            print(json.dumps(feed1), flush=True)
    res = {
        "model": cfg.model.name, "prompts": prompts, "group_size": cfg.rollout.group_size,
        "max_new_tokens": cfg.rollout.max_new_tokens, "threads": args.threads, "off": off, "on": on,
        "engine_busy_ratio_off_over_on": off["engine_busy_s"] / on["engine_busy_s"],
        "prefill_s_ratio_off_over_on": off["prefill_s"] / max(on["prefill_s"], 1e-9),
        "wall_ratio_off_over_on": off["wall_s"] / on["wall_s"],
        "identical_responses": sum(a == b for a, b in zip(resp_off, resp_on, strict=True)) / len(resp_off),
        "update_every_s": args.update_every,
        # re-encode seconds per re-encoded token, without the cache (every row whole) over with it
        "reencode_s_per_token_ratio_off_over_on": (
            (off["reencode_profile"][3] / off["reencoded_tokens"]) / (on["reencode_profile"][3] / on["reencoded_tokens"])
            if off["reencoded_tokens"] and on["reencoded_tokens"] and on["reencode_profile"][3] else None),
        "torch": torch.__version__, "cpu_count": os.cpu_count(),
    }
    if args.feed_baseline or args.quick:
        res.update({
            "feed1": feed1,
            "engine_busy_ratio_feed1_over_on": feed1["engine_busy_s"] / on["engine_busy_s"],
            "wall_ratio_feed1_over_on": feed1["wall_s"] / on["wall_s"],
            "identical_responses_feed1": sum(a == b for a, b in zip(resp_feed1, resp_on, strict=True)) / len(resp_on),
        })
    print(json.dumps(res))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
