"""The critic's model side (MISSION.md section 3, SAO): value model, frozen attention, value loss."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from conveyor.trainer.batch import group_shared_prompts, pack
from conveyor.trainer.critic import (
    FAMILIES,
    ValueModel,
    attention_modules,
    build_value_model,
    freeze_attention,
    grad_norm_by_kind,
    mlp_modules,
    param_count_by_kind,
    token_values,
    value_loss,
    value_metrics,
)
from conveyor.types import Sample, Trajectory


def make_trajs(n=6, group=3, seed=0, vocab=1000):
    """Trajectories whose groups share a prompt (GRPO layout), so ``pack`` can share it."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(3, vocab, (4 + i % 3,), generator=g).tolist()
        if i % group:
            p = list(out[i - i % group].prompt_ids)
        r = torch.randint(3, vocab, (3 + (i * 5) % 7,), generator=g).tolist()
        out.append(Trajectory(
            sample=Sample(f"s{i // group}", "q", "1", "t"), group_id=f"g{i // group}", prompt_ids=p,
            response_ids=r, behaviour_logprobs=[-5.0] * len(r), versions=[0] * len(r), reward=1.0,
        ))
    return out


@pytest.fixture(scope="module")
def critic(tiny):
    return build_value_model(tiny.model, "policy", seed=0)


def _storages(module):
    return {t.untyped_storage().data_ptr() for t in list(module.parameters()) + list(module.buffers())}


# --------------------------------------------------------------------------------------------
# ValueModel / token_values
# --------------------------------------------------------------------------------------------


