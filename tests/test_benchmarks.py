"""Every benchmark's ``--quick`` mode runs (so the scripts never rot) and reports sane figures.

The figures themselves are measured by the full runs and recorded under docs/results/; these tests
only check that each script runs end to end on the tiny model and that its output is consistent.

The scripts run as subprocesses, two at a time (longest first) and at the lowest CPU priority
(nice 19), started as the session's test loop starts (``tests/conftest.py`` calls
:func:`start_scripts`; this module's tests run last): they use the cores the rest of the suite
leaves idle (Ray start-up, process start-up, waits; ~45% of two cores during the Ray tests) and
this module's tests then wait for their results (the suite: 18:40 -> 12:46 on the 2-core VM).
Only the scripts of the selected tests run (``-k`` picks one, it runs one). Each script runs in
a process group of its own, killed with everything it started when the session ends early.
Not made for pytest-xdist (each worker would start the scripts).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests._scripts import load_script

HAS_PEFT = importlib.util.find_spec("peft") is not None

ROOT = Path(__file__).resolve().parents[1]
WORKERS = 2  # scripts running at once
# the first test waits for most of the module's scripts (pytest-timeout counts per test)
pytestmark = pytest.mark.timeout(1800)

# test -> (script, arguments; "{out}" is this module's scratch directory). Longest first (seconds
# measured one at a time on the 2-core development VM): the pool runs them in this order.
SCRIPTS: dict[str, tuple[str, list[str]]] = {
    "test_chaos_quick": ("chaos.py", ["--json", "{out}/chaos.json"]),  # ~95 s
    "test_async_vs_sync_benchmark_quick": ("async_vs_sync.py", ["--out", "{out}/avs"]),  # ~90 s
    "test_runtime_overhead_benchmark_quick": ("runtime_overhead.py", []),  # ~83 s
    "test_proximal_costs_benchmark_quick": ("proximal_costs.py", []),  # ~73 s
    "test_gpu_benchmark_quick": ("gpu.py", ["--device", "cpu", "--models", "{out}/models/tiny",
                                            "--out", "{out}/gpu.json"]),  # ~65 s
    "test_staleness_robustness_benchmark_quick": ("staleness_robustness.py", ["--out", "{out}/st"]),  # ~59 s
    "test_trainer_benchmark_quick": ("trainer.py", []),  # ~41 s
    "test_critic_benchmark_quick": ("critic.py", ["--json", "{out}/critic.json"]),  # ~20 s
    "test_critic_learning_benchmark_quick": ("critic_learning.py", ["--json", "{out}/critic_learning.json"]),  # ~15 s
    "test_prefix_cache_benchmark_quick": ("prefix_cache.py", []),  # ~13 s
    "test_critic_methods_benchmark_quick": ("critic_methods.py", ["--out", "{out}/cm", "--json", "{out}/cm.json"]),  # ~12 s
    "test_prefix_cache_benchmark_with_updates_quick": ("prefix_cache.py", ["--update-every", "0.1"]),  # ~13 s
    "test_prefix_cache_benchmark_on_only_quick": ("prefix_cache.py", ["--on-only", "--update-every", "0.1"]),  # ~5 s
    "test_engine_benchmark_quick": ("engine.py", ["--dtype", "bfloat16", "--baseline"]),  # ~12 s
    "test_behaviour_weight_benchmark_quick": ("behaviour_weight.py", ["--compare"]),  # ~10 s
    "test_weight_sync_benchmark_quick": ("weight_sync.py", []),  # ~10 s
    "test_fsdp_benchmark_quick": ("fsdp.py", ["--json", "{out}/fsdp.json"]),  # ~25 s
    "test_lora_benchmark_quick": ("lora.py", ["--json", "{out}/lora.json"]),  # ~9 s
    "test_engine_scaling_benchmark_quick": ("engine_scaling.py", ["--json", "{out}/scaling.json"]),  # ~40 s
}


_PROCS: list[subprocess.Popen] = []  # started scripts (process-group leaders; killed by stop_scripts)
_LOCK = threading.Lock()
_STARTED: dict = {}  # "futures" (test -> Future of its CompletedProcess), "out", "pool"; "stopped"
SCRIPT_TIMEOUT_S = 2400  # from the start, which may be starved (nice 19) while the other tests run


def _kill_group(p: subprocess.Popen) -> None:
    """SIGKILL a script and everything it started (its own process group)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _launch(script: str, args: list[str], out: Path, name: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    # nice 19: idle cores only while other tests run (coreutils' nice: a preexec_fn can deadlock in threads)
    cmd = ["nice", "-n", "19", sys.executable, str(ROOT / "benchmarks" / script), "--quick", *args]
    # output to files, not pipes: a child the script started keeps no reader of ours waiting
    # named by the test: two tests may run the same script
    stdout, stderr = out / f"{name}.stdout", out / f"{name}.stderr"
    with _LOCK:
        if _STARTED.get("stopped"):
            raise RuntimeError("the test session ended before this script started")
        with open(stdout, "w") as fo, open(stderr, "w") as fe:
            p = subprocess.Popen(cmd, stdout=fo, stderr=fe, text=True, env=env, cwd=ROOT, start_new_session=True)
        _PROCS.append(p)
    note = ""
    try:
        p.wait(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill_group(p)
        p.wait()
        note = f"\n(killed after {SCRIPT_TIMEOUT_S} s: {' '.join(cmd)})"
    return subprocess.CompletedProcess(cmd, p.returncode, stdout.read_text(errors="replace"),
                                       stderr.read_text(errors="replace") + note)


def start_scripts(selected: set[str]) -> None:
    """Start the scripts of the ``selected`` test names in the background (no-op if none, or
    if already started). ``runtime_overhead.py`` only where Ray is installed (its test skips)."""
    todo = [t for t in SCRIPTS if t in selected
            and not (SCRIPTS[t][0] == "runtime_overhead.py" and importlib.util.find_spec("ray") is None)]
    if not todo or _STARTED:
        return
    out = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="bench")
    futures = {t: pool.submit(_launch, SCRIPTS[t][0], [a.format(out=out) for a in SCRIPTS[t][1]], out, t)
               for t in todo}
    _STARTED.update(futures=futures, out=out, pool=pool)


def stop_scripts() -> None:
    """Kill the scripts still running (with everything they started), wait for the pool, remove
    the scratch directory. Idempotent; no script starts afterwards."""
    with _LOCK:
        _STARTED["stopped"] = True
        for p in _PROCS:
            if p.poll() is None:
                _kill_group(p)
    if "pool" in _STARTED:
        _STARTED["pool"].shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(_STARTED["out"], ignore_errors=True)


@pytest.fixture(scope="module")
def quick(request):
    """``(futures, out)``: each selected test's script (a Future of its completed process), and
    the scratch directory its ``{out}`` arguments point into. Started when the test loop starts
    (conftest); here if the conftest hooks did not run. Stopped after this module."""
    start_scripts({item.originalname for item in request.session.items if getattr(item, "module", None) is request.module})
    yield _STARTED.get("futures", {}), _STARTED.get("out")
    stop_scripts()


def _run(quick, test: str) -> dict:
    """The last JSON line the test's script printed (its result); fails with its stderr."""
    p = quick[0][test].result()
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


def test_engine_benchmark_quick(quick):
    r = _run(quick, "test_engine_benchmark_quick")
    assert r["model"] == "tiny" and r["requests"] == 16 and r["engine_dtype"] == "bfloat16"
    b = r["baseline"]  # today's float32 engine on the same requests, same run
    assert b["dtype"] == "float32" and b["ratio_engine_over_baseline"] == pytest.approx(b["wall_s"] / r["engine_wall_s"])
    assert b["tokens_per_s"] == pytest.approx(r["useful_tokens"] / b["wall_s"])
    assert r["useful_tokens"] == pytest.approx(r["length_mean"] * r["requests"])
    # static batches decode every row to the batch's longest request: never fewer tokens than useful
    assert r["hf_generated_tokens_incl_waste"] >= r["useful_tokens"]
    assert r["ratio_engine_over_hf"] == pytest.approx(r["hf_wall_s"] / r["engine_wall_s"])
    assert 0 < r["engine_latency_s"]["p50"] <= r["engine_latency_s"]["p99"] <= r["engine_wall_s"] + 1e-6


def test_prefix_cache_benchmark_quick(quick):
    r = _run(quick, "test_prefix_cache_benchmark_quick")
    off, on = r["off"], r["on"]
    assert off["prefix_cache_hits"] == 0 and off["trajectories"] == on["trajectories"] == 16
    # every admitted token is either run through the model (a prefill, or a joined hit's tokens
    # in decode steps), deduplicated, or served from the cache
    assert off["prefix_hits_joined"] == off["prefix_fed_tokens"] == 0
    for side in (on, r["feed1"]):
        assert (off["prefill_tokens"] + off["prefill_dedup_tokens"]
                == side["prefill_tokens"] + side["prefill_dedup_tokens"] + side["prefix_cache_hit_tokens"]
                + side["prefix_fed_tokens"])
    # feeding only one token per hit (the engine before): each joined hit ran exactly one
    assert r["feed1"]["prefix_hits_joined"] == r["feed1"]["prefix_fed_tokens"]
    assert on["prefix_fed_tokens"] >= on["prefix_hits_joined"]
    assert r["engine_busy_ratio_feed1_over_on"] == pytest.approx(r["feed1"]["engine_busy_s"] / on["engine_busy_s"])
    assert r["identical_responses"] == 1.0  # the same computation: the same responses here
    assert r["update_every_s"] == 0 and off["weight_updates"] == on["weight_updates"] == 0
    assert r["engine_busy_ratio_off_over_on"] == pytest.approx(off["engine_busy_s"] / on["engine_busy_s"])


def test_prefix_cache_benchmark_with_updates_quick(quick):
    """``--update-every 0.1``: the same weights published every 0.1 s re-encode the rows in
    flight; with the cache a group's shared prompt runs once for its rows, without it never."""
    r = _run(quick, "test_prefix_cache_benchmark_with_updates_quick")
    off = r["off"]
    assert r["update_every_s"] == 0.1 and off["weight_updates"] > 0 and off["reencoded_tokens"] > 0
    assert off["reencode_prefix_tokens"] == 0
    per_token = off["reencode_profile"][2] / off["reencoded_tokens"]  # padded tokens run per token re-encoded
    for side in (r["on"], r["feed1"]):
        if side["reencoded_tokens"]:  # (a side can end before its first update)
            assert 0 < side["reencode_prefix_tokens"] < side["reencoded_tokens"]
            assert side["reencode_profile"][2] / side["reencoded_tokens"] < per_token / 2
    # the same computation up to float rounding (the updates land at different moments on each side)
    assert r["identical_responses"] >= 0.9


def test_prefix_cache_benchmark_on_only_quick(quick):
    """``--on-only``: the side with the cache alone, its re-encode count per token, no ratios."""
    r = _run(quick, "test_prefix_cache_benchmark_on_only_quick")
    assert "off" not in r and "engine_busy_ratio_off_over_on" not in r
    on = r["on"]
    assert on["prefix_cache_tokens"] > 0 and on["trajectories"] == 16 and r["update_every_s"] == 0.1
    assert on["reencode_padded_per_reencoded_token"] == pytest.approx(
        on["reencode_profile"][2] / max(on["reencoded_tokens"], 1))


def test_trainer_benchmark_quick(quick):
    r = _run(quick, "test_trainer_benchmark_quick")
    for side in ("naive", "conveyor"):
        assert r[side]["tokens_per_s"] > 0 and r[side]["peak_rss_gb"] >= r[side]["rss_after_load_gb"] > 0
    assert r["speedup_tokens_per_s"] == pytest.approx(r["conveyor"]["tokens_per_s"] / r["naive"]["tokens_per_s"])
    # bf16 chunked log-probs stay close to fp32 full log-softmax (nats)
    assert r["logprob_error"]["logprob_abs_err_max"] < 0.1
    assert r["conveyor_lean"]["tokens_per_s"] > 0 and r["lean_overrides"]["activation_checkpointing"] is True


def test_weight_sync_benchmark_quick(quick):
    r = _run(quick, "test_weight_sync_benchmark_quick")
    assert r["tied_aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert r["message_bytes_fp32"] < r["state_dict_bytes"] and r["message_bytes_bf16"] * 2 == r["message_bytes_fp32"]
    assert r["reencoded_tokens"] > 0 and r["interrupted_requests"] == r["requests"] == r["multi_version_requests"]
    assert r["pause_s"] > 0
    assert r["keep_kv"]["reencoded_tokens"] == 0 and r["keep_kv"]["multi_version_requests"] == r["requests"]


def test_lora_benchmark_quick(quick):
    pytest.importorskip("peft", reason="LoRA needs peft: pip install 'conveyor[lora]'")
    r = _run(quick, "test_lora_benchmark_quick")
    assert json.loads((quick[1] / "lora.json").read_text()) == r
    full, lora, merged, adapter = r["full"], r["lora"], r["lora_merged"], r["lora_adapter"]
    assert r["model"] == "tiny" and full["trainable_parameters"] == r["parameters"]
    assert full["message_bytes"] == 4 * r["parameters"]  # fp32, the tied embeddings once
    # only A and B train, and the adapter message is exactly them (fp32)
    assert 0 < lora["trainable_parameters"] < full["trainable_parameters"]
    assert adapter["message_bytes"] == 4 * lora["trainable_parameters"] < merged["message_bytes"] < full["message_bytes"]
    for row in (full, lora):  # AdamW: two fp32 moments per trained element (+ a step counter per tensor)
        assert 8 * row["trainable_parameters"] <= row["optimizer_state_bytes"] < 8 * row["trainable_parameters"] + 4096
    ratios = r["ratios"]
    assert ratios["optimizer_state_lora_over_full"] == pytest.approx(lora["optimizer_state_bytes"] / full["optimizer_state_bytes"])
    assert ratios["message_bytes_adapter_over_full"] == pytest.approx(adapter["message_bytes"] / full["message_bytes"])
    for name in ("merged", "adapter"):
        row = r[f"lora_{name}"]
        assert row["sync_s"] == pytest.approx(row["snapshot_s"] + row["apply_s"]) and row["sync_s"] > 0
        assert ratios[f"sync_s_{name}_over_full"] == pytest.approx(row["sync_s"] / full["sync_s"])
    assert adapter["engine_lora_base_bytes"] == merged["message_bytes"]  # W0 of the same matrices
    assert r["engine_max_abs_diff"] <= 1e-6  # both modes give the engine the same weights


def test_async_vs_sync_benchmark_quick(quick):
    r = _run(quick, "test_async_vs_sync_benchmark_quick")
    assert (quick[1] / "avs" / "summary.json").is_file()
    summ = json.loads((quick[1] / "avs" / "summary.json").read_text())
    for prof in ("a", "b"):
        runs = summ["profiles"][prof]["runs"]
        assert set(runs) == {"0", "2"}
        assert runs["0"]["staleness_max"] == 0 and runs["2"]["staleness_max"] <= 2
        assert runs["0"]["steps"] == runs["2"]["steps"] == 2
        assert runs["2"]["simulated_wall_s"] > 0 and runs["2"]["calibration_run"]
    assert r["profile"] == "b"


def test_gpu_benchmark_quick(quick):
    """benchmarks/gpu.py (made for a lent GPU machine) runs every section on the CPU, same code
    paths, with no error or skipped item; the model directory is written by scripts/shape_models.py."""
    r = _run(quick, "test_gpu_benchmark_quick")
    full = json.loads((quick[1] / "gpu.json").read_text())
    assert r["errors"] == full["errors"] == [] and r["skipped"] == full["skipped"] == [], r
    assert "traceback" not in json.dumps(full) and "terminated" not in full
    assert full["created_model_dirs"] == [str(quick[1] / "models" / "tiny")]
    s = full["sections"]
    assert set(s) == {"peak", "engine", "trainer", "async"}
    # (a CPU without bf16 arithmetic measured 0.004 bf16 TFLOP/s: rounded to 2 decimals it read 0.0)
    assert r["peak_bf16_tflops"] == float(f"{s['peak']['bf16']['tflops_median']:.3g}") > 0
    assert s["peak"]["fp32_tf32_off"]["tflops_median"] > 0
    (eng,) = [v for k, v in s["engine"].items() if not k.startswith("_")]
    for mb in (4, 16):
        row = eng[f"max_batch_{mb}"]
        assert row["dtype"] == "bfloat16" and row["requests"] == row["finished_requests"] == 16 and not row["truncated"]
        assert 0 < row["generated_tokens"] == row["engine"]["generated_tokens"] <= row["requested_tokens"]
        assert row["tokens_per_s"] == pytest.approx(row["generated_tokens"] / row["wall_s"])
        assert max(int(b) for b in row["decode_profile"]) <= mb and row["engine"]["decode_steps"] > 0
    (tr,) = [v["result"] for k, v in s["trainer"].items() if not k.startswith("_")]
    assert tr["update_s"] > 0 and tr["loss_tokens"] == tr["response_tokens"] and tr["forward_tokens"] <= tr["padded_tokens"]
    assert tr["flops_per_update"] > 0 and tr["peak_bf16_tflops"] == s["peak"]["bf16"]["tflops_median"]
    assert tr["mfu"] == pytest.approx(tr["flops_per_update"] / tr["update_s"] / (tr["peak_bf16_tflops"] * 1e12))
    for prof in ("profile_a", "profile_b"):  # b: the deferred agent-like pair (the budget allows it here)
        row = s["async"][prof]
        assert row["eta0"]["steps"] == row["eta2"]["steps"] == 2
        assert row["eta0"]["staleness_max"] == 0 and row["eta2"]["staleness_max"] <= 2
        assert row["wall_ratio_eta0_over_eta2"] == pytest.approx(row["eta0"]["wall_s"] / row["eta2"]["wall_s"])
        assert r["async"][prof]["wall_ratio_eta0_over_eta2"] == row["wall_ratio_eta0_over_eta2"]
    assert full["deferred"]["async/profile_b"]["ran"]


def test_gpu_benchmark_sdpa_no_cudnn(tmp_path):
    """``--sdpa no_cudnn`` turns PyTorch's cuDNN attention backend off for the run and records the
    choice in the results' environment (the engine's cuDNN-plan hypothesis, docs/results/gpu.md)."""
    import torch

    mod = _benchmark_module("gpu.py")
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        for choice, enabled in (("default", before), ("no_cudnn", False)):
            out = tmp_path / f"{choice}.json"
            mod.main(["--device", "cpu", "--quick", "--sections", "peak", "--sdpa", choice, "--out", str(out)])
            assert json.loads(out.read_text())["env"]["sdpa"] == choice
            assert torch.backends.cuda.cudnn_sdp_enabled() == enabled
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_proximal_costs_benchmark_quick(quick):
    r = _run(quick, "test_proximal_costs_benchmark_quick")
    assert r["table"]
    rows = {m: (copies, frac) for _eta, m, copies, frac in r["table"][:5]}
    assert set(rows) == {"recompute", "behavior", "interpolate", "ewma", "snapshot"}
    assert rows["recompute"] == (0.0, 0.0) and rows["behavior"][0] == 0.0
    runtime = {m: copies for _eta, m, copies, _frac in r["table"][5:]}
    assert runtime == {"recompute": 0.0, "partial_sync": 0.0, "dedicated": 1.0}
    assert rows["ewma"][0] == 1.0  # one EWMA copy
    assert rows["snapshot"][0] == 3.0  # eta + 1 = 2 snapshots + the scratch model


def test_staleness_robustness_benchmark_quick(quick):
    _run(quick, "test_staleness_robustness_benchmark_quick")
    summ = json.loads((quick[1] / "st" / "summary.json").read_text())
    cells = {(c["eta"], c["method"]): c for c in summ["cells"]}
    assert set(cells) == {(0, "ppo"), (0, "snapshot"), (2, "ppo"), (2, "snapshot")}
    assert all(c["staleness_max"] <= c["eta"] for c in cells.values())
    assert all(len(c["reward_curve"]) == 2 for c in cells.values())
    assert cells[(2, "snapshot")]["discrepancy_keep_frac"] is not None
    assert all(0.0 <= c["heldout_format_rate"] <= 1.0 for c in cells.values())  # the final policy was evaluated
    assert (quick[1] / "st" / "curves.png").is_file()


def test_behaviour_weight_benchmark_quick(quick):
    """Issue 10 section 1 on the tiny model: with sampling-mask replay the behaviour weight is 1
    and every token kept for every setting; without it (same batches) truncation down-weights
    every token by its kept mass."""
    r = _run(quick, "test_behaviour_weight_benchmark_quick")
    cells = {(c["top_p"], c["top_k"]): c for c in r["cells"]}
    assert set(cells) == {(p, k) for p in (1.0, 0.5) for k in (0, 20)}
    for (p, k), c in cells.items():
        plain = p == 1.0 and k == 0
        assert c["replay"] and c["tokens"] > 0 and (c["support_mean"] == 0) == plain
        assert abs(c["weight_mean"] - 1.0) < 0.02 and c["keep_frac"] >= 0.98, c
        old = c["without_replay_same_batches"]
        if plain:
            assert old["weight_mean"] == pytest.approx(c["weight_mean"], abs=1e-3)
        else:  # the old defect: pi_trainer / pi_behav = kept mass < 1
            assert old["weight_mean"] < 0.9 and old["keep_frac"] < 0.5, c
    assert cells[(1.0, 20)]["support_max"] == 20



def test_critic_benchmark_quick(quick):
    """SAO's critic cost against GRPO on the tiny model, all rows in one run: every row timed,
    the SAO rows spend time in their critic phase and take exactly K critic optimiser steps
    (fails if the critic phase were skipped or cut short)."""
    r = _run(quick, "test_critic_benchmark_quick")
    assert json.loads((quick[1] / "critic.json").read_text()) == r
    assert r["model"] == "tiny" and r["kl_coef"] == 0.0
    rows = {row["name"]: row for row in r["rows"]}
    assert list(rows) == ["grpo", "grpo, prompts not shared", "sao", "sao, values from the first update", "sao K=1",
                          "sao attention trained", "sao critic policy:1", "sao critic head",
                          "sao 2 head critics (asyppo)"] + (["sao critic lora r8"] if HAS_PEFT else [])
    grpo = rows["grpo"]
    for row in rows.values():
        assert row["seconds"] > 0 and row["tokens"] == grpo["tokens"] > 0, row["name"]
        assert row["ratio_seconds"] == pytest.approx(row["seconds"] / grpo["seconds"])
        assert row["peak_delta_gb"] is None or row["peak_delta_gb"] > 0
        assert row["train/skipped_nonfinite"] == 0
    # the single-response layout packs every prompt; GRPO shares a group's prompt
    assert rows["sao"]["positions"] == rows["grpo, prompts not shared"]["positions"] > grpo["positions"]
    assert grpo["critic_s"] == 0 and "critic/updates" not in grpo
    for name, k in (("sao", 2), ("sao K=1", 1), ("sao attention trained", 2), ("sao critic policy:1", 2),
                    ("sao critic head", 2), ("sao 2 head critics (asyppo)", 4)):  # K per critic
        row = rows[name]
        assert row["critic/updates"] == k and row["critic/skipped_nonfinite"] == 0, row
        assert row["critic_s"] > 0 and row["score_s"] > 0 and row["rest_s"] > 0, row
        assert row["critic_s"] + row["score_s"] < row["seconds"], row
    # FLOPs: a critic adds compute; the head critics' value inference is one policy-body pass for
    # all of them (shared states), so two heads infer no more than one
    for row in rows.values():
        assert row["gflop_step"] > 0, row["name"]
    assert grpo["gflop_values"] == 0 and "critic_gflop" not in grpo
    for name in ("sao", "sao K=1", "sao attention trained", "sao critic policy:1", "sao critic head",
                 "sao 2 head critics (asyppo)"):
        assert rows[name]["critic_gflop"] > 0 and rows[name]["gflop_values"] > 0, name
    assert rows["sao K=1"]["critic_gflop"] < rows["sao"]["critic_gflop"]
    assert rows["sao critic head"]["critic_gflop"] < 0.6 * rows["sao"]["critic_gflop"]
    # (a body pass per head critic would double both; the heads' own products are small)
    assert rows["sao 2 head critics (asyppo)"]["gflop_values"] < 1.5 * rows["sao critic head"]["gflop_values"]
    assert rows["sao 2 head critics (asyppo)"]["critic_gflop"] < 1.5 * rows["sao critic head"]["critic_gflop"]
    # values from the first critic update: no value pass of their own, the same critic steps
    folded = rows["sao, values from the first update"]
    assert folded["score_s"] == 0 and folded["critic_s"] > 0 and folded["critic/updates"] == 2
    assert folded["gflop_values"] == 0
    assert folded["critic_gflop"] == pytest.approx(rows["sao"]["critic_gflop"] - rows["sao"]["gflop_values"], rel=1e-3)
    assert folded["critic/value_loss"] == pytest.approx(rows["sao"]["critic/value_loss"], rel=1e-4)
    if HAS_PEFT:  # LoRA: the full critic's parameters, a small trainable share, and less compute
        lora = rows["sao critic lora r8"]
        assert lora["critic_params"] > rows["sao"]["critic_params"]  # + the adapters
        assert lora["critic_trainable_params"] < 0.2 * rows["sao"]["critic_trainable_params"]
        assert lora["critic/updates"] == 2 and lora["critic_gflop"] < rows["sao"]["critic_gflop"]
    # frozen attention trains fewer critic parameters; policy:1 keeps fewer of them
    assert rows["sao"]["critic_trainable_params"] < rows["sao attention trained"]["critic_trainable_params"]
    assert rows["sao critic policy:1"]["critic_params"] < rows["sao"]["critic_params"]
    # the head critic holds no backbone: a small fraction of a full critic's parameters
    assert rows["sao critic head"]["critic_params"] < 0.2 * rows["sao"]["critic_params"]
    assert rows["sao 2 head critics (asyppo)"]["critic_params"] == 2 * rows["sao critic head"]["critic_params"]

def test_chaos_quick(quick):
    """The chaos suite's quick mode (3 kill -9 + resume, damaged checkpoints, full disk, 100
    reward faults, non-finite losses): every row passes, and the audit would catch a defect
    (tests/test_chaos_audit.py breaks the logs on purpose)."""
    out = quick[1] / "chaos.json"
    p = quick[0]["test_chaos_quick"].result()
    rows = json.loads(out.read_text()) if out.is_file() else []
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    names = " ".join(r["name"] for r in rows)
    for part in ("kill -9 x 3", "truncated newest checkpoint", "disk full", "100 injected reward faults", "non-finite"):
        assert part in names, names
    assert all(r["ok"] and not r["problems"] for r in rows)


def test_runtime_overhead_benchmark_quick(quick):
    pytest.importorskip("ray")
    r = _run(quick, "test_runtime_overhead_benchmark_quick")
    assert [x["runtime"] for x in r["runs"]] == ["inline", "ray"] and all(x["steps"] == 1 for x in r["runs"])
    assert r["ray_over_inline"] == pytest.approx(r["s_per_update"]["ray"] / r["s_per_update"]["inline"])
    t = r["transport"]
    assert t["message_mb"] > 0 and t["object_store_s"] > 0 and t["disk_s"] > 0
    assert t["bf16_over_fp32"] == pytest.approx(t["object_store_bf16_s"] / t["object_store_s"])


def test_fsdp_benchmark_quick(quick):
    r = _run(quick, "test_fsdp_benchmark_quick")
    assert json.loads((quick[1] / "fsdp.json").read_text()) == r
    single, fsdp = r["single"], r["fsdp"]
    assert r["model"] == "tiny" and single["processes"] == 1 and fsdp["processes"] == r["world"] == 2
    assert fsdp["micro_batches"] == single["micro_batches"] >= 2  # the same packed batch on both sides
    assert r["loss_abs_diff"] < 1e-5  # the same update
    # each process holds half of every parameter, gradient and AdamW moment (tiny's dims are even)
    assert fsdp["max_over_ranks"]["param_bytes"] * 2 == single["rank0"]["param_bytes"]
    assert fsdp["max_over_ranks"]["grad_bytes"] * 2 == single["rank0"]["grad_bytes"]
    assert r["ratios"]["optimizer_state_bytes_per_process"] == pytest.approx(0.5, abs=0.001)
    assert r["ratios"]["step_s"] == pytest.approx(fsdp["rank0"]["step_s"] / single["rank0"]["step_s"])
    assert fsdp["rank0"]["weight_gather_s"] > 0


def test_engine_scaling_benchmark_quick(quick):
    r = _run(quick, "test_engine_scaling_benchmark_quick")
    assert json.loads((quick[1] / "scaling.json").read_text()) == r
    assert r["runtime"] == "inline" and [x["engines"] for x in r["runs"]] == [1, 2]
    one, two = r["runs"]
    assert len(one["per_engine_tokens"]) == 1 and len(two["per_engine_tokens"]) == 2 and min(two["per_engine_tokens"]) > 0
    assert r["updates_per_s_over_1_engine"]["2"] == pytest.approx(one["s_per_update"] / two["s_per_update"])
    cluster = r["predicted"]["cluster"]
    assert set(cluster) == {"1", "8", "64"} and cluster["1"]["efficiency_per_node"] == pytest.approx(1.0)
    assert cluster["64"]["trajectories_per_s"] > cluster["8"]["trajectories_per_s"] > cluster["1"]["trajectories_per_s"]


def _benchmark_module(script: str):
    """``benchmarks/<script>`` imported as a module (its functions called in-process)."""
    return load_script(f"benchmarks/{script}")


def test_critic_benchmark_runs_the_chosen_rows_and_grpo(capsys):
    """``--rows 4``: the GRPO reference row and row 4 (values from the first critic update), nothing else."""
    r = _benchmark_module("critic.py").main(["--quick", "--rows", "4"])
    assert [row["name"] for row in r["rows"]] == ["grpo", "sao, values from the first update"]
    assert r["rows"][1]["ratio_seconds"] == pytest.approx(r["rows"][1]["seconds"] / r["rows"][0]["seconds"])


@pytest.mark.parametrize("rows", ["99", "0", "three", "3,x"])
def test_critic_benchmark_rejects_unknown_rows(rows, capsys):
    with pytest.raises(SystemExit) as e:
        _benchmark_module("critic.py").main(["--quick", "--rows", rows])
    assert e.value.code == 2 and "--rows" in capsys.readouterr().err


def test_critic_methods_benchmark_quick(quick):
    """The critic-methods runs (issue 45, section 3) end to end on the tiny model: each arm trains
    exactly its preset's settings on the critic_mix task, only the first run evaluates before
    training, every run evaluates after, samples count the critic's warm-up rollouts."""
    r = _run(quick, "test_critic_methods_benchmark_quick")
    assert json.loads((quick[1] / "cm.json").read_text())["arms"] == r["arms"]
    assert r["failed"] == [] and set(r["runs"]) == {"grpo", "sao"}
    import yaml

    from conveyor.presets import find_preset

    for arm, preset in (("grpo", "grpo"), ("sao", "sao")):
        cfg = json.loads((quick[1] / "cm" / f"{arm}_s0" / "config.json").read_text())
        assert cfg["data"]["train"] == "critic_mix:train" and cfg["data"]["heldout"] == "critic_mix:heldout"
        assert cfg["trainer"]["total_steps"] == 2 and cfg["model"]["name"] == "tiny"
        assert cfg["run"]["checkpoint_every"] == 1000 and cfg["run"]["final_checkpoint"] == "none"  # no GBs per run
        for section, keys in yaml.safe_load(find_preset(preset).read_text()).items():
            for key, value in keys.items():
                if (section, key) not in (("trainer", "total_steps"), ("critic", "warmup_steps")):  # --quick's
                    assert cfg[section][key] == value, (arm, section, key)
    assert cfg["critic"]["warmup_steps"] == 1
    runs = {arm: r["runs"][arm]["0"] for arm in ("grpo", "sao")}
    assert (quick[1] / "cm" / "grpo_s0" / "eval_before.json").exists()
    assert not (quick[1] / "cm" / "sao_s0" / "eval_before.json").exists()
    assert runs["sao"]["before"] == runs["grpo"]["before"]  # the first run's, shared
    assert runs["grpo"]["samples"] == 2 * 16 and runs["sao"]["samples"] == (2 + 1) * 16  # + 1 warm-up update
    for row in runs.values():
        assert set(row["after"]) == {"all", "sums", "multiarith"} and row["seconds"] > 0
    assert r["arms"]["grpo"]["all"]["n"] == 1


def test_critic_methods_arms_are_presets_plus_their_own_keys():
    m = _benchmark_module("critic_methods.py")
    assert m.flatten({"a": {"b": 1, "c": {"d": None, "e": True}}, "f": [0, 1]}) == ["a.b=1", "a.c.d=null", "a.c.e=true", "f=[0, 1]"]
    full = m.arm_overrides("asyppo_full")
    assert "critic.num_critics=2" in full and full.index("critic.num_critics=1") > full.index("critic.num_critics=2")
    assert "critic.backbone=policy" in full and "critic.mask_low_frac=0" in full
    assert not any(o.startswith("trainer.total_steps=") for o in m.arm_overrides("sao"))
    with pytest.raises(SystemExit, match="unknown arm"):
        m.arm_overrides("ppo")


def test_critic_learning_benchmark_quick(quick):
    """The value-learning benchmark (issue 45) end to end on the tiny model: frozen-policy
    rollouts split by prompt (no prompt on both sides), each critic kind measured on the held-out
    half before and after its critic-only steps, the critic's values moved by the steps."""
    r = _run(quick, "test_critic_learning_benchmark_quick")
    saved = json.loads((quick[1] / "critic_learning.json").read_text())
    assert json.dumps(saved, sort_keys=True) == json.dumps(r, sort_keys=True)  # (NaN != NaN: compared as text)
    train, held = r["success_rates"]["train"], r["success_rates"]["heldout"]
    assert len(train) + len(held) == 8 and not set(train) & set(held) and len(held) >= 2
    assert r["train_responses"] == 4 * len(train) and r["heldout_responses"] == 4 * len(held)
    assert list(r["kinds"]) == ["policy", "head*2"]
    for kind, rows in r["kinds"].items():
        assert [row["step"] for row in rows] == [0, 2, 4], kind
        assert all(math.isfinite(row["value_mean"]) for row in rows)
        assert rows[-1]["value_mean"] != rows[0]["value_mean"], kind  # the critic trained
        assert len(rows[-1]["profile"]["failure"]) == 5
