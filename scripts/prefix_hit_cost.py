"""The cost of one prefix-cache-hit prefill pass in a quiet process of its own (SmolLM2, 1 thread,
bf16 and float32 engines): 16 continuations of cached prompts, each with a different number of
new tokens (new shapes), then the same again (repeated shapes); prints seconds per pass from the
engine's ``prefill_profile`` (docs/results/main_job.md section 7).

Usage: python scripts/prefix_hit_cost.py
"""
import torch

from conveyor.models import load_model
from conveyor.rollout.engine import InferenceEngine, SamplingParams

torch.set_num_threads(1)
lm = load_model("smollm2-135m-instruct")
for dtype in (torch.bfloat16, torch.float32):
    eng = InferenceEngine(lm.model, lm.tokenizer, max_batch_size=32, num_threads=1, seed=0, dtype=dtype, prefix_cache_tokens=16384)
    with eng:
        prompts = [lm.tokenizer.encode(f"Question {i}: what is {i} plus {i*3}? Think step by step and answer. " * 6) for i in range(16)]
        g = SamplingParams(max_new_tokens=8, temperature=0.0)
        first = eng.generate_batch(prompts, g)
        # continuations one by one with distinct numbers of new tokens: new shapes each time
        for i, o in enumerate(first):
            eng.generate_batch([o.prompt_ids + o.token_ids + list(range(28, 28 + i))], SamplingParams(max_new_tokens=1, temperature=0.0))
        p1 = eng.stats()["prefill_profile"]["prefix_hit"]
        # the same shapes again
        for i, o in enumerate(first):
            eng.generate_batch([o.prompt_ids + o.token_ids + list(range(28, 28 + i))], SamplingParams(max_new_tokens=1, temperature=0.0))
        p2 = eng.stats()["prefill_profile"]["prefix_hit"]
        print(dtype, "new shapes: s/pass", round(p1[3] / p1[0], 4), " repeated shapes: s/pass", round((p2[3] - p1[3]) / (p2[0] - p1[0]), 4))
