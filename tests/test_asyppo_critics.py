"""AsyPPO's critics in the trainer (issue 13 section 1; MISSION.md section 4): the lightweight
head critic on the policy's detached hidden states, and the mini-critic ensemble (shards,
mean value, uncertainty masks on the advantages and the entropy bonus, checkpoints)."""

from __future__ import annotations

import copy

import pytest
import torch

from conveyor.config import CriticConfig, LossConfig, TrainerConfig, load_config
from conveyor.trainer import critic as critic_lib
from conveyor.trainer.trainer import Trainer
from conveyor.types import Sample, Trajectory


def traj(i, n, reward, group):
    g = torch.Generator().manual_seed(i)
    resp = torch.randint(3, 900, (n,), generator=g).tolist()
    return Trajectory(sample=Sample(f"s{group}", "q", "1", "t"), group_id=f"g{group}", prompt_ids=[10 + group, 11, 12],
                      response_ids=resp, behaviour_logprobs=[-3.0] * n, versions=[0] * n, reward=float(reward))


def make_trainer(tiny, **critic):
    torch.manual_seed(0)
    lc = LossConfig(name="dis", advantage="gae", kl_coef=0.0, entropy_coef=0.01)
    tc = TrainerConfig(bf16=False, lr=1e-3, warmup_steps=0)
    return Trainer(copy.deepcopy(tiny.model), tc, lc, critic_cfg=CriticConfig(**{"lr": 1e-2, **critic}))


# ------------------------------------------------------------------ the head critic
def test_head_critic_reads_the_policy_and_trains_only_its_head(tiny):
    policy = copy.deepcopy(tiny.model)
    head = critic_lib.build_value_model(policy, "head:16", seed=3)
    assert isinstance(head, critic_lib.HeadCritic)
    names = {n for n, _ in head.named_parameters()}
    assert names == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}  # no backbone copy
    assert set(head.state_dict()) == names and head.fc1.weight.shape == (16, policy.config.hidden_size)
    assert critic_lib.freeze_attention(head) == 0
    ids = torch.tensor([[5, 6, 7, 8]])
    v = head(ids, torch.arange(4)[None])
    assert v.shape == (1, 4) and v.dtype == torch.float32
    v.sum().backward()
    assert all(p.grad is None for p in policy.parameters())  # detached: the policy gets nothing
    kinds = critic_lib.grad_norm_by_kind(head)
    assert kinds["attention"] == 0.0 and kinds["mlp"] == 0.0 and kinds["other"] > 0
    # the values follow the policy's CURRENT parameters (a reference, not a copy)
    with torch.no_grad():
        before = head(ids, torch.arange(4)[None])
        for p in policy.parameters():
            p.add_(0.05)
        assert not torch.allclose(head(ids, torch.arange(4)[None]), before)
    with pytest.raises(ValueError, match="head:H"):
        critic_lib.build_value_model(policy, "head:0")
    with pytest.raises(Exception, match="head:H"):
        load_config(None, ["critic.backbone=head:x"])


def test_head_critic_training_step_leaves_the_policy_to_the_policy_optimizer(tiny):
    tr = make_trainer(tiny, backbone="head", updates_per_step=2)
    assert "head" in tr.critic_note and sum(p.numel() for p in tr.critic.parameters()) < 0.2 * sum(
        p.numel() for p in tr.model.parameters())
    trajs = [traj(i, 6, i % 2, i) for i in range(4)]
    w0 = copy.deepcopy(tr.critic.state_dict())
    m = tr.train_step(trajs)
    assert m["critic/updates"] == 2 and m["critic/value_loss"] >= 0
    assert not torch.equal(w0["fc2.weight"], tr.critic.fc2.weight)


