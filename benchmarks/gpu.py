"""GPU measurements in one short run: matmul peak, engine decode throughput, trainer update
throughput / MFU, and asynchronous vs synchronous ``conveyor train`` on the device (issue 15).

Usage: python benchmarks/gpu.py [--device cuda|cpu] [--models DIR,DIR] [--sections peak,engine,trainer,async]
       [--quick] [--out FILE.json] [--budget-s 225]

Made for a lent GPU machine with a few minutes of device time: every section (and every model /
batch size / run inside one) runs under ``try/except`` and records its traceback in the results
instead of aborting, and the results JSON (``--out``) is rewritten after every item, so a run
killed by a timeout still leaves what it measured. Optional items (the engine's other batch
sizes for models after the first, the agent-like ``async`` profile) are deferred to the end and
run only while the time budget (``--budget-s``, from the script's start) allows. SIGTERM records
itself, kills the ``conveyor train`` child and saves before exiting.

Peak GPU memory (``peak_memory_gb``, the CUDA allocator's high-water mark over an item) includes
the models already resident on the device then (``memory_before_gb``: the cached models).

The code paths are the same on ``--device cpu`` (what the CPU smoke test runs, with ``--quick``)
and ``cuda``; only the timing primitives differ (CUDA events / ``torch.cuda.synchronize`` vs
``time.perf_counter``) and GPU memory is read from the CUDA allocator (null on the CPU).

Models: ``--models`` takes model directories written by ``scripts/shape_models.py`` (config and
tokenizer, no weights: ``load_model(..., init="random")``); a missing directory named ``tiny``,
``smollm2-135m`` or ``qwen2-1.5b`` is created with that script (needs the SmolLM2 GGUF package).
Each model is initialised once (float32, seed 0, under ``torch.device(device)``: the random init
runs on the GPU) and cached on the device: the engine gets a copy (cast to bfloat16 in place), the
trainer the original.

Sections:

1. ``peak``: dense matmul throughput (``N x N x N``, ``2 N^3`` FLOPs; 8192 on the GPU), 3 warm-ups
   then 10 timed products, each timed with CUDA events: bf16, fp32 with TF32 off
   (``torch.set_float32_matmul_precision("highest")``) and fp32 with TF32 on; median / best
   TFLOP/s. Plus versions, GPU name and memory.
2. ``engine``: :class:`~conveyor.rollout.engine.InferenceEngine` in bfloat16 on the device; 256
   requests all at t = 0, prompts of 64-128 random token ids, response lengths log-normal (median
   128, sigma 1, capped at 512) set as each request's ``max_new_tokens``, temperature 1.0, EOS
   honoured (a random-weight model rarely emits it; the tokens actually generated are counted);
   ``max_batch_size`` 64 and 256. One warm-up batch first; engine stats are deltas over the timed
   run (busy / prefill / sampling seconds, decode steps, decode ms per step at the most frequent
   batch sizes from the engine's ``decode_profile``).
3. ``trainer``: :class:`~conveyor.trainer.trainer.Trainer` (bf16 autocast, ``loss.kl_coef=0``,
   GRPO) on a synthetic batch: 64 sequences in groups of 4 sharing a prompt of ~256 tokens,
   responses 512 +-50%; ``micro_batch_tokens=16384``, ``pack_row_tokens=4096`` (a group's shared
   prompt and its 4 responses fit one row); one warm-up update, 3 timed (synchronised), median.
   Tokens/s over forward positions (packed, non-padding) and over response (loss) tokens. FLOPs
   of one more update with ``torch.utils.flop_counter.FlopCounterMode``: every matrix product and
   attention call actually executed (forward, backward, the vocabulary projection recomputed
   under checkpointing), elementwise work not counted; MFU = those FLOPs / update seconds /
   the measured bf16 peak of section 1. Also ``6 N T`` (N parameters, T forward positions) and its
   MFU, the usual model-FLOPs convention. Peak GPU memory from the CUDA allocator. Out of memory:
   recorded, then retried with a quarter of the micro-batch budget, then half the sequences.
4. ``async``: real ``conveyor train`` subprocesses (SmolLM2-135M shape, ``model.init=random``, 6
   steps, 4 prompts x 4 responses, 128 new tokens, engine dtype auto = bf16 with a bf16 trainer)
   at ``async.eta=0`` and ``2``; the ratio of the training loop's wall-clock (``summary.json``'s
   ``wall_seconds``) eta0 / eta2 and the trainer / engine busy fractions. Profile ``b`` (deferred,
   if time allows): the same with an environment wait per episode (``rollout.env_latency``,
   log-normal median 2 s, sigma 0.5). Run directories live in a temporary directory, removed.

``--sdpa no_cudnn`` turns PyTorch's cuDNN attention backend off in this process, not in the async
section's ``conveyor train`` children (SDPA then picks its memory-efficient kernel for masked
attention): the engine's decode step changes its key length every step, and a cuDNN attention
plan is built per new shape (the hypothesis of docs/results/gpu.md, "What the numbers say", to
be measured on the next GPU lease).

Prints one JSON summary line at the end (the full results are in ``--out``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import gc
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("conveyor") is None:  # not installed: the source tree (PYTHONPATH=src)
    sys.path.insert(0, str(ROOT / "src"))  # (children get it too: _child_env)

import torch  # noqa: E402

SHAPE_NAMES = ("tiny", "smollm2-135m", "qwen2-1.5b")


class Skipped(Exception):
    """An item left out (time budget); recorded as skipped, not as an error."""


class Terminated(BaseException):
    """SIGTERM (a timeout's kill): unwinds through every ``except Exception``."""


# ----------------------------------------------------------------------------- helpers


def _gb(n: float | None) -> float | None:
    return None if n is None else n / 2**30


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Bench:
    """The results, the clock and the device; writes ``--out`` after every item."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.perf_counter()
        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        self.out = Path(args.out)
        self.models: dict[str, object] = {}  # model ref -> LoadedModel (float32, on the device)
        self.deferred: list[tuple[str, float, object]] = []  # (name, estimated s, fn)
        self.child: subprocess.Popen | None = None  # the running `conveyor train`
        self.tmp = Path(tempfile.mkdtemp(prefix="conveyor-gpu-bench-"))
        self.results: dict = {
            "args": vars(args), "device": str(self.dev), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "budget_s": args.budget_s, "env": {}, "sections": {}, "errors": [], "skipped": [],
        }

    # --- clock
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.args.budget_s - self.elapsed()

    def need(self, seconds: float, what: str) -> None:
        """Skip ``what`` unless ``seconds`` of the budget are left."""
        if self.left() < seconds:
            raise Skipped(f"{what}: {self.left():.0f} s of the budget left, needs ~{seconds:.0f} s")

    # --- device primitives (the only device-specific code)
    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def reset_peak_memory(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.dev)

    def peak_memory_gb(self) -> float | None:
        return _gb(torch.cuda.max_memory_allocated(self.dev)) if self.cuda else None

    def memory_gb(self) -> float | None:
        """Allocated now (every model resident on the device included)."""
        return _gb(torch.cuda.memory_allocated(self.dev)) if self.cuda else None

    def free_memory(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def time_each(self, fn, warmup: int, iters: int) -> list[float]:
        """Seconds of each of ``iters`` calls of ``fn`` after ``warmup`` calls (CUDA events on a
        GPU, ``perf_counter`` on the CPU)."""
        for _ in range(warmup):
            fn()
        self.sync()
        if self.cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
            ev[0].record()
            for i in range(iters):
                fn()
                ev[i + 1].record()
            ev[-1].synchronize()
            return [ev[i].elapsed_time(ev[i + 1]) / 1e3 for i in range(iters)]
        out = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return out

    def timed(self, fn):
        """``(seconds, fn())`` with the device synchronised before and after."""
        self.sync()
        t = time.perf_counter()
        r = fn()
        self.sync()
        return time.perf_counter() - t, r

    # --- results
    def save(self) -> None:
        self.results["elapsed_s"] = self.elapsed()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(f".{self.out.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.results, indent=2, default=str))
        os.replace(tmp, self.out)

    def item(self, where: dict, key: str, fn) -> object | None:
        """Run one item: its result goes to ``where[key]``; an exception's traceback goes there
        (and to ``errors``) instead; saved either way."""
        t = time.perf_counter()
        label = f"{where.get('_name', '?')}/{key}"
        try:
            res = fn()
        except Skipped as e:
            where[key] = {"skipped": str(e)}
            self.results["skipped"].append(label)
            print(f"[gpu-bench] skipped {label}: {e}", file=sys.stderr, flush=True)
            res = None
        except Exception as e:  # recorded, never fatal
            oom = _is_oom(e)
            where[key] = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-6000:],
                          "out_of_memory": oom}
            self.results["errors"].append(label)
            print(f"[gpu-bench] error in {label}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            res = None
        else:
            where[key] = res
        if isinstance(where[key], dict):
            where[key].setdefault("item_s", time.perf_counter() - t)
        self.save()
        if res is not None:
            print(f"[gpu-bench] {self.elapsed():6.1f} s  {label} done in {time.perf_counter() - t:.1f} s",
                  file=sys.stderr, flush=True)
        return res

    def section(self, name: str) -> dict:
        sec = self.results["sections"].setdefault(name, {"_name": name})
        return sec

    # --- models
    def loaded(self, ref: str, *, pop: bool = False):
        """The model of ``ref`` (float32, random init, seed 0) on the device, loaded once.

        Initialised under ``torch.device(device)`` (the random init runs on the GPU: seconds
        instead of tens of seconds on the host for 1.4 B parameters); if that fails or gives
        non-finite weights, initialised on the host and moved."""
        from conveyor.devices import module_device
        from conveyor.models import load_model

        lm = self.models.get(ref)
        if lm is None:
            path = ensure_model_dir(ref, self.results)
            note: dict = {}
            try:
                with torch.device(self.dev):
                    lm = load_model(path, seed=0, init="random")
                if not all(bool(torch.isfinite(p).all()) for p in lm.model.parameters()):
                    raise ValueError("non-finite weights after a random init under torch.device")
            except Exception as e:
                note["device_init_error"] = f"{type(e).__name__}: {e}"[:1000]
                lm = None
                self.free_memory()
                lm = load_model(path, seed=0, init="random")
            note.update(load_s=lm.load_seconds, init_device=str(module_device(lm.model)))
            t = time.perf_counter()
            lm.model.to(self.dev)
            self.sync()
            note["to_device_s"] = time.perf_counter() - t
            self.results.setdefault("model_load", {})[ref] = note
            self.models[ref] = lm
        if pop:
            self.models.pop(ref, None)
        return lm


def _is_oom(e: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(e, oom)) or "out of memory" in str(e).lower()


def ensure_model_dir(ref: str, results: dict) -> str:
    """``ref`` itself, after writing it with scripts/shape_models.py when it is a missing
    directory with one of that script's names."""
    p = Path(ref)
    if p.name in SHAPE_NAMES and not (p / "config.json").is_file():
        spec = importlib.util.spec_from_file_location("shape_models", ROOT / "scripts" / "shape_models.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.main(p.parent)
        results.setdefault("created_model_dirs", []).append(str(p))
    return ref


def env_info(b: Bench) -> dict:
    import transformers

    info = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "torch_cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cpu_count": os.cpu_count(), "platform": platform.platform(), "cuda_available": torch.cuda.is_available(),
        "sdpa": b.args.sdpa,
    }
    if b.cuda:
        p = torch.cuda.get_device_properties(b.dev)
        free, total = torch.cuda.mem_get_info(b.dev)
        info.update(gpu_name=p.name, gpu_capability=f"{p.major}.{p.minor}", gpu_sms=p.multi_processor_count,
                    gpu_memory_gb=_gb(p.total_memory), gpu_free_gb_at_start=_gb(free), gpu_total_gb=_gb(total),
                    bf16_supported=torch.cuda.is_bf16_supported())
    return info


# ----------------------------------------------------------------------------- 1. peak


def matmul_tflops(b: Bench, n: int, dtype: torch.dtype, precision: str | None, warmup: int, iters: int) -> dict:
    """Dense ``n x n x n`` products: TFLOP/s (``2 n^3`` per product) of each timed one."""
    before = torch.get_float32_matmul_precision()
    if precision is not None:
        torch.set_float32_matmul_precision(precision)
    try:
        g = torch.Generator(device=b.dev).manual_seed(0)
        x = torch.randn(n, n, device=b.dev, dtype=dtype, generator=g)
        y = torch.randn(n, n, device=b.dev, dtype=dtype, generator=g)
        z = torch.empty(n, n, device=b.dev, dtype=dtype)
        secs = b.time_each(lambda: torch.mm(x, y, out=z), warmup, iters)
        x = y = z = None  # (freed before the next product)
    finally:
        torch.set_float32_matmul_precision(before)
    flop = 2.0 * n**3
    tf = [flop / s / 1e12 for s in secs]
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "float32_matmul_precision": precision,
            "warmup": warmup, "iters": iters, "ms": [s * 1e3 for s in secs],
            "tflops_median": _median(tf), "tflops_best": max(tf), "tflops_mean_time": flop * len(secs) / sum(secs) / 1e12}


