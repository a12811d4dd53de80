"""The workflow seam: agent / task logic that turns one data-set sample into trajectories.

A workflow is any object with ``async run_episode(engine, sample) -> list[Trajectory] | None``
(AReaL's ``RolloutWorkflow.arun_episode`` seam, ``areal/api/workflow_api.py``): it may call the
engine any number of times (multi-turn, tools) and returns the episode's trajectories -- a group of
responses to the same prompt for GRPO, a list of one for single-rollout methods -- or ``None`` to
reject the episode. The infrastructure (controller, staleness bound, buffer) never looks inside.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Protocol, runtime_checkable

from conveyor.prompts import build_prompt_ids
from conveyor.rewards import RewardService, correctness_reward, format_ok
from conveyor.rollout.engine import SamplingParams
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

    Args:
        tokenizer: The policy's tokenizer (chat template).
        reward_service: Scores responses; failed rewards (exception / timeout) get the service's
            failure score and are flagged in ``trajectory.metadata["reward_failed"]``.
        params: Sampling parameters of the engine.
        group_size: Responses per prompt (>= 1).
        instruction: Appended to every question (the answer-format instruction).
    """

    def __init__(self, tokenizer, reward_service: RewardService, params: SamplingParams, *, group_size: int = 4, instruction: str = ""):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.tokenizer = tokenizer
        self.reward_service = reward_service
        self.params = params
        self.group_size = group_size
        self.instruction = instruction

    async def run_episode(self, engine, sample: Sample) -> list[Trajectory] | None:
        """Sample ``group_size`` responses concurrently and score them.

        Returns:
            ``group_size`` trajectories sharing one ``group_id``; None when every response was
            aborted (engine stopping).
        """
        prompt_ids = build_prompt_ids(self.tokenizer, sample, self.instruction)
        outs = await asyncio.gather(*[engine.generate(prompt_ids, self.params) for _ in range(self.group_size)])
        if all(o.finish_reason == "abort" for o in outs):
            return None
        # rewards (worker processes) and the accuracy metric (threads) are computed concurrently
        results, corrects = await asyncio.gather(
            asyncio.gather(*[self.reward_service.score(o.text, sample) for o in outs]),
            asyncio.gather(*[asyncio.to_thread(correctness_reward, o.text, sample) for o in outs]),
        )
        group_id = f"{sample.id}#{uuid.uuid4().hex[:12]}"  # unique across processes and resumes
        trajs = []
        for o, r, correct in zip(outs, results, corrects, strict=True):
            trajs.append(
                Trajectory(
                    sample=sample,
                    group_id=group_id,
                    prompt_ids=list(o.prompt_ids),
                    response_ids=list(o.token_ids),
                    behaviour_logprobs=list(o.logprobs),
                    versions=list(o.versions),
                    reward=float(r.score),
                    correct=correct >= 1.0,
                    finish_reason=o.finish_reason,
                    text=o.text,
                    metadata={
                        "reward_failed": r.failed,
                        "reward_error": r.error,
                        "format_ok": format_ok(o.text),
                        "num_interruptions": o.num_interruptions,
                    },
                )
            )
        return trajs
