"""LoRA adapters on the critic's backbone (``critic.lora_rank``; issue 15 section 2): only the
adapters and the value head train, frozen attention gets no adapter, the values start as the
plain critic's, checkpoints round-trip, and the settings that cannot work are refused."""

from __future__ import annotations

import copy

import pytest
import torch

from conveyor.config import (
    CriticConfig,
    LossConfig,
    ProximalConfig,
    TrainerConfig,
    data_parallel_unsupported,
)
from conveyor.rundir import FIXED_ON_RESUME
from conveyor.trainer import critic as critic_lib
from conveyor.trainer.trainer import Trainer
from tests.test_critic_training import _batch

pytest.importorskip("peft", reason="LoRA needs peft: pip install 'conveyor[lora]'")


def make(tiny, **critic):
    torch.manual_seed(0)
    return Trainer(copy.deepcopy(tiny.model), TrainerConfig(bf16=False, lr=1e-3, warmup_steps=0),
                   LossConfig(name="dis", advantage="gae", kl_coef=0.0),
                   critic_cfg=CriticConfig(**{"lr": 1e-2, **critic}))


def test_lora_critic_trains_only_its_adapters_and_value_head(tiny):
    tr, plain = make(tiny, lora_rank=4), make(tiny)
    trainable = {n for n, p in tr.critic.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("value_head.") for n in trainable)
    assert {n for n in trainable if n.startswith("value_head.")} == {"value_head.weight", "value_head.bias"}
    # frozen attention (the default): no adapter inside an attention module
    attn = {id(p) for m in critic_lib.attention_modules(tr.critic) for p in m.parameters()}
    assert not any("lora_" in n and id(p) in attn for n, p in tr.critic.named_parameters())
    assert any("mlp" in n for n in trainable)
    n_train = sum(p.numel() for p in tr.critic.parameters() if p.requires_grad)
    assert n_train < 0.01 * sum(p.numel() for p in plain.critic.parameters() if p.requires_grad)
    assert f"{n_train:,} trainable" in tr.critic_note
    # B = 0 at the start: the same values as the plain critic (same value-head seed)
    mb = tr.pack(_batch()).micro_batches[0]
    with torch.no_grad():
        assert torch.equal(tr._values(mb, mask=mb.mask), plain._values(mb, mask=mb.mask))
    base = {n: p.detach().clone() for n, p in tr.critic.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in tr.critic.named_parameters() if p.requires_grad}
    m = tr.train_step(_batch())
    assert m["critic/updates"] == 2 and m["critic/skipped_nonfinite"] == 0
    params = dict(tr.critic.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in base.items())  # the backbone's weights never move
    assert any(not torch.equal(params[n], v) for n, v in adapters.items() if "lora_B" in n)
    # the optimizer holds the adapters and the head only
    held = {id(p) for g in tr.critic_updater.optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for p in tr.critic.parameters() if p.requires_grad}


def test_lora_critic_with_attention_trained_adapts_the_attention(tiny):
    tr = make(tiny, lora_rank=2, freeze_attention=False)
    attn = {id(p) for m in critic_lib.attention_modules(tr.critic) for p in m.parameters()}
    assert any("lora_" in n and id(p) in attn and p.requires_grad for n, p in tr.critic.named_parameters())


def test_lora_critic_checkpoint_round_trip(tiny):
    tr = make(tiny, lora_rank=4)
    tr.train_step(_batch())
    state = tr.state_dict()
    tr2 = make(tiny, lora_rank=4)
    tr2.load_state_dict(state)
    for (na, a), (nb, b) in zip(tr.critic.named_parameters(), tr2.critic.named_parameters(), strict=True):
        assert na == nb and torch.equal(a, b), na
    m1, m2 = tr.train_step(_batch(seed=1)), tr2.train_step(_batch(seed=1))
    assert m1["critic/value_loss"] == pytest.approx(m2["critic/value_loss"], rel=1e-6)
    with pytest.raises(ValueError, match="LoRA rank 4, this run critic.lora_rank=0"):
        make(tiny).load_state_dict(state)
    with pytest.raises(ValueError, match="LoRA rank 0, this run critic.lora_rank=2"):
        make(tiny, lora_rank=2).load_state_dict(make(tiny).state_dict())
    assert ("critic", "lora_rank") in FIXED_ON_RESUME and ("critic", "lora_alpha") in FIXED_ON_RESUME


def test_lora_critic_refused_where_it_cannot_work(tiny):
    with pytest.raises(ValueError, match="head critic has no backbone"):
        CriticConfig(backbone="head", lora_rank=4)
    with pytest.raises(ValueError, match="lora_rank"):
        CriticConfig(lora_rank=-1)
    bad = data_parallel_unsupported(TrainerConfig(), LossConfig(advantage="gae"), ProximalConfig(), None,
                                    CriticConfig(lora_rank=4))
    assert any("critic.lora_rank=4" in b for b in bad)
    with pytest.raises(ValueError, match="no linear module"):
        critic_lib.apply_lora(make(tiny).critic, 2, 4.0, targets=["no_such_proj"])
    head = critic_lib.build_value_model(copy.deepcopy(tiny.model), "head:4")
    with pytest.raises(ValueError, match="has none"):
        critic_lib.apply_lora(head, 2, 4.0)
