"""The math_python environment (issue 14, section 3) and environments by name: a scripted model
calls the sandboxed python tool (an answer, a timeout, two calls in one turn), then answers; the
episode is token-exact against the chat template, graded in the reward service (a pathological
answer times out there instead of hanging), its sandbox incidents are counted in the trajectory
and the step metrics; the config refuses settings that cannot work; user environments load by
import path."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest

from conveyor.config import ConfigError, EnvConfig, load_config
from conveyor.envs.math_python import MathPythonEnv
from conveyor.envs.registry import check_env, make_env_factory
from conveyor.envs.sandbox import (
    BWRAP_INSTALL_HINT,
    INCIDENT_KINDS,
    PythonTool,
    SandboxConfig,
    bwrap_path,
)
from conveyor.envs.tool_calls import resolve_tool_format
from conveyor.envs.tools import ToolRegistry
from conveyor.rewards import ANSWER_METRICS, RewardService
from conveyor.rollout.agent import AgentWorkflow
from conveyor.rollout.engine import GenerationOutput, SamplingParams
from conveyor.runtime.record import batch_metrics
from conveyor.types import Sample

needs_bwrap = pytest.mark.skipif(bwrap_path() is None, reason=f"skipped: {BWRAP_INSTALL_HINT}")
QUESTION = Sample("mawps:singleop/0", "What is 17 times 23?", "391", "mawps:singleop")


class ScriptedEngine:
    """Answers each ``generate`` with the next scripted turn: its text encoded, plus the
    end-of-turn token unless the text ends with one of the request's stop strings (as the real
    engine stops there)."""

    version = 0

    def __init__(self, tok, turns):
        self.tok, self.turns, self.params = tok, list(turns), []

    async def generate(self, prompt_ids, params):
        self.params.append(params)
        text = self.turns.pop(0)
        ids = self.tok.encode(text, add_special_tokens=False)
        if not any(text.endswith(s) for s in params.stop):
            ids.append(self.tok.eos_token_id)
        return GenerationOutput(prompt_ids=list(prompt_ids), token_ids=ids, logprobs=[-0.5] * len(ids),
                                versions=[0] * len(ids), finish_reason="stop",
                                text=self.tok.decode(ids, skip_special_tokens=True), key=f"s:{len(self.params)}")


class Recorded(MathPythonEnv):
    """MathPythonEnv that keeps the first message and every observation (to rebuild the chat)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.messages = []

    async def reset(self, sample):
        first = await super().reset(sample)
        self.messages = [{"role": "user", "content": first}]
        return first

    async def step(self, action):
        res = await super().step(action)
        self.messages.append({"role": "assistant", "content": action})
        if res.observation is not None:
            self.messages.append({"role": self.observation_role, "content": res.observation})
        return res


@pytest.fixture(scope="module")
def service():
    with RewardService("correctness", metrics=ANSWER_METRICS, timeout_s=2.0, max_workers=1) as s:
        s.wait_ready(60)
        yield s


def episode(tok, turns, service, *, fmt="auto", wall_s=10.0):
    tool = PythonTool(SandboxConfig(cpu_s=2, wall_s=wall_s), max_concurrency=2)
    registry = ToolRegistry([tool])
    f = resolve_tool_format(fmt, tok, registry)
    envs = []

    def make():
        envs.append(Recorded(registry, f, reward_service=service, instruction="Give the final answer after 'Answer:'.",
                             max_observation_chars=200))
        return envs[-1]

    engine = ScriptedEngine(tok, turns)
    wf = AgentWorkflow(tok, make, SamplingParams(max_new_tokens=200, temperature=1.0), max_turns=6,
                       max_total_tokens=2000)
    (t,) = asyncio.run(wf.run_episode(engine, QUESTION))
    return t, envs[0], engine, tool


