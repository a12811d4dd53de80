"""The GPU path (issue 15 section 1): the engine and the trainer on a CUDA device against the same
models on the CPU. Skipped without CUDA (CI has none); run on a GPU machine with
``python -m pytest -q -m gpu tests/test_gpu.py`` (``scripts/gpu_check.sh`` does, with the
benchmarks). The models are random-weight models of a config directory (``model.init=random``):
``$CONVEYOR_SHAPE_MODELS/tiny`` when set (a GPU machine without the SmolLM2 package), else written
by ``scripts/shape_models.py``."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the GPU path's tests)")]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    env = os.environ.get("CONVEYOR_SHAPE_MODELS")
    if env:
        return Path(env) / "tiny"
    out = tmp_path_factory.mktemp("shapes")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "shape_models.py"), str(out)], check=True)
    return out / "tiny"


@pytest.fixture(scope="module")
def tiny_gpu(tiny_dir):
    from conveyor.models import load_model

    return load_model(str(tiny_dir), seed=0, init="random")


def _prompts(tok, n=6):
    qs = ["What is 2 + 3?", "Name a colour.", "Count to four.", "Why is the sky blue?", "Say hi.", "7 * 6 ="]
    return [tok.encode(q) for q in qs[:n]]


def _score_on_cpu(model, outs, temperature):
    """Per-token log-probs of each output's tokens under ``model`` (CPU, fp32), the engine's kept
    sets replayed: ``ScoringSpec.logprobs`` over packed micro-batches, as the trainer computes."""
    from conveyor.trainer.batch import pack, plan_micro_batches
    from conveyor.trainer.logprobs import ScoringSpec
    from conveyor.types import Sample, Trajectory

    trajs = [Trajectory(sample=Sample(f"s{i}", "q", "1", "t"), group_id=str(i), prompt_ids=o.prompt_ids,
                        response_ids=o.token_ids, behaviour_logprobs=o.logprobs, versions=o.versions,
                        sampling_mask=o.sampling_mask) for i, o in enumerate(outs)]
    spec = ScoringSpec(temperature=temperature, bf16=False, autocast_weight_cache=True, chunk_tokens=512,
                       micro_batch_tokens=4096, pack_row_tokens=384)
    got: dict[int, list[float]] = {}
    zeros = torch.zeros(len(trajs))
    for rows in plan_micro_batches([len(t.prompt_ids) + len(t.response_ids) for t in trajs], 4096, 384):
        mb = pack(trajs, zeros, rows)
        lp = spec.logprobs(model, mb)
        for s, i in enumerate(mb.indices):
            got[i] = lp[(mb.seq_index == s) & (mb.mask > 0)].tolist()
    return [got[i] for i in range(len(trajs))]


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=1.0, top_p=0.9, top_k=40)],
                         ids=["plain", "truncated"])
def test_cuda_engine_logprobs_match_cpu_scoring(tiny_gpu, params):
    """The engine on the GPU (float32) samples tokens whose behaviour log-probs are the CPU
    trainer's log-probs of the same tokens (kept sets replayed for truncated sampling)."""
    from conveyor.rollout.engine import InferenceEngine, SamplingParams

    cpu_model = copy.deepcopy(tiny_gpu.model).float().eval()
    engine = InferenceEngine(copy.deepcopy(tiny_gpu.model), tiny_gpu.tokenizer, max_batch_size=4, seed=1,
                             device="cuda", dtype=torch.float32)
    assert engine.device.type == "cuda" and next(engine.model.parameters()).is_cuda
    with engine:
        outs = engine.generate_batch(_prompts(tiny_gpu.tokenizer),
                                     SamplingParams(max_new_tokens=24, ignore_eos=True, **params))
    assert all(len(o.token_ids) == 24 and o.versions == [0] * 24 for o in outs)
    if "top_p" in params:
        assert all(o.sampling_mask is not None for o in outs)
        for o in outs:  # every sampled token lies in its kept set
            ids, off = o.sampling_mask.token_ids, o.sampling_mask.offsets
            assert all(t in ids[off[k]:off[k + 1]].tolist() for k, t in enumerate(o.token_ids))
    ref = _score_on_cpu(cpu_model, outs, params["temperature"])
    err = max(abs(a - b) for o, r in zip(outs, ref, strict=True) for a, b in zip(o.logprobs, r, strict=True))
    assert err < 2e-4, err
    stats = engine.stats()
    assert stats["generated_tokens"] == 24 * len(outs) and stats["busy_seconds"] > 0


