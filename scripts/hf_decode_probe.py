"""How long one decode step of transformers' own eager decoding takes on a GPU, and how much of it
is the host issuing kernels (docs/results/gpu.md, "What the numbers say"): a random-weight model
of a shape directory (scripts/shape_models.py) in bf16, batch 64, a 64-token prompt, then 20 timed
one-token steps with transformers' DynamicCache (plain, and with a 4-D boolean mask and explicit
positions as conveyor's engine passes them, and from a second thread as the engine runs), and a
torch.profiler table of the busiest operators.

Usage: python scripts/hf_decode_probe.py [MODEL_DIR]   (default .gpu/models/smollm2-135m; needs CUDA)
Prints ``ms/step`` (synchronised wall-clock per step) and ``host ms/step`` (time for the Python
call to return, i.e. to queue the step's kernels): equal values mean the step is host-bound.
"""

import sys
import threading
import time

import torch

from conveyor.models import load_model

lm = load_model(sys.argv[1] if len(sys.argv) > 1 else ".gpu/models/smollm2-135m", init="random")
m = lm.model.to("cuda", torch.bfloat16).eval()
B = 64
ids = torch.randint(3, 49000, (B, 64), device="cuda")


def run(label, mask4d):
    with torch.inference_mode():
        out = m(input_ids=ids, use_cache=True)
        pkv = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        L = 64

        def step(tok, L):
            kw = {}
            if mask4d:
                kw = dict(attention_mask=torch.ones(B, 1, 1, L + 1, dtype=torch.bool, device="cuda"),
                          position_ids=torch.full((B, 1), L, device="cuda"))
            return m(input_ids=tok, past_key_values=pkv, use_cache=True, logits_to_keep=1, **kw)

        for _ in range(3):
            out = step(tok, L)
            tok = out.logits[:, -1:].argmax(-1)
            L += 1
        torch.cuda.synchronize()
        t, cpu = time.perf_counter(), 0.0
        for _ in range(20):
            c = time.perf_counter()
            out = step(tok, L)
            cpu += time.perf_counter() - c
            tok = out.logits[:, -1:].argmax(-1)
            L += 1
        torch.cuda.synchronize()
        print(label, "ms/step %.1f" % ((time.perf_counter() - t) / 20 * 1e3),
              "host ms/step (launch) %.1f" % (cpu / 20 * 1e3), flush=True)


run("hf dynamic cache", False)
run("hf + 4D bool mask", True)
th = threading.Thread(target=run, args=("in a thread", True))
th.start()
th.join()
from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    run("profiled", True)
print(p.key_averages().table(sort_by="cpu_time_total", row_limit=12))
