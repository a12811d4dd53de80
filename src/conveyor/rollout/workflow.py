"""The workflow seam: agent / task logic that turns one data-set sample into trajectories.

A workflow is any object with ``async run_episode(engine, sample) -> list[Trajectory] | None``
(AReaL's ``RolloutWorkflow.arun_episode`` seam, ``areal/api/workflow_api.py``): it may call the
engine any number of times (multi-turn, tools) and returns the episode's trajectories -- a group of
responses to the same prompt for GRPO, a list of one for single-rollout methods -- or ``None`` to
reject the episode. The infrastructure (controller, staleness bound, buffer) never looks inside.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Protocol, runtime_checkable

from conveyor.prompts import build_prompt_ids
from conveyor.rewards import ANSWER_METRICS, RewardService
from conveyor.rewards.overlong import (
    OVERLONG_MODES,
    OverlongMode,
    overlong_action_mask,
    shape_overlong_reward,
    soft_overlong_penalty,
)
from conveyor.rollout.engine import SamplingParams
from conveyor.rollout.tools import TOOLS, generate_with_calculator
from conveyor.types import Sample, Trajectory


@runtime_checkable
class RolloutWorkflow(Protocol):
    """What the rollout controller runs for every sample."""

    async def run_episode(self, engine, sample: Sample) -> list[Trajectory] | None:
        """Generate and score the episode's trajectories; None rejects the episode."""
        ...


class SingleTurnMathWorkflow:
    """One chat-formatted question, ``group_size`` sampled responses, each scored by the reward
    service (MISSION.md section 1: rewards computed off the main path, with timeouts).

    The accuracy metric (``trajectory.correct``) and the format flag
    (``metadata["format_ok"]``) come from the same worker call as the reward (the service's
    :data:`~conveyor.rewards.ANSWER_METRICS`): nothing here runs answer checking in this process,
    so a pathological answer (``\\boxed{9^{9^{9^{9}}}}``) costs one worker its timeout, never the
    engine or the trainer (issue 10, section 3). When that call fails (timeout, crash) the
    correctness is unknown: ``correct`` and ``format_ok`` are None.

    Args:
        tokenizer: The policy's tokenizer (chat template).
        reward_service: Scores responses; failed rewards (exception / timeout) get the service's
            failure score and are flagged in ``trajectory.metadata["reward_failed"]``. It must
            compute the metrics of :data:`~conveyor.rewards.ANSWER_METRICS`
            (``RewardService(fn, metrics=ANSWER_METRICS)``).
        params: Sampling parameters of the engine.
        group_size: Responses per prompt (>= 1).
        instruction: Appended to every question (the answer-format instruction).
        tool: ``"none"`` or ``"calculator"``: each response may call a calculator
            (:mod:`conveyor.rollout.tools`); its results are observation tokens
            (``trajectory.action_mask`` 0), never trained on.
        max_tool_calls: Observations per response at most.
        overlong: ``reward.overlong`` (``keep``, ``zero``, ``soft``, ``filter``): the reward of a
            response cut at ``params.max_new_tokens``
            (:func:`conveyor.rewards.overlong.shape_overlong_reward`; the reward function's score
            stays in ``metadata["raw_reward"]``), or, with ``filter``, its loss mask cleared
            (:func:`~conveyor.rewards.overlong.overlong_action_mask`; ``metadata
            ["overlong_filtered"]``).
        overlong_buffer: ``soft``: DAPO's ``L_cache`` in tokens.
        overlong_penalty: ``soft``: the penalty factor.

    Raises:
        ValueError: ``group_size < 1``, an unknown ``tool``, or a reward service without the
            metrics of :data:`~conveyor.rewards.ANSWER_METRICS`.
    """

    def __init__(self, tokenizer, reward_service: RewardService, params: SamplingParams, *, group_size: int = 4, instruction: str = "",
                 tool: str = "none", max_tool_calls: int = 4, overlong: OverlongMode = "keep",
                 overlong_buffer: int = 16, overlong_penalty: float = 1.0):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if tool not in TOOLS:
            raise ValueError(f"tool must be one of {TOOLS}, got {tool!r}")
        computed = getattr(reward_service, "metric_names", ())
        missing = [m for m in ANSWER_METRICS if m not in computed]
        if missing:
            raise ValueError(f"reward_service does not compute the metrics {missing}: build "
                             "it with RewardService(reward_fn, "
                             "metrics=conveyor.rewards.ANSWER_METRICS)")
        self.tool = tool
        self.max_tool_calls = max_tool_calls
        self.tokenizer = tokenizer
        self.reward_service = reward_service
        self.params = params
        self.group_size = group_size
        self.instruction = instruction
        self.overlong = overlong
        self.overlong_buffer = overlong_buffer
        self.overlong_penalty = overlong_penalty
        if overlong == "soft":  # the arguments' errors at construction, not at the first episode
            soft_overlong_penalty(0, params.max_new_tokens, overlong_buffer)
        elif overlong not in OVERLONG_MODES:
            raise ValueError(f"overlong must be one of {OVERLONG_MODES}, got {overlong!r}")

    async def run_episode(self, engine, sample: Sample) -> list[Trajectory] | None:
        """Sample ``group_size`` responses concurrently and score them.

        Returns:
            ``group_size`` trajectories sharing one ``group_id``; None when every response was
            aborted (engine stopping).
        """
        prompt_ids = build_prompt_ids(self.tokenizer, sample, self.instruction)
        if self.tool == "calculator":
            outs = await asyncio.gather(*[generate_with_calculator(engine, self.tokenizer, prompt_ids, self.params,
                                                                   max_calls=self.max_tool_calls) for _ in range(self.group_size)])
        else:
            outs = await asyncio.gather(*[engine.generate(prompt_ids, self.params) for _ in range(self.group_size)])
        if all(o.finish_reason == "abort" for o in outs):
            return None
        # reward, correctness and format: one isolated worker call per response (with its timeout)
        t0 = time.perf_counter()
        results = await asyncio.gather(*[self.reward_service.score(o.text, sample) for o in outs])
        reward_s = time.perf_counter() - t0
        group_id = f"{sample.id}#{uuid.uuid4().hex[:12]}"  # unique across processes and resumes
        trajs = []
        for o, r in zip(outs, results, strict=True):
            correct, fmt = r.metrics.get("correct"), r.metrics.get("format_ok")
            reward = shape_overlong_reward(float(r.score), length=len(o.token_ids),
                                           truncated=o.finish_reason == "length", mode=self.overlong,
                                           max_length=self.params.max_new_tokens, buffer=self.overlong_buffer,
                                           penalty=self.overlong_penalty)
            truncated = o.finish_reason == "length"
            action_mask = overlong_action_mask(o.action_mask, length=len(o.token_ids), truncated=truncated,
                                               mode=self.overlong)
            trajs.append(
                Trajectory(
                    sample=sample,
                    group_id=group_id,
                    prompt_ids=list(o.prompt_ids),
                    response_ids=list(o.token_ids),
                    behaviour_logprobs=list(o.logprobs),
                    versions=list(o.versions),
                    reward=reward,
                    correct=None if correct is None else correct >= 1.0,
                    finish_reason=o.finish_reason,
                    text=o.text,
                    action_mask=action_mask,
                    sampling_mask=o.sampling_mask,  # truncated sampling's sets
                    metadata={
                        "reward_failed": r.failed,
                        "raw_reward": float(r.score),  # before reward.overlong
                        "overlong_filtered": self.overlong == "filter" and truncated,  # no loss
                        "reward_error": r.error,
                        "format_ok": None if fmt is None else fmt >= 1.0,
                        "reward_metrics": dict(r.metrics),  # every metric of the service (style verdicts)
                        "num_interruptions": o.num_interruptions,
                        "reward_seconds": reward_s,
                        # which engine request generated which tokens: old-log-prob patches
                        # (partial_sync / dedicated) are addressed by request key
                        "request_spans": [list(sp) for sp in o.spans()],
                        "tool_calls": o.tool_calls,
                    },
                )
            )
        return trajs