@pytest.mark.parametrize("num_critics", [1, 2])
def test_head_critics_share_one_policy_body_pass_per_phase(tiny, monkeypatch, num_critics):
    """Every head critic and every one of the K updates reads the policy body's states of a
    micro-batch computed once per parameter state: per micro-batch one body pass for the
    pre-update values and one after the policy update (a warm-up step, where the policy does
    not move: one in all), instead of up to N + N K; the values, metrics and parameters are those of
    a body pass per call."""
    small = {"micro_batch_tokens": 24, "pack_row_tokens": 24}  # several micro-batches
    cfg = {"backbone": "head:8", "num_critics": num_critics, "updates_per_step": 2, "warmup_steps": 1}

    def build():
        torch.manual_seed(0)
        return Trainer(copy.deepcopy(tiny.model), TrainerConfig(bf16=False, lr=1e-3, warmup_steps=0, **small),
                       LossConfig(name="dis", advantage="gae", kl_coef=0.0, entropy_coef=0.01),
                       critic_cfg=CriticConfig(**{"lr": 1e-2, **cfg}))

    shared, plain = build(), build()
    real = Trainer._values
    monkeypatch.setattr(plain, "_values", lambda mb, mask, critic=None, **_: real(plain, mb, mask, critic))
    counts = {}
    for name, tr in (("shared", shared), ("plain", plain)):
        calls = counts[name] = []
        critic_lib._policy_body(tr.model).register_forward_hook(lambda *_, c=calls: c.append(1))
    k, n = 2, num_critics
    for kind, seed in (("warmup", 0), ("train", 1), ("train", 2)):
        batch = [traj(i, 6 + i % 3, i % 2, i) for i in range(6)]
        if seed:
            batch = [traj(i + 10 * seed, 5 + i % 4, (i + seed) % 2, i) for i in range(6)]
        n_mb = len(shared.pack(batch).micro_batches)
        assert n_mb >= 3
        before = len(counts["shared"]), len(counts["plain"])
        # without sharing: N value passes and K update passes per critic and micro-batch (an
        # ensemble's critic skips the micro-batches without a response of its shard)
        if kind == "warmup":
            ms, mp = shared.critic_warmup_step(batch), plain.critic_warmup_step(batch)
            body_shared, body_plain = n_mb, (n + k) * n_mb
        else:  # + the policy's own forward (its gradient pass)
            ms, mp = shared.train_step(batch), plain.train_step(batch)
            body_shared, body_plain = 3 * n_mb, (1 + n + k) * n_mb
        assert len(counts["shared"]) - before[0] == body_shared, kind
        if n == 1:
            assert len(counts["plain"]) - before[1] == body_plain, kind
        else:
            assert len(counts["plain"]) - before[1] > body_plain, kind
        assert ms["critic/updates"] == mp["critic/updates"] == n * k
        for key in ("critic/value_loss", "critic/value_loss_last", "critic/explained_variance", "critic/value_mean",
                    "critic/return_mean"):
            assert ms[key] == pytest.approx(mp[key], rel=1e-6, abs=1e-8), key
        if kind == "train":
            assert ms["loss/loss"] == pytest.approx(mp["loss/loss"], rel=1e-6, abs=1e-8)
        for a, b in zip([*shared.model.parameters(), *(p for c in shared.critics for p in c.parameters())],
                        [*plain.model.parameters(), *(p for c in plain.critics for p in c.parameters())], strict=True):
            assert torch.equal(a, b)


def test_head_critic_rejects_hidden_states_of_the_wrong_shape(tiny):
    head = critic_lib.build_value_model(copy.deepcopy(tiny.model), "head:4")
    ids, pos = torch.tensor([[5, 6, 7]]), torch.arange(3)[None]
    h = head.body_states(ids, pos)
    assert torch.equal(head(ids, pos, hidden=h), head(ids, pos))
    with pytest.raises(ValueError, match="hidden must be"):
        head(ids, pos, hidden=h[:, :2])
    with pytest.raises(ValueError, match="HeadCritic only"):
        critic_lib.token_values(critic_lib.build_value_model(copy.deepcopy(tiny.model), "tiny"), ids, pos, hidden=h)