def test_values_shape_dtype_and_head_init(tiny, critic):
    ids = torch.randint(3, 1000, (3, 7))
    with torch.no_grad():
        v = critic(ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            v_bf16 = critic(ids)
    assert v.shape == (3, 7) and v.dtype == torch.float32
    assert v_bf16.shape == (3, 7) and v_bf16.dtype == torch.float32
    head = critic.value_head
    d = tiny.model.config.hidden_size
    assert head.weight.shape == (1, d) and head.weight.dtype == torch.float32
    assert torch.equal(head.bias, torch.zeros(1))
    # N(0, (1 / (d + 1))^2) from the seed's own generator (OpenRLHF's value-head init)
    assert torch.equal(head.weight, torch.randn(1, d, generator=torch.Generator().manual_seed(0)) / (d + 1))
    # same seed, same head; another seed, another head
    assert torch.equal(build_value_model(tiny.model, seed=0).value_head.weight, head.weight)
    assert not torch.equal(build_value_model(tiny.model, seed=1).value_head.weight, head.weight)
    # the values come from the body's last hidden state, the one that predicts the next token
    with torch.no_grad():
        h = tiny.model.model(input_ids=ids).last_hidden_state
    assert torch.allclose(v, h @ head.weight[0] + head.bias, atol=1e-5)
    with pytest.raises(ValueError, match="input_ids"):
        critic(ids[0])
    with pytest.raises(ValueError, match="attention_mask"):
        critic(ids, attention_mask=torch.ones(3, 1, 7, 6, dtype=torch.bool))


def test_packed_shared_prompt_values_equal_unpacked(critic):
    """Packed rows (shared prompts, explicit 4-D mask; and plain block-diagonal packing) give
    the values of each sequence run alone, at the positions that predict its response tokens."""
    trajs = make_trajs(7, group=3)
    units = group_shared_prompts(trajs, 10_000)
    assert units[0] == (0, 1, 2)
    for rows in ([[units[0], 6], [units[1]]], [[0, 1, 2], [3, 4, 5, 6]]):
        pb = pack(trajs, torch.zeros(7), rows)
        with torch.no_grad():
            v = token_values(critic, pb.input_ids, pb.position_ids, mask=pb.mask,
                             attention_mask=pb.attention_mask)
        assert v.shape == pb.input_ids.shape and v.dtype == torch.float32
        assert (v[pb.mask == 0] == 0).all()
        for s, i in enumerate(pb.indices):
            t = trajs[i]
            P, n = len(t.prompt_ids), len(t.response_ids)
            with torch.no_grad():
                ref = critic(torch.tensor([t.prompt_ids + t.response_ids]))[0, P - 1 : P - 1 + n]
            got = v[(pb.seq_index == s) & (pb.mask > 0)]
            assert torch.allclose(got, ref, atol=1e-5), i
    assert pb.attention_mask is None  # the second layout: block-diagonal from position_ids
    with pytest.raises(ValueError, match=r"\[R, L\]"):
        token_values(critic, pb.input_ids, pb.position_ids[:, :-1])
    with pytest.raises(ValueError, match="attention_mask"):
        token_values(critic, pb.input_ids, pb.position_ids, attention_mask=torch.ones(1, 1, 2, 2, dtype=torch.bool))


# --------------------------------------------------------------------------------------------
# build_value_model
# --------------------------------------------------------------------------------------------


def test_deep_copy_shares_no_storage(tiny, critic):
    policy = tiny.model
    assert not (_storages(critic) & _storages(policy))
    assert critic.config is not policy.config
    for (n1, p1), (n2, p2) in zip(critic.backbone.named_parameters(), policy.model.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)  # a copy of the policy's body
        assert p1.dtype == torch.float32 and p1.requires_grad
    # training the critic leaves the policy untouched
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    with torch.no_grad():
        for p in critic.parameters():
            p.add_(1.0)
    for k, v in policy.state_dict().items():
        assert torch.equal(v, before[k]), k
    with torch.no_grad():
        for p in critic.parameters():
            p.sub_(1.0)
    assert not any(isinstance(m, torch.nn.Linear) and m.out_features == policy.config.vocab_size
                   for m in critic.modules())  # no LM head


def test_policy_prefix_layers(tiny):
    policy = tiny.model
    c1 = build_value_model(policy, "policy:1")
    assert len(c1.backbone.layers) == 1 and c1.config.num_hidden_layers == 1
    assert len(attention_modules(c1)) == 1 and len(mlp_modules(c1)) == 1
    assert len(policy.model.layers) == 2 and policy.config.num_hidden_layers == 2  # policy untouched
    assert not (_storages(c1) & _storages(policy))
    for (n1, p1), (n2, p2) in zip(c1.backbone.layers[0].named_parameters(),
                                  policy.model.layers[0].named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    assert torch.equal(c1.backbone.norm.weight, policy.model.norm.weight)
    ids = torch.randint(3, 1000, (2, 5))
    with torch.no_grad():
        assert c1(ids).shape == (2, 5)
    assert len(build_value_model(policy, "policy:2").backbone.layers) == 2
    for bad in ("policy:0", "policy:3"):
        with pytest.raises(ValueError, match=r"L must be in \[1, 2\]"):
            build_value_model(policy, bad)
    with pytest.raises(ValueError, match="integer L"):
        build_value_model(policy, "policy:x")


def test_backbone_by_name_and_vocabulary_check(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    c = build_value_model(tiny.model, "tiny", seed=3)
    assert isinstance(c, ValueModel) and not (_storages(c) & _storages(tiny.model))
    assert c(torch.randint(3, 1000, (1, 4))).shape == (1, 4)
    build_value_model(tiny.model, "tiny", tokenizer=tiny.tokenizer)  # same vocabulary: accepted
    # a local HF directory whose embeddings do not cover the policy's vocabulary
    small = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=1000, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    small.save_pretrained(tmp_path / "small")
    tiny.tokenizer.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="1000 token embeddings"):
        build_value_model(tiny.model, str(tmp_path / "small"))
    with pytest.raises(ValueError, match="embeds 1000 token ids"):
        build_value_model(tiny.model, str(tmp_path / "small"), tokenizer=tiny.tokenizer)
    # another tokenizer vocabulary is refused even when the embeddings are large enough
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(str(tmp_path / "small"))
    other.add_tokens(["<critic-only-token>"])
    with pytest.raises(ValueError, match="another tokenizer vocabulary"):
        build_value_model(tiny.model, "tiny", tokenizer=other)
    with pytest.raises(ValueError, match="no transformer body"):
        build_value_model(torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------------------------
# Frozen attention, by module type
# --------------------------------------------------------------------------------------------


def test_freeze_attention_optimizer_step_keeps_attention_bit_identical(tiny):
    """The required check: after freeze_attention an optimiser step (every parameter handed to
    AdamW, weight decay on) leaves the attention weights bit-identical while the MLP weights and
    the value head change."""
    c = build_value_model(tiny.model, "policy", seed=0)
    c.train()
    ids = torch.randint(3, 1000, (2, 6))
    (c(ids) - 1.0).square().mean().backward()  # stale gradients, dropped by freeze_attention
    counts = param_count_by_kind(c)
    assert freeze_attention(c) == counts["attention"] > 0
    assert param_count_by_kind(c, trainable_only=True) == {**counts, "attention": 0}
    attn = [p for m in attention_modules(c) for p in m.parameters()]
    mlp = [p for m in mlp_modules(c) for p in m.parameters()]
    assert all(not p.requires_grad for p in attn) and all(p.requires_grad for p in mlp)
    assert all(p.requires_grad for n, p in c.named_parameters() if "norm" in n or "embed" in n or "value_head" in n)
    before = {n: p.detach().clone() for n, p in c.named_parameters()}
    assert all(p.grad is None for p in attn)
    opt = torch.optim.AdamW(c.parameters(), lr=1e-2, weight_decay=0.1)
    loss = (c(ids) - 1.0).square().mean()
    loss.backward()
    assert all(p.grad is None for p in attn)
    opt.step()
    attn_ids = {id(p) for p in attn}
    mlp_ids = {id(p) for p in mlp}
    for n, p in c.named_parameters():
        if id(p) in attn_ids:
            assert torch.equal(p, before[n]), n  # bit-identical
        elif id(p) in mlp_ids or n.startswith("value_head"):
            assert not torch.equal(p, before[n]), n
    assert len(attn_ids) == 8 and len(mlp_ids) == 6  # 2 layers x (q, k, v, o) / (gate, up, down)


def test_grad_norm_by_kind_frozen_vs_unfrozen(tiny):
    ids = torch.randint(3, 1000, (2, 6))
    norms = {}
    for frozen in (False, True):
        c = build_value_model(tiny.model, "policy", seed=0)
        if frozen:
            freeze_attention(c)
        (c(ids) - 1.0).square().mean().backward()
        norms[frozen] = g = grad_norm_by_kind(c)
        assert set(g) == {"attention", "mlp", "other"}
        # each group's norm is the L2 norm of its parameters' gradients
        attn = [p for m in attention_modules(c) for p in m.parameters()]
        ref = math.sqrt(sum(float(p.grad.square().sum()) for p in attn if p.grad is not None))
        assert g["attention"] == pytest.approx(ref, rel=1e-5)
        assert g["mlp"] > 0 and g["other"] > 0
    assert norms[True]["attention"] == 0.0 and norms[False]["attention"] > 0
    assert norms[True]["mlp"] == pytest.approx(norms[False]["mlp"], rel=1e-5)  # same forward
    c = build_value_model(tiny.model)
    assert grad_norm_by_kind(c) == {"attention": 0.0, "mlp": 0.0, "other": 0.0}  # no backward yet
    assert sum(param_count_by_kind(c).values()) == sum(p.numel() for p in c.parameters())


def test_unknown_family_is_refused():
    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    for fn in (attention_modules, mlp_modules, freeze_attention, grad_norm_by_kind):
        with pytest.raises(ValueError, match=r"model_type 'gpt2' is not a supported family.*'llama'"):
            fn(gpt2)
    c = build_value_model(gpt2)  # "policy" needs no family; freezing does
    assert c(torch.randint(0, 32, (1, 3))).shape == (1, 3)
    with pytest.raises(ValueError, match="'gpt2'"):
        freeze_attention(c)
    with pytest.raises(ValueError, match="'gpt2'"):
        build_value_model(gpt2, "policy:1")  # the decoder layers are found through the family
    with pytest.raises(ValueError, match="config.model_type"):
        attention_modules(torch.nn.Linear(2, 2))


_BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
             bos_token_id=0, eos_token_id=1, pad_token_id=0)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
FAMILY_CONFIGS = {
    "llama": {}, "mistral": {}, "ministral": {}, "qwen2": {}, "qwen3": {}, "gemma": {}, "gemma2": {},
    "phi3": {}, "olmo": {}, "olmo2": {}, "granite": {}, "smollm3": {},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(_MOE, shared_expert_intermediate_size=16, mlp_only_layers=[1]),
    "qwen3_moe": dict(_MOE, mlp_only_layers=[1]),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "gemma3_text": dict(sliding_window=4),
    "gemma3": "multimodal",
}


def _tiny_family_model(model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = FAMILY_CONFIGS[model_type]
    if kw == "multimodal":
        text = dict(_BASE, sliding_window=4)
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      image_size=28, patch_size=14)
        cfg = AutoConfig.for_model(model_type, text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                   image_token_index=5, boi_token_index=6, eoi_token_index=7)
    else:
        cfg = AutoConfig.for_model(model_type, **{**_BASE, **kw})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg)


def test_every_family_has_a_test_config():
    assert set(FAMILY_CONFIGS) == set(FAMILIES)
    for model_type, (module, attn, mlp) in FAMILIES.items():
        mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        for name in attn + mlp:
            assert isinstance(getattr(mod, name, None), type), (model_type, name)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_modules_found_by_type(model_type):
    policy = _tiny_family_model(model_type)
    module, attn_names, mlp_names = FAMILIES[model_type]
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    attn_cls = tuple(getattr(mod, n) for n in attn_names)
    mlp_cls = tuple(getattr(mod, n) for n in mlp_names)
    n_layers = policy.config.get_text_config().num_hidden_layers
    body = policy.base_model
    layers = body.language_model.layers if model_type == "gemma3" else body.layers
    for model in (policy, build_value_model(policy)):
        found = attention_modules(model)
        assert len(found) == n_layers and all(isinstance(m, attn_cls) for m in found)
        mlps = mlp_modules(model)
        assert len(mlps) == n_layers and all(isinstance(m, mlp_cls) for m in mlps)
    # exactly the decoder layers' attention / mlp blocks (attribute names only as the test's ground truth)
    assert [id(m) for m in attention_modules(policy)] == [id(layer.self_attn) for layer in layers]
    assert [id(m) for m in mlp_modules(policy)] == [id(layer.mlp) for layer in layers]
    c = build_value_model(policy)
    n_attn = freeze_attention(c)
    assert n_attn == sum(p.numel() for m in attention_modules(c) for p in m.parameters()) > 0
    assert param_count_by_kind(c, trainable_only=True)["attention"] == 0
    ids = torch.randint(8, 64, (2, 5))
    (c(ids, position_ids=torch.arange(5).expand(2, 5)) - 1.0).square().mean().backward()
    g = grad_norm_by_kind(c)
    assert g["attention"] == 0.0 and g["mlp"] > 0 and g["other"] > 0
    c1 = build_value_model(policy, "policy:1")
    assert len(attention_modules(c1)) == 1 and c1.config.get_text_config().num_hidden_layers == 1
    assert c1(ids).shape == (2, 5)
    layer_types = getattr(c1.config.get_text_config(), "layer_types", None)  # per-layer lists cut too
    assert layer_types is None or len(layer_types) == 1
    assert policy.config.get_text_config().num_hidden_layers == n_layers


# --------------------------------------------------------------------------------------------
# Value loss
# --------------------------------------------------------------------------------------------


def test_value_loss_hand_values():
    values = torch.tensor([[1.0, 2.0, float("nan"), 1.0]], requires_grad=True)
    returns = torch.tensor([[0.0, 2.5, float("inf"), 0.0]])
    mask = torch.tensor([[1, 1, 0, 1]])
    out = value_loss(values, returns, mask)
    # 0.5 * ((1 - 0)^2 + (2 - 2.5)^2 + (1 - 0)^2) = 0.5 * 2.25
    assert out.loss_sum.item() == pytest.approx(1.125) and out.num_tokens.item() == 3
    out.loss_sum.backward()
    assert values.grad.tolist() == [[1.0, -0.5, 0.0, 1.0]]  # d/dV 0.5 (V - R)^2 = V - R; masked: 0
    assert value_metrics([out])["clip_frac"] == 0.0

    values.grad = None
    old = torch.tensor([[0.8, 1.0, 0.0, 0.95]])
    out = value_loss(values, returns, mask, old_values=old, clip=0.1)
    # V_c = old + clamp(V - old, +-0.1) = [0.9, 1.1, -, 1.0]
    # (V_c - R)^2 = [0.81, 1.96, -, 1.0] vs (V - R)^2 = [1.0, 0.25, -, 1.0]
    # max = [1.0, 1.96, -, 1.0] -> 0.5 * 3.96; only token 1 clipped (token 3 is inside the range: a tie)
    assert out.loss_sum.item() == pytest.approx(1.98)
    out.loss_sum.backward()
    assert values.grad.tolist() == [[1.0, 0.0, 0.0, 1.0]]  # the clipped token gets no gradient
    m = value_metrics([out])
    assert m["clip_frac"] == pytest.approx(1 / 3) and m["loss"] == pytest.approx(0.66)
    with pytest.raises(ValueError, match="clip needs old_values"):
        value_loss(values, returns, mask, clip=0.1)
    with pytest.raises(ValueError, match="clip must be > 0"):
        value_loss(values, returns, mask, old_values=old, clip=0.0)
    with pytest.raises(ValueError, match="returns must be"):
        value_loss(values, returns[:, :2], mask)
    with pytest.raises(ValueError, match="mask must be"):
        value_loss(values, returns, mask[0])


def test_explained_variance_hand_values_and_micro_batches():
    values = torch.tensor([[0.5, 0.5, 1.0, 0.0]])
    returns = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    mask = torch.ones(1, 4)
    m = value_metrics([value_loss(values, returns, mask)])
    # R - V = [0.5, -0.5, 0, 0]: Var = 0.125; Var(R) = 0.25 -> EV = 1 - 0.125 / 0.25
    assert m["explained_variance"] == pytest.approx(0.5)
    assert m["return_mean"] == pytest.approx(0.5) and m["value_mean"] == pytest.approx(0.5)
    assert m["loss"] == pytest.approx(0.5 * 0.5 / 4)
    parts = [value_loss(values[:, :1], returns[:, :1], mask[:, :1]),
             value_loss(values[:, 1:], returns[:, 1:], mask[:, 1:])]
    split = value_metrics(parts)
    for k, v in m.items():
        assert split[k] == pytest.approx(v, abs=1e-7), k
    assert value_metrics([value_loss(returns, returns, mask)])["explained_variance"] == pytest.approx(1.0)
    assert value_metrics([value_loss(values, torch.ones(1, 4), mask)])["explained_variance"] == 0.0  # Var(R) = 0