def run_peak(b: Bench) -> None:
    sec = b.section("peak")
    a = b.args
    for key, dtype, prec in (("bf16", torch.bfloat16, None), ("fp32_tf32_off", torch.float32, "highest"),
                             ("fp32_tf32_on", torch.float32, "high")):
        b.item(sec, key, lambda dtype=dtype, prec=prec: matmul_tflops(b, a.matmul_n, dtype, prec, a.matmul_warmup,
                                                                      a.matmul_iters))
    b.free_memory()


def bf16_peak_tflops(b: Bench) -> float | None:
    """The measured bf16 peak (section 1), measured now if section 1 did not run."""
    sec = b.section("peak")
    if not isinstance(sec.get("bf16"), dict) or "tflops_median" not in sec["bf16"]:
        b.item(sec, "bf16", lambda: matmul_tflops(b, b.args.matmul_n, torch.bfloat16, None, b.args.matmul_warmup,
                                                  b.args.matmul_iters))
    r = sec.get("bf16") or {}
    return r.get("tflops_median")


# ----------------------------------------------------------------------------- 2. engine


def engine_workload(vocab: int, a: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(a.prompt_min, a.prompt_max))] for _ in range(a.requests)]
    lengths = [max(1, min(a.max_len, round(a.median_len * math.exp(a.sigma_len * rng.gauss(0.0, 1.0)))))
               for _ in range(a.requests)]
    return prompts, lengths


