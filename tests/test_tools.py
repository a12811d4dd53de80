"""The calculator tool: safe arithmetic, observation tokens and their exclusion from the loss."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from conveyor.rollout.tools import calculate, format_number, generate_with_calculator


@pytest.mark.parametrize("text, result", [
    ("Ellen spent 12 * 15 ", "180"), ("so 7 x 8", "56"), ("John walks 0.7 + 0.4 ", "1.1"), ("(3 + 4) * 2 ", "14"),
    ("1,000 + 25 ", "1025"), ("he has 27 - 7 ", "20"), ("10 ÷ 4 ", "2.5"), ("costs $5 * 3 ", "15"), ("1 / 3", "0.3333"),
    ("-4 + 10", "6"),
])
def test_calculate(text, result):
    assert calculate(text) == result


@pytest.mark.parametrize("text", ["the box ", "x 5 ", "4 / 0 ", "12 ", "", "2 ** 50 ", "import os ", "9e99 * 9e99 ",
                                  "99999999 * 99999999 "])
def test_calculate_refuses(text):
    assert calculate(text) is None


def test_format_number():
    assert format_number(12.0) == "12" and format_number(2.5) == "2.5" and format_number(-3.0) == "-3"


class FakeEngine:
    """Replays scripted segments; records the prompts it was given."""

    version = 3

    def __init__(self, tok, segments):
        self.tok, self.segments, self.prompts = tok, list(segments), []

    async def generate(self, prompt_ids, params):
        from conveyor.rollout.engine import GenerationOutput

        self.prompts.append((list(prompt_ids), params))
        text = self.segments.pop(0)
        ids = self.tok.encode(text, add_special_tokens=False)[: params.max_new_tokens]
        stop = "=" in text and "=" in params.stop
        return GenerationOutput(prompt_ids=list(prompt_ids), token_ids=ids, logprobs=[-0.5] * len(ids), versions=[self.version] * len(ids),
                                finish_reason="stop" if stop or not self.segments else "length", text=self.tok.decode(ids),
                                num_interruptions=0)


def test_generate_with_calculator_inserts_observations(tiny):
    from conveyor.rollout.engine import SamplingParams

    tok = tiny.tokenizer
    eng = FakeEngine(tok, ["She has 12 * 15 =", " apples. Answer: 180"])
    out = asyncio.run(generate_with_calculator(eng, tok, [1, 2, 3], SamplingParams(max_new_tokens=64, temperature=1.0)))
    assert out.tool_calls == 1
    assert "12 * 15 = 180 apples. Answer: 180" in out.text
    obs = [t for t, a in zip(out.token_ids, out.action_mask, strict=True) if a == 0]
    assert tok.decode(obs).strip() == "180"
    assert all(lp == 0.0 for lp, a in zip(out.logprobs, out.action_mask, strict=True) if a == 0)
    assert len(out.versions) == len(out.token_ids) and set(out.versions) == {3}
    # the second segment's prompt holds the first segment and the observation
    assert eng.prompts[1][0] == [1, 2, 3] + out.token_ids[: len(eng.prompts[1][0]) - 3]
    assert "=" in eng.prompts[0][1].stop


def test_observation_tokens_carry_no_loss(tiny):
    from conveyor.config import LossConfig, TrainerConfig
    from conveyor.trainer.batch import pack
    from conveyor.trainer.trainer import Trainer, compute_advantages
    from tests.test_trainer import make_trajs

    trajs = make_trajs(4)
    for t in trajs:
        t.action_mask = [1] * len(t.response_ids)
        t.action_mask[-1] = 0
    mb = pack(trajs, compute_advantages(trajs, "grpo"), [list(range(4))])
    assert mb.num_tokens == sum(len(t.response_ids) - 1 for t in trajs)
    # an observation token's behaviour log-prob can be anything: the update ignores it
    model_a, model_b = copy.deepcopy(tiny.model), copy.deepcopy(tiny.model)
    cfg = TrainerConfig(lr=1e-3, warmup_steps=0, bf16=False)
    Trainer(model_a, cfg, LossConfig()).train_step(trajs)
    for t in trajs:
        t.behaviour_logprobs = t.behaviour_logprobs[:-1] + [-50.0]
    Trainer(model_b, cfg, LossConfig()).train_step(trajs)
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b)
    bad = copy.deepcopy(trajs[0])
    bad.action_mask = [1]
    with pytest.raises(ValueError, match="action_mask"):
        pack([bad], torch.zeros(1), [[0]])
