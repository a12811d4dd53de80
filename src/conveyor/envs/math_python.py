"""Maths with a sandboxed Python tool (issue 14, section 3): SAO's setting (MISSION.md section 3,
"python tool allowed") on conveyor's data sets.

One episode per sample: the first user message is the question, how to call the tool
(:meth:`~conveyor.envs.tool_calls.ToolCallFormat.instructions`) and the data set's answer
instruction (``data.instruction``, e.g. "Give the final answer as a number after 'Answer:'.").
Each model turn (the action) is then either

* **a tool call** (:mod:`conveyor.envs.tool_calls`: ``<tool_call>{"name": "python",
  "arguments": {"code": ...}}</tool_call>`` or a fenced ```` ```python ```` block): the code runs
  in a fresh bubblewrap sandbox (:class:`~conveyor.envs.sandbox.PythonTool`) and the
  observation is what it printed, cut to ``max_observation_chars`` (head and tail kept:
  :func:`~conveyor.envs.tool_calls.truncate_observation`), with a contained incident stated
  plainly (``Error: time limit 10 s exceeded; the program was killed.``); a malformed call, an
  unknown tool or two calls in one turn get an ``Error: ...`` observation and run nothing.
  Reward 0, the episode goes on;
* **a final answer** (a turn without a tool call): the episode ends and the turn's text is
  graded by conveyor's grading (:mod:`conveyor.rewards.math`: every answer mark must equal the
  reference) **in the run's reward service** (:class:`~conveyor.rewards.RewardService`: worker
  processes with a timeout, so a pathological answer such as ``\\boxed{9^{9^{9^{9}}}}`` costs a
  worker its timeout, never the engine or the trainer). The reward is ``reward.fn``'s score of
  that turn; ``info["correct"]`` / ``info["format_ok"]`` are the service's
  :data:`~conveyor.rewards.ANSWER_METRICS` (None when the check failed), and
  ``info["reward_failed"]`` flags a failed reward call.

Only the final turn is graded (earlier turns' reasoning and code may contain numbers and marks
that are not the answer). An episode that reaches ``env.max_turns`` or ``env.max_episode_tokens``
without a final answer is unsolved: every non-final step reports ``correct = False`` so far.

Per-episode counters (:meth:`MathPythonEnv.episode_stats`, copied by the agent workflow into
``trajectory.metadata["env_stats"]``): ``tool_calls`` (turns that attempted a call),
``tool_calls_ok`` (calls that ran and succeeded: valid call, exit status 0, no incident) and
``incidents`` (each sandbox incident kind, :data:`~conveyor.envs.sandbox.INCIDENT_KINDS`).
"""

from __future__ import annotations

from typing import Any

from conveyor.envs.base import StepResult
from conveyor.envs.sandbox import INCIDENT_KINDS
from conveyor.envs.tool_calls import ToolCallFormat, truncate_observation
from conveyor.envs.tools import ToolRegistry
from conveyor.types import Sample

__all__ = ["MathPythonEnv"]


class MathPythonEnv:
    """One math-with-Python episode (module docstring).

    Args:
        registry: The tools (normally one :class:`~conveyor.envs.sandbox.PythonTool`, shared by
            every episode of a run so its concurrency limit holds across them).
        fmt: The tool-call format (:func:`~conveyor.envs.tool_calls.resolve_tool_format`).
        reward_service: Grades the final answer; must compute
            :data:`~conveyor.rewards.ANSWER_METRICS` (``RewardService(fn, metrics=ANSWER_METRICS)``).
        instruction: The answer instruction appended to the first message (``data.instruction``).
        max_observation_chars: Longest observation shown to the model (characters, >= 64).

    Attributes:
        stop, observation_role, tools: The format's (read by
            :class:`~conveyor.rollout.agent.AgentWorkflow`).

    Raises:
        ValueError: no reward service, one without the answer metrics, or
            ``max_observation_chars < 64``.
    """

    def __init__(self, registry: ToolRegistry, fmt: ToolCallFormat, *, reward_service, instruction: str = "",
                 max_observation_chars: int = 1024):
        from conveyor.rewards import ANSWER_METRICS

        if reward_service is None:
            raise ValueError("MathPythonEnv needs a reward service to grade the final answer (answer checks run in its "
                             "worker processes with a timeout, never in the rollout's own process)")
        missing = [m for m in ANSWER_METRICS if m not in getattr(reward_service, "metric_names", ())]
        if missing:
            raise ValueError(f"MathPythonEnv: the reward service does not compute the metrics {missing} "
                             "(RewardService(..., metrics=conveyor.rewards.ANSWER_METRICS))")
        if max_observation_chars < 64:
            raise ValueError(f"env.max_observation_chars must be >= 64, got {max_observation_chars}")
        self.registry, self.fmt, self.reward_service = registry, fmt, reward_service
        self.instruction = instruction
        self.max_observation_chars = max_observation_chars
        self.stop = fmt.stop
        self.observation_role = fmt.observation_role
        self.tools = fmt.tools
        self.sample: Sample | None = None
        self._stats: dict[str, Any] = {}

    async def reset(self, sample: Sample) -> str:
        """Start an episode: the first user message (question, tool instructions, answer
        instruction)."""
        self.sample = sample
        self._stats = {"tool_calls": 0, "tool_calls_ok": 0, "incidents": dict.fromkeys(INCIDENT_KINDS, 0)}
        parts = [sample.question, self.fmt.instructions()]
        if self.instruction:
            parts.append(self.instruction)
        return "\n\n".join(p for p in parts if p)

    async def step(self, action: str) -> StepResult:
        """A tool call -> its (truncated) output; anything else -> the graded final answer.

        Raises:
            RuntimeError: :meth:`reset` was not called.
        """
        if self.sample is None:
            raise RuntimeError("MathPythonEnv.step before reset")
        calls = self.fmt.parse(action)
        if not calls:
            return await self._final(action)
        self._stats["tool_calls"] += 1
        not_so_far = {"correct": False, "format_ok": False}  # if a limit ends the episode here
        problem = self.fmt.error_observation(calls)
        if problem is not None:
            return StepResult(problem, 0.0, False, dict(not_so_far, tool_error=problem))
        (call,) = calls
        result = await self.registry.call(call.name, call.arguments)
        if result.ok:
            self._stats["tool_calls_ok"] += 1
        if result.incident is not None:
            self._stats["incidents"][result.incident] = self._stats["incidents"].get(result.incident, 0) + 1
        text = truncate_observation(result.observation, self.max_observation_chars)
        return StepResult(self.fmt.observation(text), 0.0, False, dict(not_so_far, incident=result.incident))

    async def _final(self, action: str) -> StepResult:
        r = await self.reward_service.score(action, self.sample)
        correct, fmt = r.metrics.get("correct"), r.metrics.get("format_ok")
        return StepResult(None, float(r.score), True, {
            "correct": None if correct is None else correct >= 1.0,
            "format_ok": None if fmt is None else fmt >= 1.0,
            "reward_failed": r.failed, "reward_error": r.error,
        })

    def episode_stats(self) -> dict[str, Any]:
        """This episode's counters so far (module docstring): ``tool_calls``,
        ``tool_calls_ok`` and ``incidents`` (kind -> count); a new dict."""
        return {"tool_calls": self._stats.get("tool_calls", 0), "tool_calls_ok": self._stats.get("tool_calls_ok", 0),
                "incidents": dict(self._stats.get("incidents", {}))}
