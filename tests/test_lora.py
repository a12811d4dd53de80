"""LoRA training of the policy through peft (issue 15 section 2; conveyor.trainer.lora): the merge
formula checked by hand, only adapters train, both weight-sync modes give the engine the same
weights, the KL reference is the base model, exact resume, a 2-step run with its export, and
the errors of bad settings."""

from __future__ import annotations

import copy
import json
import math
import pickle
import shutil

import pytest
import torch

pytest.importorskip("peft", reason="LoRA needs peft: pip install 'conveyor[lora]'")

from conveyor.config import (  # noqa: E402
    ConfigError,
    LoraConfig,
    LossConfig,
    ProximalConfig,
    TrainerConfig,
    load_config,
)
from conveyor.rollout.engine import InferenceEngine, SamplingParams  # noqa: E402
from conveyor.sync import LoraFactors, WeightUpdate, write_weights  # noqa: E402
from conveyor.trainer.logprobs import token_logprobs  # noqa: E402
from conveyor.trainer.lora import apply_lora, lora_layers  # noqa: E402
from conveyor.trainer.trainer import Trainer  # noqa: E402
from tests.test_trainer import make_trajs  # noqa: E402

# peft calls transformers' deprecated is_gradient_checkpointing when it wraps a model
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
TC = TrainerConfig(lr=1e-2, warmup_steps=0, bf16=False)


def lora_trainer(tiny, sync="merged", *, kl_coef=0.0, bf16=False, proximal="recompute", **lora):
    model = copy.deepcopy(tiny.model)
    return Trainer(model, TC.model_copy(update={"bf16": bf16}), LossConfig(kl_coef=kl_coef),
                   proximal_cfg=ProximalConfig(method=proximal), eta=2,
                   lora_cfg=LoraConfig(enabled=True, sync=sync, **lora))


def trained(tiny, sync="merged", steps=2, **kw):
    tr = lora_trainer(tiny, sync, **kw)
    for s in range(steps):
        tr.train_step(make_trajs(8, seed=s))
    return tr


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def engine_for(tiny, tr, sync):
    """An engine as the runtime builds it: a plain copy of the base model (version 0); with
    ``adapter`` it keeps the base weights W0."""
    base = copy.deepcopy(tiny.model).eval()
    return InferenceEngine(base, tiny.tokenizer, lora_base=tr.lora.base_weights() if sync == "adapter" else None)


# ---------------------------------------------------------------------------------- the formula
def test_merge_of_known_factors_by_hand():
    # W = W0 + scale * B @ A (Hu et al. 2021): B [2, 1], A [1, 3], scale = alpha / r = 0.5
    f = LoraFactors(A=torch.tensor([[1.0, 2.0, 3.0]]), B=torch.tensor([[1.0], [-1.0]]), scale=0.5)
    w0 = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    assert f.merge(w0).tolist() == [[1.5, 1.0, 1.5], [-0.5, 0.0, -1.5]]
    assert w0.tolist() == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]  # the base is never changed
    assert f.num_bytes == 5 * 4
    with pytest.raises(ValueError, match="do not fit a weight of shape"):
        f.merge(torch.zeros(3, 2))


