"""Guards against a reward function that always fails (issue 44, section 2).

A reward function that raises, returns NaN, a string or None on every call used to train the
whole run on ``reward.failure_score`` (all-zero rewards, nothing to learn) and exit 0. Two guards:

* **At start-up** (:func:`probe_reward_fn`): a user's ``reward.fn`` is called once, before the
  model loads, on a real sample with a well-formed response (:func:`well_formed_response`:
  ``"Answer: <the sample's answer>"``), through a :class:`~conveyor.rewards.service.RewardService`
  (its worker process, ``reward.timeout_s``, ``reward.max_abs``), as environments are checked at
  start-up. A crash, a timeout or a non-number is refused with a :class:`RewardProbeError` that
  names the function, the sample and the error. The built-in rewards (``math``, ``correctness``,
  ``format``, ``style``) are not probed. ``reward.check_at_start=false`` turns the probe off (the
  fault-injection rewards of :mod:`conveyor.rewards.faults` fail on purpose).
* **During a run** (:class:`FailedRewardSteps`): ``reward.max_failed_steps`` (default 3) training
  steps in a row whose every reward failed stop the run with a :class:`RewardsFailedError`; the
  training loop writes the final checkpoint first and the CLI exits with code 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conveyor.rewards.math import BUILTIN_REWARD_FNS, load_reward_fn
from conveyor.types import Sample

__all__ = ["FailedRewardSteps", "RewardProbeError", "RewardsFailedError", "probe_reward_fn",
           "well_formed_response"]


class RewardProbeError(ValueError):
    """The reward function failed its start-up call (:func:`probe_reward_fn`)."""


class RewardsFailedError(RuntimeError):
    """Every reward failed in ``reward.max_failed_steps`` training steps in a row
    (:class:`FailedRewardSteps`); the run stops with a checkpoint."""


def well_formed_response(sample: Sample) -> str:
    """The response the start-up probe scores: the sample's reference answer after ``"Answer:"``
    (the form the default instructions ask for), ``"Answer: 42"`` for a sample without one."""
    answer = str(sample.answer).strip()
    return f"Answer: {answer or '42'}"


def probe_reward_fn(reward_fn: str, sample: Sample, *, timeout_s: float = 10.0,
                    max_abs_score: float = 1e6, start_timeout_s: float = 120.0) -> float | None:
    """Call a user's reward function once on ``sample`` with a well-formed response, in a reward
    worker (the run's own path: the function is loaded by its import path, under the same
    timeout and validity checks), and refuse it when that call fails.

    Args:
        reward_fn: ``reward.fn`` (a built-in name or an import path).
        sample: A real sample of the data the run trains (or evaluates) on.
        timeout_s: ``reward.timeout_s``.
        max_abs_score: ``reward.max_abs``.
        start_timeout_s: Seconds the worker may take to start and import the function.

    Returns:
        The reward of the well-formed response, or None for a built-in reward (not probed).

    Raises:
        RewardProbeError: the call raised, timed out, crashed its worker, or returned a
            non-number, a non-finite number or one beyond ``reward.max_abs``; the message names
            ``reward.fn``, the function, the sample, the response and the error.
    """
    from conveyor.rewards.service import RewardService

    if reward_fn.strip() in BUILTIN_REWARD_FNS:
        return None
    fn = load_reward_fn(reward_fn)
    name = getattr(fn, "__qualname__", type(fn).__name__)
    response = well_formed_response(sample)
    with RewardService(reward_fn, timeout_s=timeout_s, max_workers=1, max_abs_score=max_abs_score,
                       start_timeout_s=start_timeout_s) as service:
        result = service.score_sync(response, sample)
    if result.failed:
        raise RewardProbeError(
            f"reward.fn={reward_fn!r}: {name}(response, sample) failed at start-up on a well-formed response "
            f"(sample {sample.id!r}, response {response!r}): {result.error}. Every reward of the run would "
            "fail; fix the function (it must return a finite number for every response; "
            "reward.check_at_start=false skips this check)")
    return result.score


class FailedRewardSteps:
    """Counts training steps in a row whose every reward failed; stops the run at a limit.

    Args:
        limit: ``reward.max_failed_steps`` (None: never stop).
        reward_fn: ``reward.fn``, for the message.
    """

    def __init__(self, limit: int | None, reward_fn: str):
        self.limit = limit
        self.reward_fn = reward_fn
        self.in_a_row = 0

    def after_step(self, version: int, batch: Sequence[Any]) -> None:
        """Record a trained step's batch (trajectories with ``metadata["reward_failed"]``).

        Raises:
            RewardsFailedError: this step made ``limit`` steps in a row with every reward failed;
                the message names ``reward.fn``, the version and the last error.
        """
        failed = [t for t in batch if bool(t.metadata.get("reward_failed"))]
        if not batch or len(failed) < len(batch):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        if self.limit is None or self.in_a_row < self.limit:
            return
        errors = [t.metadata.get("reward_error") for t in failed if t.metadata.get("reward_error")]
        last = f"; the last error: {errors[-1]}" if errors else ""
        raise RewardsFailedError(
            f"reward.fn={self.reward_fn}: every reward failed in {self.in_a_row} training steps in a row "
            f"(reward.max_failed_steps={self.limit}), up to version {version}{last}. The run stopped: "
            "it was training on reward.failure_score alone. Fix the reward function (each failure is "
            "in train.log), then continue with conveyor train --resume RUN_DIR")