@pytest.mark.parametrize("where", ["host", "pinned", "cuda"])
def test_cuda_engine_weight_update_mid_generation(tiny_gpu, where):
    """A weight update reaches the GPU engine between two decode steps from host, pinned host and
    device tensors: later tokens carry the new version, and every token's log-prob is the one of
    the weights that sampled it (re-encoded caches on the GPU)."""
    from conveyor.rollout.engine import InferenceEngine, SamplingParams
    from conveyor.sync import WeightUpdate

    old = copy.deepcopy(tiny_gpu.model).float().eval()
    new = copy.deepcopy(old)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    # (pinned host copies are made from a model on the GPU: a trainer's)
    upd = WeightUpdate.from_model(new if where == "host" else new.cuda(), 1, device="cuda" if where == "cuda" else "cpu",
                                  pin_memory=where == "pinned")
    first = next(iter(upd.tensors.values()))
    assert first.is_cuda == (where == "cuda") and first.is_pinned() == (where == "pinned")
    new = new.cpu()
    engine = InferenceEngine(copy.deepcopy(old), tiny_gpu.tokenizer, max_batch_size=8, seed=2, device="cuda")
    with engine:
        futs = [engine.submit(p, SamplingParams(max_new_tokens=60, temperature=1.0, ignore_eos=True))
                for p in _prompts(tiny_gpu.tokenizer, 3)]
        deadline = time.monotonic() + 60
        while engine.stats()["generated_tokens"] < 3 * 5:  # a few tokens decoded before the update
            assert time.monotonic() < deadline and not any(f.done() for f in futs), "the engine stopped decoding"
            time.sleep(0.001)
        engine.update_weights(upd)
        outs = [f.result(timeout=120) for f in futs]
    for name, t in engine.model.state_dict().items():
        src = upd.tensors.get(name)
        if src is not None:
            assert torch.equal(t.cpu(), src.cpu()), name
    assert all(o.versions[0] == 0 and o.versions[-1] == 1 for o in outs)
    old_lp, new_lp = _score_on_cpu(old, outs, 1.0), _score_on_cpu(new, outs, 1.0)
    for o, lo, ln in zip(outs, old_lp, new_lp, strict=True):
        for k, v in enumerate(o.versions):
            want = lo[k] if v == 0 else ln[k]
            assert abs(o.logprobs[k] - want) < 2e-4, (k, v, o.logprobs[k], want)


def _batch(model, n=8, group=4, seed=0):
    from conveyor.types import Sample, Trajectory

    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    out = []
    for i in range(n):
        p = torch.randint(3, vocab, (5 + i % 3,), generator=g).tolist()
        if i % group:
            p = list(out[i - i % group].prompt_ids)
        r = torch.randint(3, vocab, (4 + (i * 5) % 9,), generator=g).tolist()
        out.append(Trajectory(sample=Sample(f"s{i // group}", "q", "1", "t"), group_id=f"g{i // group}",
                              prompt_ids=p, response_ids=r, behaviour_logprobs=[-9.0] * len(r),
                              versions=[0] * len(r), reward=float(i % 3 == 0)))
    return out


def _trainer(model, device, **over):
    from conveyor.config import load_config
    from conveyor.trainer.trainer import build_trainer

    cfg = load_config(None, ["model.name=tiny", "trainer.bf16=false", "trainer.lr=1e-5", "trainer.warmup_steps=0",
                             f"trainer.device={device}", *[f"{k}={v}" for k, v in over.items()]])
    return build_trainer(cfg, copy.deepcopy(model))