@needs_bwrap
def test_fenced_episode_runs_code_counts_incidents_and_grades_the_answer(tiny, service):
    tok = tiny.tokenizer
    turns = [
        "Let me compute.\n```python\nprint(17 * 23)\n```\n```output",  # stops at the stop string
        "```python\nimport time\ntime.sleep(30)\n```",  # the wall-time limit
        "```python\nprint(1)\n```\nand\n```python\nprint(2)\n```",  # two calls: none runs
        "17 x 23 = 391.\nAnswer: 391",
    ]
    t0 = time.monotonic()
    t, env, engine, tool = episode(tok, turns, service, wall_s=1.5)
    assert time.monotonic() - t0 < 30
    assert all("```output" in p.stop for p in engine.params)  # the format's stop string reached the engine
    obs = [m["content"] for m in env.messages if m["role"] == "user"][1:]
    assert obs[0] == "```output\n391\n```"
    assert obs[1].startswith("```output\n") and "Error: time limit 1.5 s exceeded; the program was killed." in obs[1]
    assert "Error: 2 tool calls in one turn; make one call per turn" in obs[2]
    # the final turn is graded in the reward service: correct, reward 1 on the last turn only
    assert t.correct is True and t.reward == 1.0 and t.metadata["format_ok"] is True
    assert [r for _, r in t.turn_rewards] == [0.0, 0.0, 0.0, 1.0]
    assert t.metadata["env_done"] is True and t.metadata["reward_failed"] is False
    incidents = dict.fromkeys(INCIDENT_KINDS, 0) | {"timeout": 1}
    assert t.metadata["env_stats"] == {"tool_calls": 3, "tool_calls_ok": 1, "incidents": incidents}
    assert tool.calls == 2 and tool.incidents["timeout"] == 1  # the two-call turn ran nothing
    # token-exact: prompt + response is the chat template's rendering of the conversation
    rendered = tok.apply_chat_template(env.messages, tokenize=False)
    assert tok.decode(t.prompt_ids + t.response_ids) == rendered.removesuffix("\n")
    # observations (and the end-of-turn text after a stop string) carry no action mask
    first_obs = tok.decode([i for i, m in zip(t.response_ids, t.action_mask, strict=True) if m == 0][:3])
    assert first_obs.startswith("<|im_end|>")
    m = batch_metrics([t])
    assert m["agent/turns_mean"] == 4 and m["agent/tool_call_rate"] == 0.75
    assert m["agent/tool_call_success_rate"] == pytest.approx(1 / 3)
    assert m["agent/sandbox_incidents"] == 1 and m["agent/incidents/timeout"] == 1 and m["agent/incidents/memory"] == 0
    assert m["rollout/accuracy"] == 1.0 and m["rollout/format_rate"] == 1.0