def _profile_delta(after: dict, before: dict) -> dict[int, tuple[int, float]]:
    out = {}
    for bs, (steps, secs) in after.items():
        s0, t0 = before.get(bs, (0, 0.0))
        if steps - s0 > 0:
            out[int(bs)] = (int(steps - s0), float(secs - t0))
    return out


def engine_run(b: Bench, model, tok, prompts: list[list[int]], lengths: list[int], max_batch: int) -> dict:
    """All requests at t = 0 through one engine of ``max_batch`` on the device (bf16)."""
    from conveyor.rollout.engine import InferenceEngine, SamplingParams

    b.need(10, f"engine max_batch {max_batch}")
    b.reset_peak_memory()
    mem_before = b.memory_gb()
    engine = InferenceEngine(model, tok, max_batch_size=max_batch, seed=b.args.seed, dtype=torch.bfloat16, device=b.dev)
    engine.start()
    try:
        n_warm = min(len(prompts), max_batch, 16)
        t_warm, _ = b.timed(lambda: engine.generate_batch(prompts[:n_warm], SamplingParams(max_new_tokens=8, temperature=1.0),
                                                          timeout=max(5.0, b.left())))
        before = engine.stats()
        b.sync()
        t0 = time.perf_counter()
        futs = [engine.submit(p, SamplingParams(max_new_tokens=n, temperature=1.0)) for p, n in zip(prompts, lengths)]
        done_at = [0.0] * len(futs)
        for i, f in enumerate(futs):
            f.add_done_callback(lambda _f, i=i: done_at.__setitem__(i, time.perf_counter() - t0))
        # the wait is capped (--engine-cap-s, and the budget): past it the figures are those of the
        # tokens generated so far (engine stats), marked truncated; engine.stop aborts the rest
        cap = max(1.0, min(b.left(), b.args.engine_cap_s))
        done, not_done = concurrent.futures.wait(futs, timeout=cap)
        b.sync()
        wall = time.perf_counter() - t0
        after = engine.stats()
        outs = [f.result() for f in futs if f in done]  # (a decode-thread failure raises here)
    finally:
        engine.stop()
    gen = sum(len(o.token_ids) for o in outs) if not not_done else after["generated_tokens"] - before["generated_tokens"]
    d = {k: after[k] - before[k] for k in ("busy_seconds", "prefill_seconds", "sample_seconds", "generated_tokens",
                                           "prefill_tokens", "decode_steps", "prefill_forwards", "merge_seconds")}
    prof = _profile_delta(after["decode_profile"], before["decode_profile"])
    common = sorted(sorted(prof, key=lambda s: -prof[s][0])[:6] + ([max_batch] if max_batch in prof else []))
    decode_profile = {str(s): {"steps": prof[s][0], "ms_per_step": 1e3 * prof[s][1] / prof[s][0],
                               "tokens_per_s": s * prof[s][0] / prof[s][1] if prof[s][1] > 0 else None}
                      for s in dict.fromkeys(common)}
    lat = sorted(done_at[i] for i, f in enumerate(futs) if f in done) or [float("nan")]
    return {
        "max_batch": max_batch, "requests": len(prompts), "requested_tokens": sum(lengths), "generated_tokens": gen,
        "truncated": bool(not_done), "finished_requests": len(outs), "cap_s": cap,
        "finished_stop": sum(o.finish_reason == "stop" for o in outs), "wall_s": wall, "tokens_per_s": gen / wall,
        "warmup_s": t_warm, "engine": d, "engine_busy_fraction": d["busy_seconds"] / wall,
        "decode_ms_per_step": 1e3 * (d["busy_seconds"] - d["prefill_seconds"]) / max(1, d["decode_steps"]),
        "sample_ms_per_step": 1e3 * d["sample_seconds"] / max(1, d["decode_steps"]),
        "host_overhead_s": wall - d["busy_seconds"] - d["sample_seconds"] - d["merge_seconds"],
        "decode_profile": decode_profile, "latency_s": {"p50": lat[len(lat) // 2], "p90": lat[int(0.9 * (len(lat) - 1))],
                                                        "max": lat[-1]},
        "dtype": after["dtype"], "peak_memory_gb": b.peak_memory_gb(), "memory_before_gb": mem_before,
    }


def run_engine(b: Bench) -> None:
    sec = b.section("engine")
    batches = [int(x) for x in b.args.engine_batches.split(",")]
    for mi, ref in enumerate(b.args.model_list):
        row = sec.setdefault(ref, {"_name": f"engine/{ref}"})

        def prepare(ref=ref, row=row):
            lm = b.loaded(ref)
            model = copy.deepcopy(lm.model)  # (on the device) the engine casts its copy to bf16 in place
            row["parameters"] = sum(p.numel() for p in model.parameters())
            prompts, lengths = engine_workload(model.config.vocab_size, b.args)
            row["workload"] = {"requests": len(prompts), "requested_tokens": sum(lengths), "length_p50": sorted(lengths)[len(lengths) // 2],
                               "length_mean": statistics.fmean(lengths), "length_max": max(lengths),
                               "prompt_tokens": sum(map(len, prompts))}
            return {"model": model, "tok": lm.tokenizer, "prompts": prompts, "lengths": lengths}

        state: dict = {}
        try:
            state.update(prepare())
        except Exception:
            row["error"] = traceback.format_exc()[-6000:]
            b.results["errors"].append(f"engine/{ref}/prepare")
            b.save()
            continue
        # the first model: every batch size now; later ones: the largest now, the rest deferred
        now = batches if mi == 0 else [max(batches)]
        later = [x for x in batches if x not in now]

        def one(mb, state=state):
            return engine_run(b, state["model"], state["tok"], state["prompts"], state["lengths"], mb)

        for mb in now:
            b.item(row, f"max_batch_{mb}", lambda mb=mb: one(mb))
        if later:
            done = row.get(f"max_batch_{max(batches)}") or {}
            est = 2.5 * done.get("item_s", 60.0)

            def extra(later=later, row=row, state=state, one=one):
                for mb in later:
                    b.item(row, f"max_batch_{mb}", lambda mb=mb: one(mb))
                state.clear()
                b.free_memory()

            b.deferred.append((f"engine/{ref}/max_batch_{','.join(map(str, later))}", est, extra))
        else:
            state.clear()
        b.free_memory()


# ----------------------------------------------------------------------------- 3. trainer


def synthetic_batch(vocab: int, n: int, group: int, prompt_len: int, response_len: int, seed: int):
    """GRPO-like trajectories: groups of ``group`` responses (``response_len`` +-50%) sharing a
    prompt (``prompt_len`` +-25%), rewards half 1 / half 0 in every group."""
    from conveyor.types import Sample, Trajectory

    rng = random.Random(seed)
    sample = Sample(id="bench/0", question="q", answer="0", dataset="bench")
    trajs = []
    for i in range(n):
        if i % group == 0:
            prompt = [rng.randrange(vocab) for _ in range(max(4, round(prompt_len * rng.uniform(0.75, 1.25))))]
        r = max(2, round(response_len * rng.uniform(0.5, 1.5)))
        trajs.append(Trajectory(sample=sample, group_id=f"g{i // group}", prompt_ids=prompt,
                                response_ids=[rng.randrange(vocab) for _ in range(r)], behaviour_logprobs=[-2.0] * r,
                                versions=[0] * r, reward=float(i % 2)))
    return trajs


def trainer_run(b: Bench, model, n_seq: int, micro_batch_tokens: int) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from conveyor.config import LossConfig, TrainerConfig
    from conveyor.trainer.trainer import Trainer

    a = b.args
    b.need(10, "trainer update")
    trajs = synthetic_batch(model.config.vocab_size, n_seq, a.group_size, a.prompt_len, a.response_len, a.seed)
    cfg = TrainerConfig(device=a.device, bf16=True, lr=1e-6, warmup_steps=0, total_steps=1000,
                        micro_batch_tokens=micro_batch_tokens, pack_row_tokens=a.pack_row_tokens)
    b.reset_peak_memory()
    mem_before = b.memory_gb()
    trainer = Trainer(model, cfg, LossConfig(kl_coef=0.0), temperature=1.0)
    try:
        packed = trainer.pack(trajs)
        forward = sum(int((mb.seq_index >= 0).sum()) for mb in packed.micro_batches)
        padded = sum(mb.input_ids.numel() for mb in packed.micro_batches)
        response = sum(len(t.response_ids) for t in trajs)
        warm_s, m = b.timed(lambda: trainer.train_step(trajs))
        secs, mets = [], []
        for i in range(a.updates):
            if i and b.left() < 2 * max(secs) + 5:
                break  # (the budget: the updates done so far are the figure)
            b.need(2 * warm_s + 5, "timed trainer update")
            s, m = b.timed(lambda: trainer.train_step(trajs))
            secs.append(s)
            mets.append(m)
        peak = b.peak_memory_gb()
        flops = flop_note = None
        if b.left() > 3 * max(secs) + 5:
            try:  # its own try: a counting failure keeps the timings
                with FlopCounterMode(display=False) as fc:
                    trainer.train_step(trajs)
                flops = fc.get_total_flops()
            except Exception as e:
                flop_note = f"{type(e).__name__}: {e}"[:2000]
                b.results["errors"].append(f"trainer/flop_counter ({flop_note[:200]})")
        else:
            flop_note = "skipped: time budget"
    finally:
        trainer = None  # optimizer state and gradients freed before the next model / retry
        b.free_memory()
    med = _median(secs)
    n_params = sum(p.numel() for p in model.parameters())
    pk = bf16_peak_tflops(b)
    six_nt = 6.0 * n_params * forward
    res = {
        "sequences": n_seq, "groups": -(-n_seq // a.group_size), "micro_batch_tokens": micro_batch_tokens,
        "pack_row_tokens": a.pack_row_tokens, "micro_batches": len(packed.micro_batches),
        "forward_tokens": forward, "padded_tokens": padded, "response_tokens": response,
        "loss_tokens": mets[-1]["train/tokens"] if mets else m["train/tokens"],
        "warmup_s": warm_s, "update_s": med, "update_s_all": secs, "timed_updates": len(secs),
        "forward_tokens_per_s": forward / med, "response_tokens_per_s": response / med,
        "trainer_metrics_time": {k: v for k, v in (mets[-1] if mets else m).items() if k.startswith("time/")},
        "skipped_nonfinite": max((x["train/skipped_nonfinite"] for x in mets), default=None),
        "peak_memory_gb": peak, "memory_before_gb": mem_before, "parameters": n_params,
        "flops_per_update": flops, "flops_error": flop_note, "tflops_achieved": flops / med / 1e12 if flops else None,
        "flops_6NT": six_nt, "tflops_6NT": six_nt / med / 1e12,
        "peak_bf16_tflops": pk,
        "mfu": flops / med / (pk * 1e12) if flops and pk else None,
        "mfu_6NT": six_nt / med / (pk * 1e12) if pk else None,
        "flops_counted": "FlopCounterMode: every matmul / addmm / bmm / attention call executed in one update "
                         "(forward, backward, the vocabulary projection recomputed under checkpointing); "
                         "elementwise work not counted. 6NT: 6 x parameters x forward positions.",
    }
    return res


def run_trainer(b: Bench) -> None:
    sec = b.section("trainer")
    a = b.args
    for ref in a.model_list:
        row = sec.setdefault(ref, {"_name": f"trainer/{ref}"})

        def run(ref=ref, row=row):
            model = b.loaded(ref, pop=True).model
            attempts = [(a.trainer_seqs, a.micro_batch_tokens), (a.trainer_seqs, max(256, a.micro_batch_tokens // 4)),
                        (max(a.group_size, a.trainer_seqs // 2), max(256, a.micro_batch_tokens // 4))]
            failures = []
            try:
                for n_seq, mbt in attempts:
                    try:
                        res = trainer_run(b, model, n_seq, mbt)
                    except Exception as e:
                        if not _is_oom(e):
                            raise
                        failures.append({"sequences": n_seq, "micro_batch_tokens": mbt, "error": f"{type(e).__name__}: {e}"[:1000]})
                        row["out_of_memory"] = failures
                        res = None
                    if res is None:  # (out of the except block: its traceback no longer holds the tensors)
                        b.free_memory()
                        b.save()
                        continue
                    res["out_of_memory_before"] = failures
                    return res
                raise RuntimeError(f"out of memory at every size tried: {failures}")
            finally:
                del model
                b.free_memory()

        b.item(row, "result", run)


# ----------------------------------------------------------------------------- 4. async


def train_run(b: Bench, name: str, overrides: list[str]) -> dict:
    """One ``conveyor train`` subprocess; its loop's figures (as benchmarks/async_vs_sync.py)."""
    b.need(20, f"conveyor train {name}")
    run_dir = b.tmp / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "conveyor.cli", "train", *overrides, f"run.dir={run_dir}"]
    logs = b.tmp / f"{name}.log"
    t0 = time.perf_counter()
    with open(logs, "w") as log:
        b.child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                   env=_child_env())
        try:
            rc = b.child.wait(timeout=max(5.0, b.left()))
        except subprocess.TimeoutExpired:
            _kill(b.child)
            b.child.wait()
            raise TimeoutError(f"{name}: killed at the end of the time budget; log tail:\n"
                               f"{logs.read_text(errors='replace')[-3000:]}") from None
        except BaseException:  # SIGTERM (Terminated), Ctrl-C: the run and what it started go too
            _kill(b.child)
            b.child.wait()
            raise
        finally:
            b.child = None
    process_s = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"{name}: exit {rc} ({' '.join(cmd)}); log tail:\n{logs.read_text(errors='replace')[-4000:]}")
    summ = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    busy_steady = None
    if len(metrics) > 1:
        span = metrics[-1]["time/elapsed_s"] - metrics[0]["time/elapsed_s"]
        work = sum(m["time/train_step_s"] + m.get("time/weight_sync_s", 0.0) for m in metrics[1:])
        busy_steady = work / span if span > 0 else None
    est = run_dir / "engine_stats.json"
    eng = json.loads(est.read_text()) if est.is_file() else {}
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()] \
        if (run_dir / "events.jsonl").is_file() else []
    devs = next((e for e in events if e.get("event") == "devices"), {})
    prec = next((e for e in events if e.get("event") == "precision"), {})
    return {
        "wall_s": summ["wall_seconds"], "process_s": process_s, "steps": summ["steps"],
        "trainer_busy": summ["trainer_busy"], "trainer_busy_steady": busy_steady, "engine_busy": summ["engine_busy"],
        "train_step_s_median": _median([m["time/train_step_s"] for m in metrics]),
        "staleness_max": max((m["staleness/max"] for m in metrics), default=None),
        "generated_tokens": eng.get("generated_tokens"), "engine_dtype": eng.get("dtype"),
        "generated_tokens_per_wall_s": eng["generated_tokens"] / summ["wall_seconds"] if eng.get("generated_tokens") else None,
        "devices": {k: devs.get(k) for k in ("trainer", "engine")}, "bf16": prec.get("bf16"),
    }


def _child_env() -> dict[str, str]:
    """This environment, with the source tree of the imported conveyor on PYTHONPATH as an absolute
    path (a relative ``PYTHONPATH=src`` breaks in a child started elsewhere)."""
    import conveyor

    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    src = Path(conveyor.__file__).resolve().parents[1]
    if src == (ROOT / "src").resolve():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH")) if p)
    return env


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def async_pair(b: Bench, prof: str, overrides: list[str]) -> None:
    sec = b.section("async")
    row = sec.setdefault(f"profile_{prof}", {"_name": f"async/profile_{prof}", "overrides": overrides})
    for eta in b.args.etas:
        b.item(row, f"eta{eta}", lambda eta=eta: train_run(b, f"{prof}_eta{eta}", overrides + [f"async.eta={eta}"]))
    e0, e2 = row.get("eta0") or {}, row.get("eta2") or {}
    if "wall_s" in e0 and "wall_s" in e2:
        row["wall_ratio_eta0_over_eta2"] = e0["wall_s"] / e2["wall_s"]
    b.save()


def run_async(b: Bench) -> None:
    a = b.args
    model = str(Path(ensure_model_dir(a.async_model, b.results)).resolve())
    common = [
        f"model.name={model}", "model.init=random", f"trainer.device={a.device}", f"rollout.engine_device={a.device}",
        f"trainer.total_steps={a.async_steps}", "run.eval_before=false", "run.eval_after=false", "run.export=false",
        "run.progress=false", "run.checkpoint_every=1000", f"trainer.batch_size={a.async_batch}",
        f"rollout.group_size={a.group_size}", f"rollout.max_new_tokens={a.async_max_new_tokens}",
        "rollout.engine_dtype=auto", "trainer.warmup_steps=0", "loss.kl_coef=0", "async.wait_for_expiring=false",
    ]
    b.section("async")["model"] = a.async_model
    async_pair(b, "a", common)
    row = b.section("async")["profile_a"]
    est = 1.5 * sum((row.get(f"eta{e}") or {}).get("item_s", 60.0) for e in a.etas) + 10
    lat = [f"rollout.env_latency.median_s={a.latency_median}", f"rollout.env_latency.sigma={a.latency_sigma}"]
    b.deferred.append(("async/profile_b", est, lambda: async_pair(b, "b", common + lat)))


# ----------------------------------------------------------------------------- main


SECTIONS = {"peak": run_peak, "engine": run_engine, "trainer": run_trainer, "async": run_async}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--models", default=".gpu/models/smollm2-135m,.gpu/models/qwen2-1.5b",
                    help="comma list of model directories (scripts/shape_models.py)")
    ap.add_argument("--sections", default="peak,engine,trainer,async")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the CPU smoke test)")
    ap.add_argument("--out", default="gpu_bench.json")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds from the start; optional items run only while time is left, waits end there "
                         "(default 225; --quick 900)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sdpa", choices=("default", "no_cudnn"), default="default",
                    help="no_cudnn: torch.backends.cuda.enable_cudnn_sdp(False) for the whole run")
    # peak
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--matmul-warmup", type=int, default=3)
    ap.add_argument("--matmul-iters", type=int, default=10)
    # engine
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=128)
    ap.add_argument("--median-len", type=float, default=128.0)
    ap.add_argument("--sigma-len", type=float, default=1.0)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--engine-batches", default="64,256")
    ap.add_argument("--engine-cap-s", type=float, default=45.0,
                    help="longest wait for one engine run; past it the tokens so far count (truncated)")
    # trainer
    ap.add_argument("--trainer-seqs", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--pack-row-tokens", type=int, default=4096)
    ap.add_argument("--updates", type=int, default=3, help="timed updates after one warm-up (median)")
    # async
    ap.add_argument("--async-model", default=None, help="default: the smollm2-135m entry of --models, else the first")
    ap.add_argument("--async-steps", type=int, default=6)
    ap.add_argument("--async-batch", type=int, default=4)
    ap.add_argument("--async-max-new-tokens", type=int, default=128)
    ap.add_argument("--latency-median", type=float, default=2.0)
    ap.add_argument("--latency-sigma", type=float, default=0.5)
    a = ap.parse_args(argv)
    if a.quick:
        a.matmul_n, a.matmul_warmup, a.matmul_iters = 256, 1, 3
        a.requests, a.prompt_min, a.prompt_max, a.median_len, a.max_len, a.engine_batches = 16, 8, 16, 8.0, 32, "4,16"
        a.trainer_seqs, a.prompt_len, a.response_len, a.micro_batch_tokens, a.pack_row_tokens, a.updates = 8, 16, 16, 256, 128, 1
        a.async_steps, a.async_max_new_tokens, a.latency_median = 2, 16, 0.2
    if a.budget_s is None:
        a.budget_s = 900.0 if a.quick else 225.0
    a.model_list = [m for m in a.models.split(",") if m]
    a.section_list = [s for s in a.sections.split(",") if s]
    bad = [s for s in a.section_list if s not in SECTIONS]
    if bad or not a.model_list:
        ap.error(f"--sections: unknown {bad} (known: {','.join(SECTIONS)})" if bad else "--models: none given")
    if a.async_model is None:
        a.async_model = next((m for m in a.model_list if Path(m).name == "smollm2-135m"), a.model_list[0])
    a.etas = [0, 2]
    return a


def summary(b: Bench) -> dict:
    s = b.results["sections"]
    out: dict = {"device": str(b.dev), "gpu": b.results["env"].get("gpu_name"), "elapsed_s": round(b.elapsed(), 1),
                 "out": str(b.out), "errors": b.results["errors"], "skipped": b.results["skipped"]}
    pk = s.get("peak", {})
    for k in ("bf16", "fp32_tf32_off", "fp32_tf32_on"):
        if isinstance(pk.get(k), dict) and "tflops_median" in pk[k]:
            out[f"peak_{k}_tflops"] = float(f"{pk[k]['tflops_median']:.3g}")  # 3 significant digits: a CPU's bf16 is ~0.005
    eng = {}
    for ref, row in s.get("engine", {}).items():
        if isinstance(row, dict) and not ref.startswith("_"):
            eng[Path(ref).name] = {k.removeprefix("max_batch_"): round(v["tokens_per_s"], 1)
                                   for k, v in row.items() if k.startswith("max_batch_") and isinstance(v, dict)
                                   and "tokens_per_s" in v}
    if eng:
        out["engine_tokens_per_s"] = eng
    tr = {}
    for ref, row in s.get("trainer", {}).items():
        r = row.get("result") if isinstance(row, dict) else None
        if isinstance(r, dict) and "update_s" in r:
            tr[Path(ref).name] = {"update_s": round(r["update_s"], 3), "forward_tok_s": round(r["forward_tokens_per_s"]),
                                  "response_tok_s": round(r["response_tokens_per_s"]),
                                  "mfu": r["mfu"] and round(r["mfu"], 4), "mfu_6NT": r["mfu_6NT"] and round(r["mfu_6NT"], 4),
                                  "peak_memory_gb": r["peak_memory_gb"] and round(r["peak_memory_gb"], 2)}
    if tr:
        out["trainer"] = tr
    asy = {}
    for prof, row in s.get("async", {}).items():
        if isinstance(row, dict) and prof.startswith("profile_"):
            asy[prof] = {"wall_ratio_eta0_over_eta2": row.get("wall_ratio_eta0_over_eta2"),
                         **{f"eta{e}": {k: (row.get(f"eta{e}") or {}).get(k) for k in ("wall_s", "trainer_busy", "engine_busy")}
                            for e in b.args.etas}}
    if asy:
        out["async"] = asy
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.sdpa == "no_cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    b = Bench(args)

    def on_term(signum, _frame):
        raise Terminated(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        b.item(b.results, "env", lambda: env_info(b))
        for name in args.section_list:
            sec = b.section(name)
            b.item(sec, "_run", lambda name=name: SECTIONS[name](b) or {"ok": True})
        while b.deferred:  # optional items, while the budget allows
            name, est, fn = b.deferred.pop(0)
            row = b.results.setdefault("deferred", {"_name": "deferred"})

            def go(name=name, est=est, fn=fn):
                b.need(est, name)
                fn()
                return {"ran": True, "estimate_s": est}

            b.item(row, name, go)
    except Terminated as e:
        b.results["terminated"] = f"{e} at {b.elapsed():.0f} s"
        b.results["errors"].append("terminated")
    finally:
        signal.signal(signal.SIGTERM, old)
        b.models.clear()
        shutil.rmtree(b.tmp, ignore_errors=True)
        b.save()
    res = summary(b)
    print(json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    r = main(sys.argv[1:])
    sys.exit(0)