@pytest.mark.parametrize("recipe", ["grpo", "sao", "lora"])
def test_cuda_trainer_matches_cpu_trainer(tiny_gpu, recipe):
    """Two updates on the same batches give the same metrics, the same first gradients and
    parameters and, for SAO, critic metrics and critic parameters on the GPU as on the CPU
    (float32). The parameters are compared at lr 1e-5: AdamW divides by sqrt(v), so rounding
    noise in a near-zero gradient element becomes a fraction of a step (the same trainer in float32
    and float64 on the CPU: 3.9e-5 apart after two steps at lr 1e-3, 3.9e-7 at lr 1e-5)."""
    over = {"grpo": {},
            "sao": {"loss.name": "dis", "loss.advantage": "gae", "loss.kl_coef": 0.0, "critic.updates_per_step": 2,
                    "critic.freeze_attention": "true", "critic.value_clip": 0.5},
            "lora": {"lora.enabled": "true", "lora.rank": 4}}[recipe]
    cpu, gpu = _trainer(tiny_gpu.model, "cpu", **over), _trainer(tiny_gpu.model, "cuda", **over)
    assert next(gpu.model.parameters()).is_cuda and not next(cpu.model.parameters()).is_cuda
    if recipe == "lora":  # the same adapters on both sides, however peft initialised them there
        gpu.lora.load_adapter_state(cpu.lora.adapter_state())
    for step in range(2):
        batch = _batch(tiny_gpu.model, seed=step)
        mc, mg = cpu.train_step(copy.deepcopy(batch)), gpu.train_step(copy.deepcopy(batch))
        for k in ("loss/loss", "train/grad_norm", "train/tokens", "train/entropy", "train/kl_ref", "critic/value_loss",
                  "critic/grad_norm", "critic/grad_norm_mlp", "critic/explained_variance"):
            if k in mc:
                assert mg[k] == pytest.approx(mc[k], rel=1e-4, abs=1e-6), (step, k)
        if step == 0:  # every gradient element, relative to its tensor's largest
            for (name, a), b in zip(cpu.model.named_parameters(), gpu.model.parameters(), strict=True):
                if a.grad is not None:
                    scale = float(a.grad.abs().max()) + 1e-12
                    assert float((a.grad - b.grad.cpu()).abs().max()) <= 1e-4 * scale, name
    for (name, a), b in zip(cpu.model.named_parameters(), gpu.model.parameters(), strict=True):
        assert torch.allclose(a, b.cpu(), rtol=0, atol=5e-6), name
    if recipe == "sao":
        assert gpu.critic is not None and next(gpu.critic.parameters()).is_cuda
        for (name, a), b in zip(cpu.critic.named_parameters(), gpu.critic.parameters(), strict=True):
            assert torch.allclose(a, b.cpu(), rtol=1e-4, atol=2e-5), name  # (critic lr 5e-5)
    state = gpu.state_dict()  # a GPU checkpoint loads into a CPU trainer
    buf = __import__("io").BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    again = _trainer(tiny_gpu.model, "cpu", **over)
    again.load_state_dict(torch.load(buf, map_location="cpu", weights_only=False))
    batch = _batch(tiny_gpu.model, seed=7)
    ma, mc = again.train_step(copy.deepcopy(batch)), cpu.train_step(copy.deepcopy(batch))
    assert ma["loss/loss"] == pytest.approx(mc["loss/loss"], rel=1e-3, abs=1e-5)


def test_cuda_trainer_bf16_auto_and_weight_staging(tiny_gpu):
    """trainer.bf16=auto turns bf16 autocast on for a GPU with bf16; an update runs under it; weight
    updates are staged in pinned host memory, or on the GPU for an engine on a GPU."""
    from conveyor.config import load_config
    from conveyor.trainer.trainer import build_trainer

    cfg = load_config(None, ["model.name=tiny", "trainer.device=cuda", "trainer.lr=1e-3"])
    tr = build_trainer(cfg, copy.deepcopy(tiny_gpu.model))
    assert tr.bf16 and "supports bf16" in tr.precision_note
    m = tr.train_step(_batch(tiny_gpu.model))
    assert m["train/tokens"] > 0 and torch.isfinite(torch.tensor(m["loss/loss"]))
    upd = tr.weight_update()
    t = next(iter(upd.tensors.values()))
    assert t.device.type == "cpu" and t.is_pinned() and upd.version == 1
    tr.publish_device = torch.device("cuda", 0)
    t = next(iter(tr.weight_update().tensors.values()))
    assert t.is_cuda
    for name, p in tr.model.state_dict().items():  # a copy, not the trainer's parameters
        if name in upd.tensors:
            assert torch.equal(upd.tensors[name], p.cpu()) and upd.tensors[name].data_ptr() != p.data_ptr()


def test_cuda_train_run_and_resume_on_cpu(tmp_path, tiny_dir):
    """``conveyor train`` on the GPU (auto devices), SAO's recipe with a critic warm-up; the run's
    checkpoint then resumes on the CPU."""
    from conveyor.config import load_config
    from conveyor.train import load_run_config, run_training

    run = tmp_path / "r"
    base = [f"model.name={tiny_dir}", "model.init=random", "trainer.batch_size=4", "rollout.max_new_tokens=10",
            "data.heldout_limit=3", "run.eval_max_new_tokens=6", "run.progress=false", "run.export=false",
            "reward.workers=1", "trainer.lr=1e-3", "rollout.tool=none", "critic.warmup_steps=1",
            "run.checkpoint_every=2"]
    res = run_training(load_config(str(ROOT / "configs" / "sao.yaml"),
                                   base + ["trainer.total_steps=2", f"run.dir={run}"]))
    assert res.steps == 2 and not res.interrupted
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    prec = [e for e in events if e["event"] == "precision"]
    assert prec and prec[0]["bf16"] is True  # auto on a bf16 GPU
    devices = [e for e in events if e["event"] == "devices"]
    assert devices and devices[0]["trainer"] == "cuda:0" and devices[0]["engine"].startswith("cuda")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["train/tokens"] > 0 for r in rows)
    res2 = run_training(load_run_config(run, ["trainer.total_steps=3", "trainer.device=cpu",
                                              "rollout.engine_device=cpu"]), resume_dir=run)
    assert res2.steps == 3