class EnvLatencyWorkflow:
    """Wrap a workflow so every episode also waits on a simulated environment (an agent's tool
    call) with a long-tailed latency: the inner episode runs, then the episode sleeps a
    log-normal time (median ``median_s`` s, log-space ``sigma``, capped at ``max_s``) before it is
    returned. Waiting, not computing: other episodes and the trainer keep running. The wait is
    recorded per trajectory in ``metadata["env_seconds"]`` (s).

    This is the rollout profile (b) of ``benchmarks/async_vs_sync.py``; a real tool-using agent
    would implement ``run_episode`` itself.

    Raises:
        ValueError: ``median_s <= 0``, ``sigma < 0`` or ``max_s <= 0``.
    """

    def __init__(self, inner: RolloutWorkflow, *, median_s: float, sigma: float = 1.0, max_s: float = 60.0, seed: int = 0):
        if median_s <= 0 or sigma < 0 or max_s <= 0:
            raise ValueError(f"env latency needs median_s > 0, sigma >= 0, max_s > 0; got {median_s}, {sigma}, {max_s}")
        import random

        self.inner = inner
        self.median_s, self.sigma, self.max_s = median_s, sigma, max_s
        self._rng = random.Random(seed)

    def sample_latency(self) -> float:
        """One latency draw (s)."""
        import math

        return min(self.max_s, self.median_s * math.exp(self.sigma * self._rng.gauss(0.0, 1.0)))

    async def run_episode(self, engine, sample: Sample) -> list[Trajectory] | None:
        """The inner episode, then the environment wait (see the class docstring)."""
        trajs = await self.inner.run_episode(engine, sample)
        wait = self.sample_latency()
        await asyncio.sleep(wait)
        if trajs is not None:
            for t in trajs:
                t.metadata["env_seconds"] = wait
        return trajs
