"""conveyor.trainer.value_diagnostics: hand-computed cases (issue 45), and the trainer's values
on trajectories (Trainer.trajectory_values, the value/* step metrics)."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.trainer import value_diagnostics as vd
from conveyor.trainer.value_diagnostics import ValueTrace


def test_monte_carlo_returns_by_hand():
    act = torch.tensor([1, 1, 0, 0, 1])  # an observation of two tokens in between
    assert vd.monte_carlo_returns(1.0, act).tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    # gamma per action token: G_4 = 1, G_1 = 0.5 * 1, G_0 = 0.25 (the observation is skipped)
    assert vd.monte_carlo_returns(1.0, act, gamma=0.5).tolist() == [0.25, 0.5, 0.0, 0.0, 1.0]
    # turn rewards replace the outcome: 2 on token 1, 3 on token 4; gamma 0.5
    got = vd.monte_carlo_returns(9.0, act, turn_rewards=[(1, 2.0), (4, 3.0)], gamma=0.5)
    assert got.tolist() == [0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 0.0, 0.0, 3.0]
    with pytest.raises(ValueError, match="not an action token"):
        vd.monte_carlo_returns(1.0, act, turn_rewards=[(2, 1.0)])
    with pytest.raises(ValueError, match="gamma"):
        vd.monte_carlo_returns(1.0, act, gamma=1.5)


def test_explained_variance_and_pearson_by_hand():
    r = torch.tensor([0.0, 0.0, 1.0, 1.0])  # Var(R) = 0.25
    assert vd.explained_variance(r.clone(), r) == 1.0
    assert vd.explained_variance(torch.full((4,), 0.5), r) == 0.0  # the mean: nothing explained
    # V = [0.25, 0.25, 0.75, 0.75]: R - V = [-.25, -.25, .25, .25], Var = 0.0625 -> 1 - 0.25 = 0.75
    assert vd.explained_variance(torch.tensor([0.25, 0.25, 0.75, 0.75]), r) == pytest.approx(0.75)
    assert vd.explained_variance(torch.zeros(4), r) == pytest.approx(1 - 0.25 / 0.25 * 1.0)  # a shift is not penalised
    assert vd.explained_variance(torch.tensor([1.0, 1.0, 0.0, 0.0]), r) == pytest.approx(1 - 1.0 / 0.25)
    assert math.isnan(vd.explained_variance(torch.zeros(3), torch.ones(3)))
    assert vd.pearson(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 7.0])) == pytest.approx(
        (-1 * -2.333333 + 0 + 1 * 2.666667) / math.sqrt(2 * ((2.333333) ** 2 + 0.333333 ** 2 + 2.666667 ** 2)), abs=1e-5)
    assert math.isnan(vd.pearson(torch.ones(3), torch.tensor([1.0, 2.0, 3.0])))


def test_calibration_bins_by_hand():
    pred = torch.tensor([0.9, 0.1, 0.5, 0.2, 0.8])
    out = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0])
    bins = vd.calibration(pred, out, bins=2)  # sorted: 0.1 0.2 0.5 | 0.8 0.9 (first bin one larger)
    assert [b["count"] for b in bins] == [3.0, 2.0]
    assert bins[0]["value_mean"] == pytest.approx(0.8 / 3) and bins[0]["return_mean"] == pytest.approx(1 / 3)
    assert bins[1]["value_mean"] == pytest.approx(0.85) and bins[1]["return_mean"] == pytest.approx(0.5)
    assert len(vd.calibration(pred[:1], out[:1], bins=5)) == 1


def _trace(values, reward, key, mask=None):
    v = torch.tensor(values, dtype=torch.float32)
    act = torch.ones(len(values), dtype=torch.bool) if mask is None else torch.tensor(mask) != 0
    return ValueTrace(v, vd.monte_carlo_returns(reward, act), act, key)


def test_value_diagnostics_by_hand():
    # prompt a: success rate 1 (2 of 2), prompt b: 0 (0 of 2); the critic knows it from the first token
    traces = [_trace([0.9, 0.95, 1.0], 1.0, "a"), _trace([0.8, 0.9], 1.0, "a"),
              _trace([0.1, 0.0, 0.0], 0.0, "b"), _trace([0.2, 0.1, 0.0, 0.0], 0.0, "b", mask=[1, 0, 1, 1])]
    d = vd.value_diagnostics(traces, bins=2)
    assert d["trajectories"] == 4.0
    assert d["first_value_corr"] == pytest.approx(vd.pearson(torch.tensor([0.9, 0.8, 0.1, 0.2]),
                                                             torch.tensor([1.0, 1.0, 0.0, 0.0])))
    assert d["prompt_corr"] == pytest.approx(1.0)  # two prompts: (0.85, 1) and (0.15, 0)
    assert d["prompt_explainable"] == pytest.approx(1.0)  # the returns are the prompts' rates
    # first-token EV: R - V = [.1, .2, -.1, -.2]: Var = 0.025; Var(R) = 0.25 -> 0.9
    assert d["first_explained_variance"] == pytest.approx(0.9)
    # the observation token (0.1 in the last trace) is not read: action values 0.2, 0.0, 0.0
    v = torch.tensor([0.9, 0.95, 1.0, 0.8, 0.9, 0.1, 0.0, 0.0, 0.2, 0.0, 0.0])
    r = torch.tensor([1.0] * 5 + [0.0] * 6)
    assert d["explained_variance"] == pytest.approx(vd.explained_variance(v, r))
    assert d["value_abs_error"] == pytest.approx(float((v - r).abs().mean()))
    assert [b["count"] for b in d["calibration"]] == [2.0, 2.0]
    assert d["calibration"][1]["return_mean"] == 1.0 and d["calibration"][0]["return_mean"] == 0.0
    # the profile: successes end at 1.0 / 0.9 (mean 0.95 in the last fifth), failures at 0
    prof = d["profile"]
    assert prof["success"][-1] == pytest.approx(0.95) and prof["failure"][-1] == pytest.approx(0.0)
    assert prof["success"][0] == pytest.approx((0.925 + 0.8) / 2)  # first half: (0.9 + 0.95) / 2 and 0.8
    empty = vd.value_diagnostics([])
    assert empty["trajectories"] == 0.0 and math.isnan(empty["explained_variance"])


def test_value_trace_shapes_checked():
    with pytest.raises(ValueError, match="1-D of one length"):
        ValueTrace(torch.zeros(3), torch.zeros(2), torch.ones(3, dtype=torch.bool), "x")


# --------------------------------------------------------------------------------------------
# the trainer: values on trajectories, value/* metrics, a value that is learnable is learnt
# --------------------------------------------------------------------------------------------

def _trainer(tiny, **critic):
    import copy

    from conveyor.config import CriticConfig, LossConfig, TrainerConfig
    from conveyor.trainer.trainer import Trainer

    torch.manual_seed(0)
    return Trainer(copy.deepcopy(tiny.model), TrainerConfig(bf16=False, lr=1e-3, warmup_steps=0),
                   LossConfig(name="dis", advantage="gae", kl_coef=0.0),
                   critic_cfg=CriticConfig(**{"lr": 1e-3, **critic}))


def _learnable(n_prompts: int, per_prompt: int, seed: int):
    """Prompts that start with token 7 always succeed, those with token 9 never; the rest of the
    prompt and the response are random (the value is a function of the prompt's first token)."""
    from conveyor.types import Sample, Trajectory

    g = torch.Generator().manual_seed(seed)
    out = []
    for p in range(n_prompts):
        good = p % 2 == 0
        prompt = [7 if good else 9] + torch.randint(20, 1000, (4,), generator=g).tolist()
        for _ in range(per_prompt):
            r = torch.randint(20, 1000, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            out.append(Trajectory(sample=Sample(f"s{seed}-{p}", "q", "1", "t"), group_id=f"g{seed}-{p}",
                                  prompt_ids=prompt, response_ids=r, behaviour_logprobs=[-5.0] * len(r),
                                  versions=[0] * len(r), reward=1.0 if good else 0.0))
    return out


def test_trajectory_values_are_the_critics_values_in_order(tiny):
    tr = _trainer(tiny)
    trajs = _learnable(3, 2, seed=0)
    trajs[1].action_mask = [1, 0, 1] + [1] * (len(trajs[1].response_ids) - 3)  # an observation token
    traces = tr.trajectory_values(trajs)
    assert [t.prompt_key for t in traces] == [str(t.sample.id) for t in trajs]
    for t, tc in zip(trajs, traces, strict=True):
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            v = tr.critic(ids)[0]
        want = v[len(t.prompt_ids) - 1: -1]  # the state before each response token
        assert tc.values.shape == (len(t.response_ids),)
        assert torch.allclose(tc.values, want, atol=1e-5)
        assert tc.returns[tc.action_mask].eq(t.reward).all()
    assert not bool(traces[1].action_mask[1]) and traces[1].returns[1] == 0.0


def test_value_metrics_in_every_critic_step_read_the_pre_update_values(tiny):
    tr = _trainer(tiny, updates_per_step=2)
    trajs = _learnable(4, 2, seed=1)
    before = vd.value_diagnostics(tr.trajectory_values(trajs))
    m = tr.critic_warmup_step(trajs)
    # the values of the critic before this step's updates (trajectories it had not seen)
    assert m["value/first_value_corr"] == pytest.approx(before["first_value_corr"], abs=1e-5)
    assert m["value/explained_variance"] == pytest.approx(before["explained_variance"], abs=1e-5)
    assert m["value/explained_variance"] == pytest.approx(m["critic/explained_variance"], abs=1e-4)
    assert sum(m[f"value/calib{b}_count"] for b in range(5)) == len(trajs)
    after = tr.train_step(_learnable(4, 2, seed=2))
    assert "value/prompt_corr" in after and "value/calib4_return" in after


def test_a_learnable_value_is_learnt_on_held_out_prompts(tiny):
    """The value is a function of the prompt's first token: after critic-only steps on some
    prompts, the critic predicts the return on prompts it never saw (explained variance and
    prompt correlation high); the untrained critic does not."""
    tr = _trainer(tiny, updates_per_step=2, lr=3e-3)
    held = _learnable(8, 2, seed=100)
    d0 = vd.value_diagnostics(tr.trajectory_values(held))
    assert not d0["explained_variance"] > 0.2
    for step in range(15):
        tr.critic_warmup_step(_learnable(4, 2, seed=step))
    d = vd.value_diagnostics(tr.trajectory_values(held))
    assert d["explained_variance"] > 0.5 and d["prompt_corr"] > 0.9, d