def test_rank_one_adapter_merges_to_w0_plus_alpha_over_r_b_a(tiny):
    policy = apply_lora(copy.deepcopy(tiny.model), LoraConfig(enabled=True, rank=1, alpha=4.0, target_modules=["q_proj"]))
    (name, layer), *_ = policy.layers
    assert name == "model.layers.0.self_attn.q_proj" and len(policy.layers) == 2  # one per decoder layer
    w0 = layer.base_layer.weight.detach().clone()
    with torch.no_grad():  # A = 0.5 e_2^T, B = -2 e_3: alpha / r x B A has one entry, 4 x -2 x 0.5 = -4
        layer.lora_A["default"].weight.zero_()[0, 2] = 0.5
        layer.lora_B["default"].weight.zero_()[3, 0] = -2.0
    merged = policy.weight_update(1, "merged").tensors["model.layers.0.self_attn.q_proj.weight"]
    delta = merged - w0
    assert delta[3, 2].item() == -4.0 and int((delta != 0).sum()) == 1
    # peft's forward through the adapter (W0 x + scale B A x) agrees with the merged weight
    x = torch.randn(5, w0.shape[1])
    with torch.no_grad():
        assert torch.allclose(layer(x), x @ merged.T, atol=1e-5)
    factors = policy.weight_update(1, "adapter").lora["model.layers.0.self_attn.q_proj.weight"]
    assert factors.scale == 4.0 and factors.A.shape == (1, w0.shape[1]) and factors.B.shape == (w0.shape[0], 1)
    plain = policy.inference_model()  # the export / engine model: plain nn.Linear, merged
    assert not lora_layers(plain) and torch.equal(plain.state_dict()["model.layers.0.self_attn.q_proj.weight"], merged)


# ---------------------------------------------------------------------------------- training
@pytest.mark.parametrize("bf16", [False, True])
def test_only_the_adapters_train(tiny, bf16):
    tr = lora_trainer(tiny, bf16=bf16)
    names = {n for n, p in tr.model.named_parameters() if p.requires_grad}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(names) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    opt_params = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    assert opt_params == {id(p) for n, p in tr.model.named_parameters() if n in names}
    base_before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if n not in names}
    m = tr.train_step(make_trajs(8))
    assert math.isfinite(m["loss/loss"]) and m["train/grad_norm"] > 0
    for n, p in tr.model.named_parameters():
        if n in names:
            assert p.grad is not None
        else:
            assert p.grad is None and torch.equal(p, base_before[n]), n
    assert len(tr.optimizer.state) == len(names)  # AdamW moments of the adapters only
    assert any(float(p.detach().abs().sum()) > 0 for n, p in tr.model.named_parameters() if ".lora_B." in n)  # B moved off 0


def test_kl_reference_is_the_base_model_with_adapters_disabled(tiny):
    tr = trained(tiny, kl_coef=0.1)
    assert tr.ref_model is None  # no second copy
    batch = tr.pack(make_trajs(8, seed=5))
    mb = batch.micro_batches[0]
    with torch.no_grad():
        ref = tr._reference_logprobs(mb)
        base, _ = token_logprobs(tiny.model, mb.input_ids, mb.position_ids, mb.targets, attention_mask=mb.attention_mask)
        cur, _ = tr._logprobs(tr.model, mb)
    m = mb.mask > 0
    assert torch.allclose(ref[m], base[m], atol=1e-5)
    assert float((cur[m] - base[m]).abs().max()) > 1e-4  # the adapters are back on after the context
    assert tr.score(batch).reference[0] is not None


@pytest.mark.parametrize("backbone", ["policy", "head"])
def test_critic_trains_fully_beside_a_lora_policy(tiny, backbone):
    from conveyor.config import CriticConfig

    tr = Trainer(copy.deepcopy(tiny.model), TC, LossConfig(name="dis", advantage="gae", kl_coef=0.0),
                 critic_cfg=CriticConfig(backbone=backbone, lr=1e-3), lora_cfg=LoraConfig(enabled=True))
    assert not lora_layers(tr.critic)  # a copied backbone comes from the base model, not the adapted one
    m = tr.train_step(make_trajs(8))
    assert math.isfinite(m["critic/value_loss"]) and m["critic/updates"] > 0
    assert {id(p) for p in tr.critic_updater.params}.isdisjoint(id(p) for p in tr.policy.params)
    assert all(".lora_" in n for n, p in tr.model.named_parameters() if p.requires_grad)


