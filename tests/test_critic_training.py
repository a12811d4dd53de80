"""Critic-based training through the trainer (issue 11; MISSION.md section 3, SAO): token-level
GAE on packed batches, K critic updates, frozen attention, warm-up, the sliding-window baseline,
the entropy bonus, checkpoint round trips and the config rules."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from conveyor.checkpoint import checkpoint_order
from conveyor.config import CriticConfig, LossConfig, TrainerConfig, load_config
from conveyor.trainer import critic as critic_lib
from conveyor.trainer.losses import entropy_bonus
from conveyor.trainer.trainer import Trainer
from conveyor.types import Sample, Trajectory


def traj(i, response, reward, *, prompt=None, action_mask=None, group=None):
    prompt = prompt or [10 + i, 11 + i, 12 + i]
    return Trajectory(
        sample=Sample(f"s{i}", "q", "1", "t"), group_id=group or f"g{i}", prompt_ids=list(prompt),
        response_ids=list(response), behaviour_logprobs=[-3.0] * len(response), versions=[0] * len(response),
        reward=float(reward), action_mask=action_mask,
    )


def make_trainer(tiny, *, loss=None, critic=None, trainer=None):
    torch.manual_seed(0)
    lc = LossConfig(**{"name": "dis", "advantage": "gae", "kl_coef": 0.0, **(loss or {})})
    tc = TrainerConfig(**{"bf16": False, "lr": 1e-3, "warmup_steps": 0, **(trainer or {})})
    cc = CriticConfig(**{"lr": 1e-3, **(critic or {})})
    return Trainer(copy.deepcopy(tiny.model), tc, lc, critic_cfg=cc)


def fixed_values(tr, table):
    """Make the critic return ``table[trajectory index][response token]`` (for hand checks)."""

    def values(mb, mask, critic=None, **_):
        out = torch.zeros(mb.mask.shape)
        for r in range(out.shape[0]):
            for j in range(out.shape[1]):
                s, k = int(mb.seq_index[r, j]), int(mb.response_index[r, j])
                if k >= 0 and mask[r, j] > 0:
                    out[r, j] = table[mb.indices[s]][k]
        return out

    tr._values = values


def token_advantages(batch, i):
    """Advantages of trajectory ``i`` per response token, from the packed micro-batches."""
    for mb in batch.micro_batches:
        if i in mb.indices:
            s = mb.indices.index(i)
            sel = (mb.seq_index == s) & (mb.response_index >= 0)
            order = mb.response_index[sel].argsort()
            return mb.advantages[sel][order].tolist()
    raise AssertionError(i)


def test_skip_observation_gae_on_packed_batches_hand_values(tiny):
    """The issue's example through packing: actions 0, 1, 4 and observations 2, 3 of one response,
    V = (0.2, 0.4, 9, 9, 0.6), outcome reward 1, gamma 1. lambda 1: A = (0.8, 0.6, -, -, 0.4);
    lambda 0.5: (0.4, 0.4, -, -, 0.4); observation tokens get 0. A second trajectory without
    observations (V = 0.5, 0.5, reward 0: A = -0.5 lambda, -0.5) shares the micro-batch."""
    trajs = [traj(0, [5, 6, 7, 8, 9], 1.0, action_mask=[1, 1, 0, 0, 1]), traj(1, [5, 6], 0.0)]
    table = {0: [0.2, 0.4, 9.0, 9.0, 0.6], 1: [0.5, 0.5]}
    for lam, want in ((1.0, [0.8, 0.6, 0.0, 0.0, 0.4]), (0.5, [0.4, 0.4, 0.0, 0.0, 0.4])):
        tr = make_trainer(tiny, critic={"policy_lam": lam})
        fixed_values(tr, table)
        batch = tr.pack(trajs)
        scores = tr.score(batch)
        tr.assign_advantages(batch, scores)
        assert token_advantages(batch, 0) == pytest.approx(want, abs=1e-6)
        # A_1 = 0 - 0.5; A_0 = (0 + 0.5 - 0.5) + lam * A_1
        assert token_advantages(batch, 1) == pytest.approx([-0.5 * lam, -0.5], abs=1e-6)
        # returns use the critic lambda (1): R = A + V on action tokens = 1, 1, 1 and 0, 0
        ret = scores.returns[0][batch.micro_batches[0].mask > 0].tolist()
        assert sorted(ret) == pytest.approx([0.0, 0.0, 1.0, 1.0, 1.0], abs=1e-6)
    # changing the observation values changes nothing
    tr = make_trainer(tiny, critic={"policy_lam": 1.0})
    fixed_values(tr, {0: [0.2, 0.4, -50.0, 7.0, 0.6], 1: [0.5, 0.5]})
    batch = tr.pack(trajs)
    tr.assign_advantages(batch, tr.score(batch))
    assert token_advantages(batch, 0) == pytest.approx([0.8, 0.6, 0.0, 0.0, 0.4], abs=1e-6)


def test_length_adaptive_policy_lambda_and_naive_gae_differ(tiny):
    """Adaptive lambda = 1 - 1 / (1.5 * 3 action tokens) = 7/9 on the example above:
    A_4 = 0.4; A_1 = 0.2 + 7/9 * 0.4; A_0 = 0.2 + 7/9 * A_1. Naive GAE (through the observations,
    lambda 0.5) gives the hand values of tests/test_gae.py: (3.475, 6.55, 0, 0, 0.4)."""
    trajs = [traj(0, [5, 6, 7, 8, 9], 1.0, action_mask=[1, 1, 0, 0, 1])]
    table = {0: [0.2, 0.4, 9.0, 9.0, 0.6]}
    tr = make_trainer(tiny)  # policy_lam adaptive, alpha 1.5
    fixed_values(tr, table)
    batch = tr.pack(trajs)
    tr.assign_advantages(batch, tr.score(batch))
    a1 = 0.2 + 7 / 9 * 0.4
    assert token_advantages(batch, 0) == pytest.approx([0.2 + 7 / 9 * a1, a1, 0, 0, 0.4], abs=1e-6)
    tr = make_trainer(tiny, critic={"policy_lam": 0.5, "skip_observations": False})
    fixed_values(tr, table)
    batch = tr.pack(trajs)
    tr.assign_advantages(batch, tr.score(batch))
    assert token_advantages(batch, 0) == pytest.approx([3.475, 6.55, 0, 0, 0.4], abs=1e-6)


def _batch(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        r = torch.randint(3, 1000, (4 + i,), generator=g).tolist()
        mask = [1] * len(r)
        if i % 2:
            mask[1:3] = [0, 0]  # a tool observation inside the response
        out.append(traj(i, r, float(i % 3 == 0), action_mask=mask))
    return out


def test_k_critic_updates_frozen_attention_and_grad_norms_per_kind(tiny):
    tr = make_trainer(tiny, critic={"updates_per_step": 3})
    attn = [m for m in critic_lib.attention_modules(tr.critic)]
    mlp = [m for m in critic_lib.mlp_modules(tr.critic)]
    a0 = [copy.deepcopy(m.state_dict()) for m in attn]
    m0 = [copy.deepcopy(m.state_dict()) for m in mlp]
    m = tr.train_step(_batch())
    assert tr.critic_updater.steps == 3 and m["critic/updates"] == 3.0
    assert tr.policy.steps == 1
    for mod, before in zip(attn, a0, strict=True):
        for k, v in mod.state_dict().items():
            assert torch.equal(v, before[k]), k  # frozen: bit-identical
    assert any(not torch.equal(v, m0[0][k]) for k, v in mlp[0].state_dict().items())
    assert m["critic/grad_norm_attention"] == 0.0
    assert m["critic/grad_norm_mlp"] > 0 and m["critic/grad_norm_other"] > 0
    assert m["critic/value_loss"] > 0 and "critic/explained_variance" in m
    tr.train_step(_batch(seed=1))
    assert tr.critic_updater.steps == 6
    # unfrozen: the attention's gradient norm is logged too (the ablation is visible)
    tr2 = make_trainer(tiny, critic={"freeze_attention": False, "updates_per_step": 1})
    m2 = tr2.train_step(_batch())
    assert m2["critic/grad_norm_attention"] > 0 and tr2.critic_updater.steps == 1


def test_critic_value_loss_falls_on_a_fixed_batch(tiny):
    """K updates on returns computed once: the last update's loss is below the first's."""
    tr = make_trainer(tiny, critic={"updates_per_step": 4, "lr": 3e-3})
    m = tr.train_step(_batch())
    assert m["critic/value_loss_last"] < m["critic/value_loss"]


def test_warmup_leaves_the_policy_bit_identical_and_trains_the_critic(tiny):
    tr = make_trainer(tiny, critic={"warmup_steps": 2})
    assert tr.in_critic_warmup and tr.log_step == -2
    p0 = copy.deepcopy(tr.model.state_dict())
    c0 = copy.deepcopy(tr.critic.state_dict())
    opt0 = copy.deepcopy(tr.optimizer.state_dict())
    m = tr.critic_warmup_step(_batch())
    assert tr.version == 0 and tr.critic_warmup_done == 1 and tr.log_step == -1
    assert all(torch.equal(v, p0[k]) for k, v in tr.model.state_dict().items())
    assert tr.optimizer.state_dict()["state"] == opt0["state"] == {}
    assert any(not torch.equal(v, c0[k]) for k, v in tr.critic.state_dict().items())
    assert m["critic/updates"] == 2.0 and "train/grad_norm" not in m
    tr.critic_warmup_step(_batch(seed=1))
    assert not tr.in_critic_warmup and tr.log_step == 0
    tr.train_step(_batch(seed=2))
    assert tr.log_step == 1


def test_resume_mid_warmup_and_mid_run_continues_exactly(tiny):
    """A trainer restored from a state saved after warm-up step 1 does warm-up step 2 and two
    policy updates exactly like the one that never stopped (policy, critic, optimizers)."""
    a = make_trainer(tiny, critic={"warmup_steps": 2})
    a.critic_warmup_step(_batch(seed=0))
    state = copy.deepcopy(a.state_dict())
    b = make_trainer(tiny, critic={"warmup_steps": 2})
    b.load_state_dict(state)
    assert b.critic_warmup_done == 1
    for t in (a, b):
        t.critic_warmup_step(_batch(seed=1))
        t.train_step(_batch(seed=2))
    mid = copy.deepcopy(a.state_dict())
    c = make_trainer(tiny, critic={"warmup_steps": 2})
    c.load_state_dict(mid)
    for t in (a, b, c):
        t.train_step(_batch(seed=3))
    for other in (b, c):
        for k, v in a.model.state_dict().items():
            assert torch.equal(v, other.model.state_dict()[k]), k
        for k, v in a.critic.state_dict().items():
            assert torch.equal(v, other.critic.state_dict()[k]), k
        assert other.critic_updater.steps == a.critic_updater.steps == 8  # (2 warm-up + 2 updates) x K
    no_critic = Trainer(copy.deepcopy(tiny.model), TrainerConfig(bf16=False), LossConfig())
    with pytest.raises(ValueError, match="the checkpoint has no critic"):
        make_trainer(tiny).load_state_dict(no_critic.state_dict())


def test_sliding_window_baseline_through_the_trainer(tiny):
    """W = 3, one trajectory per step with rewards 1, 0, 1, 1: A = 1, -1, 0.5, 1/3 (SAO's
    critic-free ablation), broadcast over the action tokens; resumed from its state exactly."""
    tr = Trainer(copy.deepcopy(tiny.model), TrainerConfig(bf16=False, lr=1e-5),
                 LossConfig(name="dis", advantage="sliding_window", baseline_window=3, kl_coef=0.0))
    got = []
    for step, r in enumerate((1.0, 0.0, 1.0, 1.0)):
        if step == 2:
            state = copy.deepcopy(tr.state_dict())
            tr = Trainer(copy.deepcopy(tiny.model), TrainerConfig(bf16=False, lr=1e-5),
                         LossConfig(name="dis", advantage="sliding_window", baseline_window=3, kl_coef=0.0))
            tr.load_state_dict(state)
        batch = tr.pack([traj(step, [5, 6], r)])
        tr.assign_advantages(batch, tr.score(batch))
        got += token_advantages(batch, 0)
    assert got == pytest.approx([1, 1, -1, -1, 0.5, 0.5, 1 / 3, 1 / 3], abs=1e-6)


def test_entropy_bonus_hand_value_and_gradient(tiny):
    ent = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert float(entropy_bonus(ent, mask).detach()) == 3.0
    assert float(entropy_bonus(ent, mask, token_weights=torch.tensor([[0.5, 0.25, 9.0]])).detach()) == 1.0
    entropy_bonus(ent, mask).backward()
    assert ent.grad.tolist() == [[1.0, 1.0, 0.0]]
    # in the trainer: an entropy bonus changes the update; zero advantages isolate it
    trajs = [traj(i, [5, 6, 7], 1.0) for i in range(2)]  # reinforce: rewards equal, A = 0
    outs = []
    for coef in (0.0, 0.5):
        t = Trainer(copy.deepcopy(tiny.model), TrainerConfig(bf16=False, lr=1e-2, warmup_steps=0),
                    LossConfig(name="dis", advantage="reinforce", kl_coef=0.0, entropy_coef=coef))
        m = t.train_step(trajs)
        outs.append((m["train/grad_norm"], m["train/entropy"]))
    assert outs[0][0] == 0.0 and outs[1][0] > 0  # only the bonus produces a gradient


def test_config_rules_for_critic_and_single_rollout():
    cfg = load_config(None, ["rollout.group_size=1", "loss.advantage=gae", "critic.warmup_steps=3"])
    assert cfg.critic.updates_per_step == 2 and cfg.critic.freeze_attention and cfg.critic.policy_lam == "adaptive"
    with pytest.raises(ValueError, match="critic.warmup_steps=3 needs a critic: set loss.advantage=gae"):
        load_config(None, ["critic.warmup_steps=3"])
    with pytest.raises(ValueError, match="loss.advantage=grpo with rollout.group_size=1.*loss.advantage=gae"):
        load_config(None, ["rollout.group_size=1"])
    with pytest.raises(ValueError, match="filter_all_equal=true with rollout.group_size=1"):
        load_config(None, ["rollout.group_size=1", "loss.advantage=gae", "rollout.filter_all_equal=true"])
    with pytest.raises(ValueError, match="policy_lam must be in"):
        load_config(None, ["critic.policy_lam=1.5"])


def test_warmup_checkpoints_sort_before_policy_steps(tmp_path):
    from pathlib import Path

    names = ["step_2", "warmup_10", "step_1", "warmup_2", "warmup_9"]
    assert [p.name for p in sorted((Path(n) for n in names), key=checkpoint_order)] == [
        "warmup_2", "warmup_9", "warmup_10", "step_1", "step_2"]


def test_sao_run_with_warmup_killed_and_resumed_keeps_every_log_exact(tmp_path):
    """A real run (tiny, one response per prompt, critic warm-up 2, 3 policy updates) killed
    (kill -9) at the end of warm-up step 2 after checkpoint warmup_1, then resumed: warm-up
    step 2 is done again and logged once, every batch appears once in trained.jsonl, the
    policy reaches version 3, and the checkpoint holds the critic."""
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    args = [sys.executable, "-m", "conveyor.cli", "train", "model.name=tiny", "trainer.batch_size=2",
            "rollout.group_size=1", "loss.advantage=gae", "loss.name=dis", "critic.warmup_steps=2",
            "trainer.total_steps=3", "rollout.max_new_tokens=12", "data.heldout_limit=2",
            "run.eval_max_new_tokens=4", "run.export=false", f"run.dir={run}", "run.progress=false",
            "reward.workers=1", "run.checkpoint_every=1", "run.keep_checkpoints=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CONVEYOR_FAULTS": "kill@step_end#2"}
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == -9, p.stdout + p.stderr
    assert [d.name for d in sorted((run / "checkpoints").iterdir()) if not d.name.startswith(".")] == ["warmup_1"]
    env["CONVEYOR_FAULTS"] = ""
    p = subprocess.run([*args[:4], "--resume", str(run)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [json.loads(x) for x in (run / "critic_warmup.jsonl").read_text().splitlines()]
    assert [(r["warmup_step"], r["step"]) for r in rows] == [(1, -1), (2, 0)]
    trained = [json.loads(x) for x in (run / "trained.jsonl").read_text().splitlines()]
    assert [r["step"] for r in trained] == [-1, 0, 1, 2, 3]
    assert [r.get("phase") for r in trained] == ["critic_warmup"] * 2 + [None] * 3
    groups = [g["group"] for r in trained for g in r["groups"]]
    assert len(groups) == len(set(groups)) == 10
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["critic/updates"] == 2.0 for m in metrics)
    state = torch.load(sorted((run / "checkpoints").glob("step_*"))[-1] / "trainer.pt", weights_only=False)
    assert state["version"] == 3 and state["critic_warmup_done"] == 2 and state["critic"]["steps"] == 10
    summary = json.loads((run / "summary.json").read_text())
    assert [sg["segment"] for sg in summary["segments"]] == [0, 1]  # the killed warm-up process counts
    assert summary["proximal"]["method"] == "none"  # dis: no proximal policy
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    before = [e for e in events if e["event"] == "eval" and e["label"] == "before"]
    assert len(before) == 1 and not before[0].get("superseded") and before[0]["version"] == -2
    assert not any(e.get("superseded") for e in events if e["event"] == "checkpoint" and "warmup_1" in e["path"])
    from conveyor.runlog import plot_report

    assert plot_report(run).stat().st_size > 0  # with the critic's panels (warm-up at steps <= 0)


@pytest.mark.parametrize("name,group,batch,loss,advantage,k,frozen,warmup", [
    ("sao", 1, 16, "dis", "gae", 2, True, 10),
    ("grpo", 4, 4, "decoupled_ppo", "grpo", 2, True, 0),
    ("grpo_dis", 4, 4, "dis", "grpo", 2, True, 0),
    ("vapo_nodis", 1, 16, "ppo", "gae", 1, False, 10),
])
def test_presets_load_with_the_same_responses_per_update(name, group, batch, loss, advantage, k, frozen, warmup):
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml")
    assert (cfg.rollout.group_size, cfg.trainer.batch_size) == (group, batch)
    assert cfg.rollout.group_size * cfg.trainer.batch_size == 16  # same sample budget per update
    assert (cfg.loss.name, cfg.loss.advantage) == (loss, advantage)
    assert (cfg.critic.updates_per_step, cfg.critic.freeze_attention, cfg.critic.warmup_steps) == (k, frozen, warmup)
    if loss == "dis":
        assert cfg.loss.dis_preset == "reasoning"


def test_critic_settings_errors_name_the_key(tiny, tmp_path):
    from conveyor.config import ConfigError
    from conveyor.preflight import config_warnings
    from conveyor.rundir import check_resume_compatible

    for bad in ("policy:0", "policy:abc", "policy:-1"):
        with pytest.raises(ConfigError, match=r"critic.backbone: .*policy:L takes the policy's first L"):
            load_config(None, ["loss.advantage=gae", f"critic.backbone={bad}"])
    with pytest.raises(ConfigError, match=r"critic.backbone=policy:9: .*L must be in \[1, 2\]"):
        make_trainer(tiny, critic={"backbone": "policy:9"})
    with pytest.raises(ConfigError, match="critic.backbone=nonexistent"):
        make_trainer(tiny, critic={"backbone": "nonexistent"})
    # a rule across keys: one readable line, not a dump of the whole input
    with pytest.raises(ConfigError) as e:
        load_config(None, ["critic.warmup_steps=3"])
    assert "(got {" not in str(e.value) and "\n  critic.warmup_steps=3 needs a critic" in str(e.value)
    warn = config_warnings(load_config(None, ["critic.updates_per_step=4", "critic.backbone=policy:1"]))
    assert any("critic.backbone, critic.updates_per_step set, but loss.advantage=grpo" in w for w in warn)
    assert not any("critic." in w for w in config_warnings(load_config(None, [])))
    # freeze_attention decides which parameters the critic's optimizer holds: fixed on resume
    run = tmp_path / "r"
    run.mkdir()
    cfg = load_config(None, ["loss.advantage=gae", "rollout.group_size=1", f"run.dir={run}"])
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    changed = load_config(None, ["loss.advantage=gae", "rollout.group_size=1", f"run.dir={run}",
                                 "critic.freeze_attention=false"])
    with pytest.raises(ValueError, match="critic.freeze_attention cannot change on resume"):
        check_resume_compatible(run, changed)


def test_turn_values_whitening_and_value_clip_through_the_trainer(tiny):
    """critic.values=turn: every token of an action segment gets the segment's advantage (the
    example's segments [0, 1] and [4]: V_turn = (0.2, 0.6), reward 1, lambda 1:
    A = (0.8, 0.8, -, -, 0.4)); critic.whiten_advantages: mean 0, std 1 over the action tokens;
    critic.value_clip: the clip fraction is reported and the loss stays finite."""
    trajs = [traj(0, [5, 6, 7, 8, 9], 1.0, action_mask=[1, 1, 0, 0, 1]), traj(1, [5, 6], 0.0)]
    table = {0: [0.2, 0.4, 9.0, 9.0, 0.6], 1: [0.5, 0.5]}
    tr = make_trainer(tiny, critic={"policy_lam": 1.0, "values": "turn"})
    fixed_values(tr, table)
    batch = tr.pack(trajs)
    tr.assign_advantages(batch, tr.score(batch))
    assert token_advantages(batch, 0) == pytest.approx([0.8, 0.8, 0.0, 0.0, 0.4], abs=1e-6)
    tr = make_trainer(tiny, critic={"policy_lam": 1.0, "whiten_advantages": True})
    fixed_values(tr, table)
    batch = tr.pack(trajs)
    tr.assign_advantages(batch, tr.score(batch))
    act = torch.cat([mb.advantages[mb.mask > 0] for mb in batch.micro_batches])
    assert float(act.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(act.std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)
    assert token_advantages(batch, 0)[2:4] == [0.0, 0.0]  # observations stay 0
    tr = make_trainer(tiny, critic={"value_clip": 1e-4, "updates_per_step": 2, "lr": 1e-2})
    m = tr.train_step(_batch())
    assert 0.0 <= m["critic/clip_frac"] <= 1.0 and m["critic/updates"] == 2.0


def test_scale_lr_reaches_the_policy_and_the_critic(tiny):
    # the run monitor's lr_scale action (Trainer.scale_lr; through the trainer actor's proxy too)
    tr = make_trainer(tiny)
    assert len(tr.updaters) == 2  # the policy's and the critic's
    before = [[g["lr"] for g in up.optimizer.param_groups] for up in tr.updaters]
    tr.scale_lr(0.5)
    after = [[g["lr"] for g in up.optimizer.param_groups] for up in tr.updaters]
    assert after == [[x * 0.5 for x in lrs] for lrs in before] and all(x > 0 for lrs in before for x in lrs)


def _forward_counter(module):
    calls = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("critic", [
    {},
    {"skip_observations": False, "value_clip": 0.05, "whiten_advantages": True, "value_bounds": (0.0, 0.5)},
    {"warmup_steps": 1, "updates_per_step": 1},
])
def test_values_from_the_first_critic_update_change_nothing_computed(tiny, critic):
    """critic.separate_value_pass=false (default) takes the pre-update values from the first
    critic update's forward pass: the same advantages, returns, critic and policy as the separate
    value pass, on several micro-batches, one critic forward pass per step fewer."""
    small = {"micro_batch_tokens": 24, "pack_row_tokens": 24}  # several micro-batches
    fold = make_trainer(tiny, critic=critic, trainer=small)
    sep = make_trainer(tiny, critic={**critic, "separate_value_pass": True}, trainer=small)
    assert fold.folds_value_pass and not sep.folds_value_pass
    calls_fold, calls_sep = _forward_counter(fold.critic), _forward_counter(sep.critic)
    k = fold.critic_cfg.updates_per_step
    steps = [("warmup", 0)] * fold.critic_cfg.warmup_steps + [("train", 1), ("train", 2)]
    for kind, seed in steps:
        batch = _batch(6, seed=seed)
        n_mb = len(fold.pack(batch).micro_batches)
        assert n_mb >= 3
        before = len(calls_fold), len(calls_sep)
        if kind == "warmup":
            mf, ms = fold.critic_warmup_step(batch), sep.critic_warmup_step(batch)
        else:
            mf, ms = fold.train_step(batch), sep.train_step(batch)
        assert len(calls_fold) - before[0] == k * n_mb  # K passes per micro-batch
        assert len(calls_sep) - before[1] == (k + 1) * n_mb  # + the value pass
        for key in ("critic/value_loss", "critic/value_loss_last", "critic/explained_variance",
                    "critic/value_mean", "critic/return_mean", "critic/clip_frac", "critic/updates"):
            assert mf[key] == pytest.approx(ms[key], rel=1e-5, abs=1e-7), key
        if kind == "train":
            assert "time/critic_values_s" in ms and "time/critic_values_s" not in mf
            for key in ("loss/loss", "train/advantage_abs_mean", "advantage/length_corr", "advantage/sum_rewarded"):
                assert mf[key] == pytest.approx(ms[key], rel=1e-5, abs=1e-7), key
        for a, b in zip(fold.critic.parameters(), sep.critic.parameters(), strict=True):
            assert torch.allclose(a, b, atol=1e-6)
        for a, b in zip(fold.model.parameters(), sep.model.parameters(), strict=True):
            assert torch.allclose(a, b, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(fold.critic.parameters(), make_trainer(tiny).critic.parameters(),
                                                     strict=True))


def test_values_from_the_first_critic_update_survive_a_non_finite_critic_loss(tiny, monkeypatch):
    """A non-finite value loss on the first micro-batch skips that critic update; the micro-batches
    after it still get their values (a pass without gradient), so the advantages and the policy
    update are those of the separate value pass."""
    real = critic_lib.value_loss
    seen = {"n": 0}

    def value_loss_nan_first(*a, **kw):
        out = real(*a, **kw)
        seen["n"] += 1
        if seen["n"] == 1:  # each trainer's first call
            return type(out)(**{**out.__dict__, "loss_sum": out.loss_sum * float("nan")})
        return out

    small = {"micro_batch_tokens": 24, "pack_row_tokens": 24}
    monkeypatch.setattr(critic_lib, "value_loss", value_loss_nan_first)
    results = []
    for separate in (False, True):
        seen["n"] = 0
        tr = make_trainer(tiny, critic={"separate_value_pass": separate}, trainer=small)
        m = tr.train_step(_batch(6, seed=3))
        assert m["critic/skipped_nonfinite"] == 1.0 and m["critic/updates"] == 1.0
        assert m["train/skipped_nonfinite"] == 0
        results.append((tr, m))
    (fold, mf), (sep, ms) = results
    assert mf["train/advantage_abs_mean"] == pytest.approx(ms["train/advantage_abs_mean"], rel=1e-5)
    for a, b in zip(fold.model.parameters(), sep.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    for a, b in zip(fold.critic.parameters(), sep.critic.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_resume_with_other_learning_rates_gives_them_to_the_policy_and_the_critic(tiny):
    """Fresh-user trial 4, finding 1 through the trainer: trainer.lr and critic.lr changed on
    resume reach the loaded optimizers (they kept the checkpoint's), and say so."""
    tr = make_trainer(tiny)
    state = tr.state_dict()
    same = make_trainer(tiny)
    same.load_state_dict(copy.deepcopy(state))
    assert same.settings_taken == []
    other = make_trainer(tiny, trainer={"lr": 5e-4}, critic={"lr": 2e-3, "weight_decay": 0.1})
    other.load_state_dict(copy.deepcopy(state))
    assert other.settings_taken == ["policy lr 0.001 -> 0.0005", "critic lr 0.001 -> 0.002",
                                    "critic weight_decay 0.0 -> 0.1"]
    assert other.policy.lr == pytest.approx(5e-4) and other.critic_updater.lr == pytest.approx(2e-3)
    assert other.critic_updater.optimizer.param_groups[0]["weight_decay"] == 0.1
