"""Weight sync trainer -> engine: time to publish new weights and how long generation pauses
(issue 5).

Usage: python benchmarks/weight_sync.py [--model smollm2-135m-instruct|tiny] [--requests 32]
       [--threads 1] [--quick] [--output FILE.json]

Measures, in one process with the runtime's thread split (engine 1 thread):
- ``snapshot_s``: :meth:`WeightUpdate.from_model` (copy of the trainer's state dict), fp32 and
  bf16, and the message size in bytes (tied embeddings sent once);
- ``load_idle_s``: :meth:`InferenceEngine.update_weights` on an idle engine;
- with ``--requests`` requests in flight (long responses, ``ignore_eos``), an update after
  ``--after-steps`` decode steps: ``update_call_s`` (the trainer's blocking call), the engine's
  ``pause_s`` (weight copy + re-encoding the in-flight requests, from its counters),
  ``reencoded_tokens`` and the longest gap between two generated tokens (``max_token_gap_s``,
  sampled every 5 ms) against the median gap (``median_token_gap_s``); once with re-encoding
  (the default, AReaL) and once keeping the KV caches (``keep_kv``: ``rollout.reencode_on_update=false``).

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--after-steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny model, 4 requests (CI smoke run)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.requests, args.max_new_tokens, args.after_steps, args.repeats = "tiny", 4, 24, 6, 2

    import copy

    import torch

    from conveyor.data import load_dataset
    from conveyor.models import load_model
    from conveyor.prompts import build_prompt_ids
    from conveyor.rollout.engine import InferenceEngine, SamplingParams
    from conveyor.sync import WeightUpdate

    lm = load_model(args.model)
    trainer_model = lm.model
    engine_model = copy.deepcopy(trainer_model).eval()
    tok = lm.tokenizer
    snaps, snaps16 = [], []
    upd = None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        upd = WeightUpdate.from_model(trainer_model, version=1)
        snaps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        upd16 = WeightUpdate.from_model(trainer_model, version=1, dtype=torch.bfloat16)
        snaps16.append(time.perf_counter() - t0)
    full_bytes = sum(t.numel() * t.element_size() for t in trainer_model.state_dict().values())

    samples = load_dataset("mawps:singleop")[: args.requests]
    prompts = [build_prompt_ids(tok, s, "Give the final answer as a number after 'Answer:'.") for s in samples]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.7, ignore_eos=True)

    def in_flight_update(reencode: bool) -> dict:
        """An update after ``after_steps`` decode steps with ``requests`` in flight."""
        engine = InferenceEngine(copy.deepcopy(engine_model), tok, max_batch_size=max(1, args.requests),
                                 num_threads=args.threads, reencode_on_update=reencode)
        engine.start()
        try:
            timeline: list[tuple[float, int]] = []
            stop = threading.Event()

            def watch():
                while not stop.is_set():
                    timeline.append((time.perf_counter(), engine.stats()["generated_tokens"]))
                    time.sleep(0.005)

            w = threading.Thread(target=watch, daemon=True)
            s0 = engine.stats()
            futs = [engine.submit(p, params) for p in prompts]
            w.start()
            while engine.stats()["decode_steps"] - s0["decode_steps"] < args.after_steps:
                time.sleep(0.002)
            before = engine.stats()
            t0 = time.perf_counter()
            engine.update_weights(WeightUpdate(version=1, tensors=upd.tensors, aliases=upd.aliases))
            call_s = time.perf_counter() - t0
            outs = [f.result() for f in futs]
            stop.set()
            w.join()
            after = engine.stats()
        finally:
            engine.stop()
        changes = [t for (t, n), (_, n0) in zip(timeline[1:], timeline[:-1], strict=True) if n != n0]
        gaps = [b - a for a, b in zip(changes[:-1], changes[1:], strict=True)]
        return {
            "update_call_s": call_s,
            "pause_s": after["pause_seconds_total"] - before["pause_seconds_total"],
            "reencoded_tokens": after["reencoded_tokens"] - before["reencoded_tokens"],
            "max_token_gap_s": max(gaps) if gaps else None,
            "median_token_gap_s": statistics.median(gaps) if gaps else None,
            "interrupted_requests": sum(o.num_interruptions > 0 for o in outs),
            "multi_version_requests": sum(len(set(o.versions)) > 1 for o in outs),
        }

    engine = InferenceEngine(engine_model, tok, max_batch_size=max(1, args.requests), num_threads=args.threads)
    engine.start()
    version = 1
    try:
        loads = []
        for _ in range(args.repeats):
            u = WeightUpdate(version=version, tensors=upd.tensors, aliases=upd.aliases)
            t0 = time.perf_counter()
            engine.update_weights(u)
            loads.append(time.perf_counter() - t0)
            version += 1
    finally:
        engine.stop()
    reencode = in_flight_update(True)
    keep_kv = in_flight_update(False)
    res = {
        "model": args.model, "threads": args.threads, "requests": args.requests,
        "message_bytes_fp32": upd.num_bytes, "message_bytes_bf16": upd16.num_bytes, "state_dict_bytes": full_bytes,
        "tied_aliases": upd.aliases,
        "snapshot_s": statistics.median(snaps), "snapshot_bf16_s": statistics.median(snaps16),
        "load_idle_s": statistics.median(loads),
        **reencode,
        "keep_kv": keep_kv,
        "cpu_count": os.cpu_count(), "torch": torch.__version__,
    }
    print(json.dumps(res))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