def test_activation_checkpointing_gives_lora_the_same_gradients(tiny):
    grads = []
    for ckpt in (False, True):
        tr = Trainer(copy.deepcopy(tiny.model), TC.model_copy(update={"activation_checkpointing": ckpt}),
                     LossConfig(kl_coef=0.0), lora_cfg=LoraConfig(enabled=True))
        tr.train_step(make_trajs(8))
        tr.train_step(make_trajs(8, seed=1))  # B is non-zero now: every A and B gets gradient
        grads.append([p.grad.clone() for p in tr.policy.params])
    for a, b in zip(*grads):  # (A's init is seeded: the two trainers start from the same adapters)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-10) and float(a.abs().max()) > 0


@pytest.mark.parametrize("method", ["snapshot", "ewma"])
def test_proximal_strategies_with_copies_work_with_lora(tiny, method):
    tr = trained(tiny, proximal=method, steps=3)
    assert tr.proximal.name == method and tr.version == 3


def test_lora_checkpoint_holds_the_adapter_and_resumes_exactly(tiny):
    tr = trained(tiny, steps=1, kl_coef=0.05)
    state = copy.deepcopy(tr.state_dict())
    assert state["lora"] == {"rank": 8, "alpha": 16.0, "target_modules": list(LoraConfig().target_modules)}
    assert state["model"] and all(".lora_" in k for k in state["model"])
    assert len(state["optimizer"]["state"]) == len(state["model"])
    tr2 = lora_trainer(tiny, kl_coef=0.05)
    tr2.load_state_dict(state)
    assert tr2.version == 1
    tr.train_step(make_trajs(8, seed=1))
    tr2.train_step(make_trajs(8, seed=1))
    a, b = dict(tr.model.named_parameters()), dict(tr2.model.named_parameters())
    for n in a:
        assert torch.equal(a[n], b[n]), n
    # a LoRA checkpoint never loads into a fully fine-tuned trainer, nor the reverse
    full = Trainer(copy.deepcopy(tiny.model), TC, LossConfig(kl_coef=0.0))
    with pytest.raises(ValueError, match="holds a LoRA adapter"):
        full.load_state_dict(state)
    with pytest.raises(ValueError, match="fully fine-tuned"):
        lora_trainer(tiny).load_state_dict(full.state_dict())
    with pytest.raises(ValueError, match="lora.rank cannot change"):
        lora_trainer(tiny, rank=4).load_state_dict(state)


