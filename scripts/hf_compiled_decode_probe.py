"""What CUDA graphs would buy the engine's decode step on a GPU (docs/results/gpu.md, "What the
numbers say"): transformers' own ``generate`` on a random-weight model of a shape directory
(scripts/shape_models.py), bf16, greedy, batch B, a P-token prompt and N new tokens, three ways:

- ``dynamic``: the default DynamicCache, eager (what conveyor's engine and the earlier
  ``scripts/hf_decode_probe.py`` measure: ~60-90 ms per step on the lent H200, host-bound);
- ``static eager``: a StaticCache, compilation disabled (isolates the cache layout);
- ``static compiled``: a StaticCache with transformers' automatic ``torch.compile``
  (``mode="reduce-overhead"``: the decode step is captured as a CUDA graph and replayed),
  the route vLLM / SGLang take with their own graphs.

Prints one line per variant as soon as it is measured (a time limit keeps the earlier lines):
the first call's seconds (compilation and graph capture for the compiled one), then the median
of ``--repeats`` timed calls as ms per decode step, ``(t_generate - t_prefill) / (N - 1)``
with ``t_prefill`` one timed forward pass of the prompt batch, and tokens/s (B * N / t_generate).

Usage: python scripts/hf_compiled_decode_probe.py [MODEL_DIR] [--batch 64] [--prompt 64] [--new 64]
(default MODEL_DIR .gpu/models/smollm2-135m; on a CPU it runs the eager variants only, as a
check of the script).
"""

import argparse
import statistics
import sys
import time

import torch

from conveyor.models import load_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=".gpu/models/smollm2-135m")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default="dynamic,static_eager,static_compiled")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    lm = load_model(a.model, init="random")
    m = lm.model.to(dev, dtype).eval()
    gc = m.generation_config
    gc.pad_token_id = gc.pad_token_id if gc.pad_token_id is not None else 0
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, m.config.vocab_size - 1, (a.batch, a.prompt), generator=g).to(dev)
    mask = torch.ones_like(ids)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    with torch.inference_mode():
        m(input_ids=ids, attention_mask=mask)
        sync()
        t = time.perf_counter()
        for _ in range(3):
            m(input_ids=ids, attention_mask=mask)
        sync()
        prefill = (time.perf_counter() - t) / 3
    print(f"# {a.model} on {dev} ({torch.cuda.get_device_name() if cuda else 'cpu'}), torch {torch.__version__}, "
          f"{dtype}, batch {a.batch}, prompt {a.prompt}, new {a.new}; prefill {prefill * 1e3:.1f} ms", flush=True)
    for v in a.variants.split(","):
        if v == "static_compiled" and not cuda:
            print(f"{v}: skipped (needs CUDA)", flush=True)
            continue
        kw = dict(max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False, attention_mask=mask)
        if v.startswith("static"):
            kw["cache_implementation"] = "static"
            kw["disable_compile"] = v == "static_eager"
        try:
            with torch.inference_mode():
                sync()
                t = time.perf_counter()
                out = m.generate(ids, **kw)
                sync()
                first = time.perf_counter() - t
                assert out.shape == (a.batch, a.prompt + a.new), out.shape
                times = []
                for _ in range(a.repeats):
                    sync()
                    t = time.perf_counter()
                    m.generate(ids, **kw)
                    sync()
                    times.append(time.perf_counter() - t)
        except Exception as e:  # a probe: report and go on to the next variant
            print(f"{v}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        med = statistics.median(times)
        step = (med - prefill) / max(1, a.new - 1)
        print(f"{v}: first call {first:.1f} s; generate {med:.3f} s (median of {a.repeats}), "
              f"{step * 1e3:.1f} ms/decode step, {a.batch * a.new / med:,.0f} tokens/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