# ------------------------------------------------------------------ the ensemble
def test_ensemble_shards_responses_j_mod_n(tiny):
    """Critic c trains on response j of each prompt with j mod 2 == c: changing the rewards of
    critic 1's responses changes nothing in critic 0 after the update, and vice versa."""
    def run(rewards):
        tr = make_trainer(tiny, num_critics=2, backbone="head:8", updates_per_step=1, mask_low_frac=0.0,
                          mask_high_frac=0.0)
        trajs = [traj(i, 5, rewards[i], i // 2) for i in range(4)]  # 2 prompts x 2 responses
        batch = tr.pack(trajs)
        scores = tr.score(batch)
        tr.assign_advantages(batch, scores)
        m = tr.critic_update(batch, scores)
        return tr, m

    # Adam's first step moves each weight by about lr * sign(gradient), so a changed reward shows
    # in the weights only where it flips the sign of (value - return): the initial values are
    # small, so returns +1 and -5 / -7 lie on opposite sides of every token's value.
    a, m = run([1.0, 1.0, 1.0, 1.0])
    b, _ = run([1.0, -5.0, 1.0, -5.0])  # responses 1 and 3: index 1 in their prompts -> critic 1
    c, _ = run([-7.0, 1.0, -7.0, 1.0])  # responses 0 and 2 -> critic 0
    assert torch.equal(a.critics[0].fc2.weight, b.critics[0].fc2.weight)
    assert not torch.equal(a.critics[1].fc2.weight, b.critics[1].fc2.weight)
    assert torch.equal(a.critics[1].fc2.weight, c.critics[1].fc2.weight)
    assert not torch.equal(a.critics[0].fc2.weight, c.critics[0].fc2.weight)
    assert m["critic/updates"] == 2  # one step for each critic
    # different value-head inits: the critics disagree before any training
    assert not torch.equal(a.critics[0].fc1.weight, make_trainer(tiny, num_critics=2, backbone="head:8").critics[1].fc1.weight)


def test_ensemble_value_is_the_mean_and_masks_follow_the_std(tiny):
    """Two critics with hand-set values on one 10-token response: critic 1 gives 0 everywhere,
    critic 2 gives 0.1 .. 1.0 (the issue's example). GAE runs on the mean; the token with the
    lowest std (token 0) gets advantage 0; tokens 8 and 9 (highest std) leave the entropy bonus."""
    tr = make_trainer(tiny, num_critics=2, backbone="head:8", policy_lam=1.0)
    second = [0.1 * (k + 1) for k in range(10)]

    def values(mb, mask, critic=None, **_):
        out = torch.zeros(mb.mask.shape)
        if critic is tr.critics[1]:
            for r in range(out.shape[0]):
                for j in range(out.shape[1]):
                    k = int(mb.response_index[r, j])
                    if k >= 0 and mask[r, j] > 0:
                        out[r, j] = second[k]
        return out

    tr._values = values
    t = traj(0, 10, 1.0, 0)
    batch = tr.pack([t])
    scores = tr.score(batch)
    tr.assign_advantages(batch, scores)
    mb = batch.micro_batches[0]
    sel = mb.response_index >= 0
    order = mb.response_index[sel].argsort()
    v = scores.values[0][sel][order]
    assert v.tolist() == pytest.approx([s / 2 for s in second])  # the mean
    adv = mb.advantages[sel][order]
    # gamma 1, lambda 1: A_k = R - V_k = 1 - mean_k; token 0 masked to 0
    assert adv[0] == 0.0 and adv[1:].tolist() == pytest.approx([1 - s / 2 for s in second[1:]])
    keep = scores.entropy_keep[0][sel][order].tolist()
    assert keep == [1.0] * 8 + [0.0, 0.0]
    assert scores.ensemble_metrics["critic/advantage_masked_frac"] == pytest.approx(0.1)
    assert scores.ensemble_metrics["critic/entropy_masked_frac"] == pytest.approx(0.2)


def test_ensemble_train_step_and_checkpoint_round_trip(tiny):
    tr = make_trainer(tiny, num_critics=2, backbone="head:8")
    trajs = [traj(i, 4 + i, i % 2, i // 2) for i in range(4)]
    m = tr.train_step(trajs)
    assert m["critic/updates"] == 4 and "critic/ensemble_std_mean" in m and m["critic/ensemble_std_mean"] > 0
    state = tr.state_dict()
    assert len(state["critics_more"]) == 1
    tr2 = make_trainer(tiny, num_critics=2, backbone="head:8")
    tr2.load_state_dict(state)
    for a, b in zip(tr.critics, tr2.critics, strict=True):
        assert torch.equal(a.fc2.weight, b.fc2.weight)
    one = make_trainer(tiny, num_critics=1, backbone="head:8")
    with pytest.raises(ValueError, match="num_critics"):
        one.load_state_dict(state)
    # single rollout (one response per prompt): shards by batch position, both critics train
    single = [traj(i, 5, i % 2, 10 + i) for i in range(4)]
    m = tr.train_step(single)
    assert m["critic/updates"] == 4


def test_asyppo_run_end_to_end_and_num_critics_fixed_on_resume(tmp_path):
    import json
    from pathlib import Path

    from conveyor.rundir import check_resume_compatible
    from conveyor.train import run_training

    preset = load_config(Path(__file__).resolve().parents[1] / "configs" / "asyppo.yaml")
    assert (preset.critic.backbone, preset.critic.num_critics, preset.loss.advantage) == ("head", 2, "gae")
    assert preset.rollout.group_size * preset.trainer.batch_size == 16  # the grpo / sao budget per update
    run = tmp_path / "r"
    args = ["model.name=tiny", "trainer.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
            "run.progress=false", "run.export=false", "reward.workers=1", "rollout.tool=none", "data.heldout=",
            "loss.advantage=gae", "critic.backbone=head:16", "critic.num_critics=2", "critic.warmup_steps=1",
            "trainer.total_steps=2", f"run.dir={run}"]
    res = run_training(load_config(None, args))
    assert res.steps == 2
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["critic/updates"] == 4 and r["critic/ensemble_std_mean"] >= 0 for r in rows)
    with pytest.raises(ValueError, match="critic.num_critics cannot change on resume"):
        check_resume_compatible(run, load_config(None, [*args, "critic.num_critics=1"]))


def test_more_critics_than_responses_per_prompt_is_refused():
    """Response j of a prompt trains critic j mod N: with fewer responses per prompt than critics
    the last critics would never train yet sit in the ensemble's mean and masks (refused)."""
    from pathlib import Path

    configs = Path(__file__).resolve().parents[1] / "configs"
    with pytest.raises(ValueError, match=r"critic.num_critics=2 with rollout.group_size=1: .*critic 1 would never train"):
        load_config(str(configs / "sao.yaml"), ["critic.num_critics=2"])
    with pytest.raises(ValueError, match="critic.num_critics=3 with rollout.group_size=2"):
        load_config(str(configs / "asyppo.yaml"), ["rollout.group_size=2", "critic.num_critics=3"])
    with pytest.raises(ValueError, match=r"critics 2\.\.3 would never train"):
        load_config(str(configs / "asyppo.yaml"), ["rollout.group_size=2", "critic.num_critics=4"])
    # fresh-user trial 4, finding 9: masking every advantage (k = 1) can never learn
    with pytest.raises(ValueError, match=r"critic.mask_low_frac"):
        load_config(str(configs / "asyppo.yaml"), ["critic.mask_low_frac=1.0"])
    assert load_config(str(configs / "asyppo.yaml"), ["rollout.group_size=2"]).critic.num_critics == 2