@needs_bwrap
def test_hermes_episode_with_a_tools_template_is_token_exact(tiny, service):
    from test_tool_calls import QWEN_LIKE

    tok = copy.deepcopy(tiny.tokenizer)
    tok.chat_template = QWEN_LIKE
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(17 * 23)"}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "python", "arguments": {"program": "print(1)"}}\n</tool_call>'
    t, env, engine, _ = episode(tok, [call, bad, "Answer: 391"], service)
    assert engine.params[0].stop == ("</tool_call>",)
    assert [m["role"] for m in env.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert env.messages[2]["content"] == "391"
    assert env.messages[4]["content"].startswith("Error: missing argument(s): 'code'")
    assert t.correct is True and t.metadata["env_stats"]["tool_calls"] == 2
    assert t.metadata["env_stats"]["tool_calls_ok"] == 1
    # the tool schemas are in the prompt, rendered by the template; the conversation is exact
    rendered = tok.apply_chat_template(env.messages, tools=env.tools, tokenize=False)
    assert '"name": "python"' in tok.decode(t.prompt_ids)
    assert tok.decode(t.prompt_ids + t.response_ids) == rendered.removesuffix("\n")


@needs_bwrap
def test_a_pathological_final_answer_times_out_in_the_reward_service(tiny, service):
    t0 = time.monotonic()
    t, _, _, _ = episode(tiny.tokenizer, ["Answer: \\boxed{9^{9^{9^{9}}}}"], service)
    assert time.monotonic() - t0 < 20  # the grader's worker was killed at 2 s, not this process
    assert t.metadata["reward_failed"] is True and t.correct is None and t.reward == 0.0
    assert t.metadata["env_done"] is True and t.metadata["env_stats"]["tool_calls"] == 0


def test_an_episode_cut_by_the_turn_limit_is_unsolved(tiny, service):
    registry = ToolRegistry([PythonTool(SandboxConfig(cpu_s=1, wall_s=2.0))])
    fmt = resolve_tool_format("fenced", tiny.tokenizer, registry)
    env = MathPythonEnv(registry, fmt, reward_service=service)
    engine = ScriptedEngine(tiny.tokenizer, ["```python\n\n```"] * 2)  # empty blocks: no sandbox run
    wf = AgentWorkflow(tiny.tokenizer, lambda: env, SamplingParams(max_new_tokens=50), max_turns=2)
    (t,) = asyncio.run(wf.run_episode(engine, QUESTION))
    assert t.correct is False and t.metadata["env_done"] is False and t.reward == 0.0
    assert t.metadata["env_stats"]["tool_calls"] == 2 and t.metadata["env_stats"]["tool_calls_ok"] == 0
    assert batch_metrics([t])["agent/episodes_cut_share"] == 1.0
    with pytest.raises(ValueError, match="reward service"):
        MathPythonEnv(registry, fmt, reward_service=None)


def test_config_refuses_environment_settings_that_cannot_work():
    cfg = load_config(None, ["env.name=math_python"])
    assert cfg.rollout.tool == "none" and cfg.data.train == "mawps:singleop:train"  # left default: resolved
    cfg = load_config(None, ["env.name=guess"])
    assert (cfg.data.train, cfg.data.heldout, cfg.data.instruction) == ("guess:train", "guess:heldout", "")
    cfg = load_config(None, ["env.name=guess", "data.train=guess:train?high=10"])
    assert cfg.data.train == "guess:train?high=10" and cfg.data.heldout == "guess:heldout"
    for overrides, keys in [
        (["env.name=math_python", "rollout.tool=calculator"], "env.name=math_python with rollout.tool=calculator"),
        (["env.name=guess", "reward.overlong=zero"], "reward.overlong=zero"),
        (["env.name=guess", "reward.fn=math"], "env.name=guess with reward.fn=math"),
        (["env.name=shell"], "env.name must be none, guess, math_python"),
        (["env.name=math_python", "env.tool_format=json"], "env.tool_format"),
        (["env.name=math_python", "env.max_turns=0"], "env.max_turns"),
    ]:
        with pytest.raises(ConfigError, match=keys.replace("(", r"\(")):
            load_config(None, overrides)
    assert load_config(None, ["env.name=none"]).env.name == "none"
    assert load_config(None, ["env.name=pkg.mod:make"]).env.name == "pkg.mod:make"


def test_environments_by_name_and_import_path(tiny):
    tok = tiny.tokenizer
    factory = make_env_factory(EnvConfig(name="agent_env_helpers:TwoStepEnv", options={"per_turn": 0.25}),
                               tokenizer=tok, reward_service="svc")
    a, b = factory(), factory()
    assert a is not b and a.per_turn == 0.25 and a.has_context  # context= passed when declared
    assert check_env(EnvConfig(name="agent_env_helpers:TwoStepEnv"), tok) == []
    with pytest.raises(ValueError, match="env.options .* do not fit"):
        make_env_factory(EnvConfig(name="agent_env_helpers:TwoStepEnv", options={"nope": 1}), tokenizer=tok,
                         reward_service=None)
    with pytest.raises(TypeError, match="not an Environment"):
        check_env(EnvConfig(name="agent_env_helpers:not_an_env"), tok)
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        check_env(EnvConfig(name="no_such_module:Env"), tok)
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        check_env(EnvConfig(name="agent_env_helpers:Nope"), tok)
    g = make_env_factory(EnvConfig(name="guess", options={"high": 10, "max_guesses": 2}), tokenizer=tok,
                         reward_service=None)()
    assert (g.high, g.max_guesses) == (10, 2)
    with pytest.raises(ValueError, match="guess environment"):
        check_env(EnvConfig(name="guess", options={"size": 3}), tok)
    with pytest.raises(ValueError, match="math_python takes none"):
        check_env(EnvConfig(name="math_python", options={"x": 1}), tok)
