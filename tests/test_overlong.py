"""reward.overlong: the reward of a response cut at rollout.max_new_tokens (keep / zero / DAPO's
soft overlong punishment, arXiv 2503.14476 Eq. 13), hand-computed."""

from __future__ import annotations

import asyncio

import pytest

from conveyor.config import ConfigError, load_config
from conveyor.rewards import ANSWER_METRICS, RewardService
from conveyor.rewards.overlong import (
    overlong_action_mask,
    shape_overlong_reward,
    soft_overlong_penalty,
)
from conveyor.rollout.engine import GenerationOutput, SamplingParams
from conveyor.rollout.workflow import SingleTurnMathWorkflow
from conveyor.types import Sample


def test_soft_penalty_hand_computed():
    # L_max 96, L_cache 16: free up to 80 tokens, then -(|y| - 80) / 16, -1 at 96 and beyond
    assert soft_overlong_penalty(0, 96, 16) == 0.0
    assert soft_overlong_penalty(80, 96, 16) == 0.0
    assert soft_overlong_penalty(81, 96, 16) == pytest.approx(-1 / 16)
    assert soft_overlong_penalty(88, 96, 16) == pytest.approx(-0.5)
    assert soft_overlong_penalty(96, 96, 16) == pytest.approx(-1.0)
    assert soft_overlong_penalty(120, 96, 16) == -1.0
    assert soft_overlong_penalty(10, 10, 10) == pytest.approx(-1.0)  # the whole budget penalised


@pytest.mark.parametrize("args", [(-1, 96, 16), (5, 0, 1), (5, 96, 0), (5, 96, 97)])
def test_soft_penalty_refuses_bad_arguments(args):
    with pytest.raises(ValueError):
        soft_overlong_penalty(*args)


def test_shape_modes_hand_computed():
    kw = dict(max_length=96, buffer=16)
    assert shape_overlong_reward(1.0, length=96, truncated=True, mode="keep", **kw) == 1.0
    assert shape_overlong_reward(1.0, length=96, truncated=True, mode="zero", **kw) == 0.0
    assert shape_overlong_reward(1.0, length=50, truncated=False, mode="zero", **kw) == 1.0
    assert shape_overlong_reward(-0.5, length=96, truncated=True, mode="zero", **kw) == 0.0
    # soft: reward + penalty * R_length; by length alone (an untruncated 88-token answer pays too)
    assert shape_overlong_reward(1.0, length=88, truncated=False, mode="soft", penalty=0.5, **kw) == pytest.approx(0.75)
    assert shape_overlong_reward(1.0, length=96, truncated=True, mode="soft", **kw) == pytest.approx(0.0)
    assert shape_overlong_reward(0.0, length=70, truncated=False, mode="soft", **kw) == 0.0
    assert shape_overlong_reward(1.0, length=96, truncated=True, mode="filter", **kw) == 1.0  # its remedy: the mask
    with pytest.raises(ValueError, match="reward.overlong"):
        shape_overlong_reward(1.0, length=1, truncated=False, mode="drop", **kw)


def test_overlong_action_mask_hand_computed():
    obs = [True, False, True]  # a tool observation in the middle
    assert overlong_action_mask(obs, length=3, truncated=True, mode="filter") == [False, False, False]
    assert overlong_action_mask(None, length=2, truncated=True, mode="filter") == [False, False]
    assert overlong_action_mask(obs, length=3, truncated=False, mode="filter") is obs
    for mode in ("keep", "zero", "soft"):
        assert overlong_action_mask(None, length=2, truncated=True, mode=mode) is None
    with pytest.raises(ValueError, match="3 entries for a 2-token response"):
        overlong_action_mask(obs, length=2, truncated=True, mode="filter")
    with pytest.raises(ValueError, match="reward.overlong"):
        overlong_action_mask(None, length=2, truncated=True, mode="drop")


class _Engine:
    """Answers "3" (correct): the first request stops, the second hits the length limit."""

    def __init__(self):
        self.calls = 0

    async def generate(self, prompt_ids, params):
        self.calls += 1
        n = 2 if self.calls == 1 else params.max_new_tokens
        return GenerationOutput(prompt_ids=list(prompt_ids), token_ids=list(range(3, 3 + n)), logprobs=[-1.0] * n,
                                versions=[0] * n, finish_reason="stop" if self.calls == 1 else "length",
                                text="3", num_interruptions=0)


