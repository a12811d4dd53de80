"""Plain data types passed between components (no behaviour, no shared mutable state)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One prompt of a data set together with its reference answer.

    Attributes:
        id: Stable identifier, ``"<dataset spec>/<row index>"`` (e.g. ``"mawps:singleop/17"``).
        question: The problem text shown to the model (without any instruction wrapper).
        answer: The reference answer as a string (e.g. ``"43"``, ``"\\frac{1}{2}"``).
        dataset: The registry spec the sample came from (e.g. ``"gsm8k:test"``, ``"rg:basic_arithmetic"``).
        metadata: Extra fields. reasoning-gym samples keep their original entry under
            ``"rg_entry"`` so that reasoning-gym's own scorer can be applied.
    """

    id: str
    question: str
    answer: str
    dataset: str
    metadata: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass
class Trajectory:
    """One generated response to one prompt, with everything the trainer needs.

    Token-level lists are aligned with ``response_ids`` (length ``R``, the response length in
    tokens). A trajectory may span several policy versions when an interruptible rollout was
    updated mid-generation (MISSION.md section 1); ``versions[i]`` is the policy version that
    produced ``response_ids[i]``. Prompt tokens have no version (conventionally ``-1``).

    Attributes:
        sample: The prompt's data-set sample.
        group_id: Identifier shared by all responses to the same prompt in one rollout group.
        prompt_ids: Prompt token ids, length ``P`` (chat template already applied).
        response_ids: Generated token ids, length ``R``.
        behaviour_logprobs: ``log pi_behav(token)`` recorded by the inference engine, length ``R``
            (natural log, under the distribution actually sampled from).
        versions: Policy version of each response token, length ``R``.
        reward: Scalar reward (set by the reward service; ``reward_failed`` tells whether the reward
            function raised or timed out and the configured failure score was used).
        correct: Whether the extracted answer matched the reference (None when unknown).
        finish_reason: ``"stop"`` (eos / stop string), ``"length"`` (max new tokens) or ``"abort"``.
        text: Decoded response text.
        metadata: Free-form extras (e.g. ``reward_failed``, ``format_ok``).
        action_mask: Optional, length ``R``: 1 for tokens the policy generated, 0 for tokens an
            environment inserted (tool observations), which carry no loss (SAO's
            skip-observation idea, MISSION.md section 3). None means every token is an action.
    """

    sample: Sample
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    versions: list[int]
    reward: float = 0.0
    correct: bool | None = None
    finish_reason: str = "stop"
    text: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    action_mask: list[int] | None = None

    @property
    def oldest_version(self) -> int:
        """Version of the oldest response token (staleness is measured from it); -1 if empty."""
        return min(self.versions) if self.versions else -1

    @property
    def num_versions(self) -> int:
        """Number of distinct policy versions that produced this response."""
        return len(set(self.versions))
