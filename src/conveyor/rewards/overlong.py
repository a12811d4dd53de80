"""Reward shaping for responses that hit the length limit (``reward.overlong``).

A response cut at ``rollout.max_new_tokens`` (``finish_reason == "length"``) never finished its
reasoning, yet the answer checker may still find a correct number in it (the last number of an
unfinished sentence). Rewarding that teaches the policy to write longer: SAO seed 1 on MAWPS
(docs/results/sao.md) drifted to the 96-token limit, with 15 of 16 responses truncated and still
rewarded. DAPO (Yu et al. 2025, arXiv 2503.14476, section 3.4) names the problem "reward noise
from overlong responses" and gives two remedies, overlong filtering and soft overlong punishment;
conveyor offers both, and a plain zero reward:

* ``keep``: the reward as the reward function gave it (the default; today's behaviour).
* ``zero``: a truncated response earns 0, whatever the checker said (an unfinished answer is
  no answer).
* ``soft``: DAPO's soft overlong punishment (Eq. 13), added to the reward::

      R_length(y) = 0                                  if |y| <= L_max - L_cache
                  = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                  = -1                                 if |y| > L_max

  times ``penalty`` (DAPO: 1). ``L_max`` is ``rollout.max_new_tokens`` and ``L_cache`` is
  ``reward.overlong_buffer``; ``|y|`` counts every response token (a tool's observation tokens
  included: they use the same budget).
* ``filter``: DAPO's overlong filtering: the reward is kept, but no token of a truncated
  response carries loss (its action mask is cleared, :func:`overlong_action_mask`), so the
  policy is neither rewarded nor punished for an answer it never finished. The response still
  counts in its group's reward statistics (GRPO mean / std), but in neither loss normaliser
  (``loss.aggregation``: its tokens leave the token count and, carrying no loss token, the
  response leaves the sequence count). A batch whose responses are all filtered takes no
  optimiser step (``train/optimizer_steps`` 0); the policy version still advances.

The reward function's own score is kept in ``trajectory.metadata["raw_reward"]``.
"""

from __future__ import annotations

from typing import Literal

OverlongMode = Literal["keep", "zero", "soft", "filter"]
OVERLONG_MODES: tuple[str, ...] = ("keep", "zero", "soft", "filter")


def soft_overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment ``R_length`` (arXiv 2503.14476, Eq. 13).

    Args:
        length: Response length ``|y|`` in tokens (>= 0).
        max_length: ``L_max``, the generation limit in tokens (> 0).
        buffer: ``L_cache``, the length of the penalised interval in tokens,
            ``0 < buffer <= max_length``.

    Returns:
        A penalty in ``[-1, 0]``: 0 up to ``max_length - buffer`` tokens, then falling linearly to
        -1 at ``max_length``; -1 beyond.

    Raises:
        ValueError: a negative ``length``, ``max_length <= 0``, or ``buffer`` outside
            ``(0, max_length]``.
    """
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if max_length <= 0:
        raise ValueError(f"max_length must be > 0, got {max_length}")
    if not 0 < buffer <= max_length:
        raise ValueError(f"reward.overlong_buffer must be in (0, rollout.max_new_tokens={max_length}], got {buffer}")
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / buffer
    return -1.0


def shape_overlong_reward(reward: float, *, length: int, truncated: bool, mode: OverlongMode, max_length: int,
                          buffer: int = 16, penalty: float = 1.0) -> float:
    """The reward a response gets under ``reward.overlong`` (see the module docstring).

    Args:
        reward: The reward function's score.
        length: Response tokens (actions and observations).
        truncated: The response hit the length limit (``finish_reason == "length"``).
        mode: ``keep``, ``zero``, ``soft`` or ``filter``.
        max_length: ``rollout.max_new_tokens`` (``soft`` only).
        buffer: ``reward.overlong_buffer`` tokens (``soft`` only).
        penalty: ``reward.overlong_penalty``, the factor on DAPO's ``R_length`` (``soft`` only).

    Returns:
        ``reward`` (``keep`` and ``filter``, whose remedy is the loss mask; ``zero`` for an
        untruncated response), 0.0 (``zero``, truncated), or
        ``reward + penalty * R_length(length)`` (``soft``; a function of the length alone, so an
        untruncated long response is penalised too).

    Raises:
        ValueError: an unknown ``mode``; ``soft`` with a bad ``buffer`` / ``max_length``.
    """
    if mode in ("keep", "filter"):
        return reward
    if mode == "zero":
        return 0.0 if truncated else reward
    if mode == "soft":
        return reward + penalty * soft_overlong_penalty(length, max_length, buffer)
    raise ValueError(f"reward.overlong must be one of {OVERLONG_MODES}, got {mode!r}")


def overlong_action_mask(action_mask: list[bool] | None, *, length: int, truncated: bool,
                         mode: OverlongMode) -> list[bool] | None:
    """The loss mask of a response under ``reward.overlong`` (DAPO's overlong filtering,
    arXiv 2503.14476 section 3.4, for ``filter``; every other mode keeps the mask).

    Args:
        action_mask: The response's action mask (``[length]``, True = a model token that carries
            loss; False = an observation), or None (every token is an action).
        length: Response tokens (actions and observations).
        truncated: The response hit the length limit (``finish_reason == "length"``).
        mode: ``keep``, ``zero``, ``soft`` or ``filter``.

    Returns:
        ``[False] * length`` for a truncated response under ``filter`` (no token carries loss),
        otherwise ``action_mask`` unchanged.

    Raises:
        ValueError: an unknown ``mode``, or an ``action_mask`` whose length is not ``length``.
    """
    if mode not in OVERLONG_MODES:
        raise ValueError(f"reward.overlong must be one of {OVERLONG_MODES}, got {mode!r}")
    if action_mask is not None and len(action_mask) != length:
        raise ValueError(f"action_mask has {len(action_mask)} entries for a {length}-token response")
    if mode == "filter" and truncated:
        return [False] * length
    return action_mask