@pytest.mark.parametrize("mode, rewards", [("keep", [1.0, 1.0]), ("zero", [1.0, 0.0]), ("soft", [1.0, 0.0]),
                                           ("filter", [1.0, 1.0])])
def test_workflow_shapes_truncated_rewards_and_keeps_the_raw_one(tiny, mode, rewards):
    sample = Sample(id="t/1", question="What is 1 + 2?", answer="3", dataset="t")
    with RewardService("correctness", timeout_s=30.0, max_workers=1, metrics=ANSWER_METRICS) as svc:
        wf = SingleTurnMathWorkflow(tiny.tokenizer, svc, SamplingParams(max_new_tokens=8), group_size=2,
                                    overlong=mode, overlong_buffer=4)
        trajs = asyncio.run(wf.run_episode(_Engine(), sample))
    assert [t.reward for t in trajs] == rewards
    assert [t.metadata["raw_reward"] for t in trajs] == [1.0, 1.0]  # nothing computed is lost
    assert [t.correct for t in trajs] == [True, True]  # accuracy is the checker's, not the shaped reward
    filtered = mode == "filter"
    assert [t.metadata["overlong_filtered"] for t in trajs] == [False, filtered]
    assert trajs[0].action_mask is None  # the finished response keeps its loss
    assert trajs[1].action_mask == ([False] * 8 if filtered else None)  # the truncated one: none under filter


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_a_filtered_response_adds_no_gradient_and_an_all_filtered_batch_no_step(tiny, aggregation):
    """DAPO's overlong filtering in the trainer: what a filtered response holds does not change the
    gradient (it leaves both normalisers), and a batch of filtered responses takes no step."""
    import copy

    import torch
    from test_trainer import make_trajs

    from conveyor.config import LossConfig, TrainerConfig
    from conveyor.trainer.trainer import Trainer

    def grad_of(trajs):
        model = copy.deepcopy(tiny.model)
        tr = Trainer(model, TrainerConfig(lr=1e-3, bf16=False, grad_clip=None, warmup_steps=0),
                     LossConfig(aggregation=aggregation, behaviour_weight_cap=None))
        captured = {}
        orig = tr.optimizer.step

        def step(*a, **k):
            captured["g"] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()
            return orig(*a, **k)

        tr.optimizer.step = step
        before = [p.detach().clone() for p in model.parameters()]
        m = tr.train_step(trajs)
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return captured.get("g"), m, changed, tr.version

    trajs = make_trajs(8)
    trajs[2].action_mask = [False] * len(trajs[2].response_ids)  # filtered (truncated under filter)
    g1, m1, _, _ = grad_of(trajs)
    wild = copy.deepcopy(trajs)
    wild[2].behaviour_logprobs = [-40.0] * len(wild[2].response_ids)  # would dominate if it carried loss
    g2, m2, _, _ = grad_of(wild)
    assert g1 is not None and torch.isfinite(g1).all() and torch.equal(g1, g2)
    assert m1["train/tokens"] == sum(len(t.response_ids) for i, t in enumerate(trajs) if i != 2)
    for t in trajs:
        t.action_mask = [False] * len(t.response_ids)
    g, m, changed, version = grad_of(trajs)
    assert g is None and not changed and version == 1  # no step; the version still advances
    assert m["train/optimizer_steps"] == 0 and m["train/grad_norm"] == 0.0 and m["train/tokens"] == 0


def test_workflow_and_config_refuse_a_buffer_beyond_the_limit(tiny):
    with RewardService("correctness", timeout_s=30.0, max_workers=1, metrics=ANSWER_METRICS) as svc:
        with pytest.raises(ValueError, match="overlong_buffer"):
            SingleTurnMathWorkflow(tiny.tokenizer, svc, SamplingParams(max_new_tokens=8), overlong="soft",
                                   overlong_buffer=9)
    with pytest.raises(ConfigError, match="overlong_buffer"):
        load_config(None, ["reward.overlong=soft", "reward.overlong_buffer=500", "rollout.max_new_tokens=96"])
    assert load_config(None, ["reward.overlong=zero"]).reward.overlong == "zero"