# ---------------------------------------------------------------------------------- weight sync
def test_both_sync_modes_give_the_engine_the_same_weights_and_logprobs(tiny):
    tr = trained(tiny)
    merged, adapter = tr.lora.weight_update(2, "merged"), tr.lora.weight_update(2, "adapter")
    assert not merged.lora and set(merged.tensors) == set(adapter.lora)  # the 14 adapted weights
    assert adapter.num_bytes < merged.num_bytes < WeightUpdate.from_model(tiny.model, 2).num_bytes
    engines = {"merged": engine_for(tiny, tr, "merged"), "adapter": engine_for(tiny, tr, "adapter")}
    engines["merged"].update_weights(merged)
    engines["adapter"].update_weights(pickle.loads(pickle.dumps(adapter)))  # the message is plain data (Ray)
    wm, wa = engines["merged"].model.state_dict(), engines["adapter"].model.state_dict()
    assert max_diff(wm, wa) <= 1e-6
    assert max_diff(wm, tr.inference_policy().state_dict()) <= 1e-6  # = the trained policy, merged
    base = tiny.model.state_dict()
    changed = [k for k in base if not torch.equal(base[k], wa[k])]
    assert sorted(changed) == sorted(adapter.lora)  # the adapted weights, nothing else
    # deltas never accumulate: the same adapter again gives the same weights, not W0 + 2 delta
    engines["adapter"].update_weights(WeightUpdate(version=3, tensors={}, lora=adapter.lora))
    assert max_diff(engines["adapter"].model.state_dict(), wm) <= 1e-6
    prompts = [[1, 50, 60, 70], [1, 80, 90]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for k, e in engines.items():
        with e:  # started, stopped at the end
            outs[k] = e.generate_batch(prompts, params)
    for a, b in zip(outs["merged"], outs["adapter"]):
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_engine_refuses_adapters_it_cannot_merge(tiny):
    tr = trained(tiny, steps=1)
    upd = tr.lora.weight_update(1, "adapter")
    eng = engine_for(tiny, tr, "merged")  # no lora_base
    with pytest.raises(KeyError, match="no base weight"):
        eng.update_weights(upd)
    name, f = next(iter(upd.lora.items()))
    eng = engine_for(tiny, tr, "adapter")
    with pytest.raises(ValueError, match="do not fit the weight"):
        eng.update_weights(WeightUpdate(version=1, tensors={}, lora={name: LoraFactors(f.A, f.B[:, :4], f.scale)}))
    with pytest.raises(ValueError, match="carries LoRA factors"):
        upd.state_dict()
    with pytest.raises(ValueError, match="lora.sync=merged"):
        write_weights("/nonexistent/x.safetensors", upd)


def test_dedicated_worker_merges_adapters_like_the_engine(tiny):
    tr = lora_trainer(tiny, "adapter", proximal="dedicated")
    worker = tr.proximal
    assert not lora_layers(worker.model)  # a plain copy, like an engine
    worker.start(tr)
    try:
        tr.train_step(make_trajs(8))
        worker.retire([], tr.weight_update(), lambda patches: None)
        worker.wait_retired(1, timeout=60)
    finally:
        worker.stop()
    assert worker.version == 1 and max_diff(worker.model.state_dict(), tr.inference_policy().state_dict()) <= 1e-6


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_ray_rollout_actor_builds_its_engine_from_the_base_model_and_the_lora_message(tiny, sync):
    """The Ray runtime's actor (in process: the same code the Ray worker runs) loads the base model
    from model.name and applies the trainer's LoRA message on top (a trained adapter, as on a
    resume); later messages too (adapters merged onto W0)."""
    from conveyor.data import load_dataset
    from conveyor.runtime.ray import RolloutActor

    cfg = load_config(None, ["model.name=tiny", "rollout.tool=none", "reward.workers=1", "lora.enabled=true",
                             f"lora.sync={sync}"])
    tr = trained(tiny, sync, steps=1)
    actor = RolloutActor()
    try:
        actor.setup(cfg, load_dataset("mawps:singleop")[:4], tr.weight_update(), engine_threads=1, track_partials=False)
        assert max_diff(actor.engine.model.state_dict(), tr.inference_policy().state_dict()) <= 1e-6
        tr.train_step(make_trajs(8, seed=1))
        actor.update_weights(tr.weight_update())
        assert max_diff(actor.engine.model.state_dict(), tr.inference_policy().state_dict()) <= 1e-6
    finally:
        actor.close()


# ---------------------------------------------------------------------------------- a run
BASE = [
    "model.name=tiny", "trainer.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=10",
    "data.heldout_limit=3", "run.eval_max_new_tokens=6", "run.progress=false", "run.eval_before=false",
    "run.eval_after=false", "reward.workers=1", "trainer.lr=1e-2", "rollout.tool=none", "lora.enabled=true",
]


def test_two_step_lora_run_exports_adapter_and_merged_model_and_resumes(tmp_path, tiny, monkeypatch):
    import conveyor.runtime.inline as inline
    import conveyor.trainer.trainer as trainer_mod
    from conveyor.models import load_model
    from conveyor.train import load_run_config, run_training

    seen: dict[str, list] = {"trainer": [], "engine": []}

    class RecTrainer(Trainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen["trainer"].append(self)

    class RecEngine(InferenceEngine):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen["engine"].append(self)

    monkeypatch.setattr(trainer_mod, "Trainer", RecTrainer)  # what build_trainer constructs
    monkeypatch.setattr(inline, "InferenceEngine", RecEngine)
    run = tmp_path / "r"
    # a reward that varies within a group (the response length): non-zero advantages, so the adapters move
    cfg = load_config(None, BASE + ["lora.sync=adapter", "trainer.total_steps=2", f"run.dir={run}",
                                    "reward.fn=conveyor.rewards.faults:response_length_reward", "rollout.temperature=1.0",
                                    "run.checkpoint_every=1", "run.keep_checkpoints=2", "loss.kl_coef=0.05"])
    res = run_training(cfg)
    assert res.steps == 2
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["loss/loss"]) for r in rows)
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["trainable_parameters"] for e in events if e["event"] == "lora"] == [16384]
    tr, eng = seen["trainer"][0], seen["engine"][0]
    base = tiny.model.state_dict()
    for n, p in tr.model.state_dict().items():  # the trainer's base weights never change
        if ".lora_" not in n:
            assert torch.equal(p, base[n.replace(".base_layer.", ".")]), n
    ew = eng.model.state_dict()  # the engine's weights changed: version 2's merged policy
    assert eng.version == 2 and max_diff(ew, tr.inference_policy().state_dict()) <= 1e-6
    assert not torch.equal(ew["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    # the checkpoint: adapter and adapter-only optimizer state (kilobytes, not the model)
    state = torch.load(run / "checkpoints" / "step_2" / "trainer.pt", weights_only=False)
    assert all(".lora_" in k for k in state["model"]) and len(state["optimizer"]["state"]) == len(state["model"])
    # the export: a plain transformers model (what `conveyor eval --model RUN/export` loads) and the adapter
    export = run / "export"
    merged = load_model(str(export)).model
    assert max_diff(merged.state_dict(), tr.inference_policy().state_dict()) <= 1e-6
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(load_model("tiny", seed=0).model, str(export / "adapter"))
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    with torch.no_grad():
        assert torch.allclose(adapted(ids).logits, merged(ids).logits, atol=1e-4)
    # resume from step_1 (step_2 lost): continues at version 2 with the checkpoint's adapter
    shutil.rmtree(run / "checkpoints" / "step_2")
    with pytest.raises(ValueError, match="lora.rank cannot change"):
        run_training(load_run_config(run, ["trainer.total_steps=3", "lora.rank=4"]), resume_dir=run)
    res = run_training(load_run_config(run, ["trainer.total_steps=3"]), resume_dir=run)
    assert res.steps == 3
    trained_rows = [json.loads(x) for x in (run / "trained.jsonl").read_text().splitlines()]
    assert [r["step"] for r in trained_rows] == [1, 2, 3]
    assert any(e["event"] == "resume" for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()))
    # `conveyor inspect` without an export reads the checkpoint: the adapter merged onto the base model
    from conveyor.inspect_attention import load_policy

    shutil.rmtree(run / "export")
    policy = load_policy(run)
    assert "checkpoint step_3" in policy.source and not lora_layers(policy.model)
    assert max_diff(policy.model.state_dict(), seen["trainer"][-1].inference_policy().state_dict()) <= 1e-6


# ---------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("override, match", [
    ("lora.rank=0", r"lora\.rank"),
    ("lora.alpha=0", r"lora\.alpha"),
    ("lora.dropout=1", r"lora\.dropout"),
    ("lora.sync=delta", r"lora\.sync"),
    ("lora.target_modules=", r"lora\.target_modules"),
])
def test_bad_lora_settings_are_config_errors_naming_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["lora.enabled=true", override])


def test_target_modules_must_match_linear_untied_modules_of_the_model(tiny):
    assert load_config(None, ["lora.target_modules=q_proj,v_proj"]).lora.target_modules == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match=r"'c_attn' matches no module .*q_proj"):
        lora_trainer(tiny, target_modules=["q_proj", "c_attn"])
    with pytest.raises(ConfigError, match=r"'mlp' matches 'model.layers.0.mlp', a LlamaMLP, not a linear layer"):
        lora_trainer(tiny, target_modules=["mlp"])
    with pytest.raises(ConfigError, match="tied"):
        lora_trainer(tiny, target_modules=["lm_head"])  # tiny ties lm_head to the input embeddings


def test_lora_without_peft_says_how_to_install_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'conveyor\[lora\]'"):
        load_config(None, ["lora.enabled=true"])
