"""A user environment loaded by import path in the agent tests (``env.name=agent_env_helpers:TwoStepEnv``;
``tests/`` is on ``sys.path`` under pytest)."""

from __future__ import annotations

from conveyor.envs.base import StepResult


class TwoStepEnv:
    """Two turns whatever the model says: reward ``per_turn`` each, then done and correct.
    Records whether the run's context (reward service) reached it."""

    def __init__(self, per_turn: float = 0.5, context=None):
        self.per_turn = per_turn
        self.has_context = context is not None
        self.n = 0

    async def reset(self, sample):
        self.n = 0
        return f"Say two things about {sample.answer}."

    async def step(self, action):
        self.n += 1
        done = self.n == 2
        return StepResult(None if done else "And the second?", self.per_turn, done,
                          {"correct": True, "has_context": self.has_context} if done else {})


def not_an_env(**kwargs):
    """A factory that returns something that is not an Environment."""
    return object()
