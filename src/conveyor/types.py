"""Plain data types passed between components (no behaviour, no shared mutable state)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported lazily: reward worker processes import this module
    import torch


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


class SamplingMask:
    """The kept support of each generated token under truncated sampling (sampling-mask replay).

    With top-k / top-p / min-p the engine samples token ``a_t`` from the truncated, renormalised
    policy ``pi^S(a) = exp(z_a / T) / sum_{v in S_t} exp(z_v / T)`` over its kept set ``S_t``;
    every log-prob of that token (behaviour, proximal, current, reference) is renormalised over
    the same ``S_t`` (docs/design.md, "Truncated sampling: which log-probs"; DeepSeek-V3.2,
    arXiv 2512.02556 section 3.1, "Keep Sampling Mask"). Stored compactly as CSR (vLLM's mask
    replay returns the same layout):

    Attributes:
        token_ids: ``[N]`` int32, the kept token ids of all tokens, concatenated (token ``k``'s
            ids are sorted by descending probability under the behaviour policy).
        offsets: ``[R + 1]`` int64, ``offsets[0] = 0``, non-decreasing, ``offsets[R] = N``;
            token ``k``'s set is ``token_ids[offsets[k]:offsets[k + 1]]``. An empty range
            means the full vocabulary (untruncated sampling, tool observation tokens).

    Memory: 4 bytes per kept id plus 8 per token. Pickles (checkpoints) as two tensors.

    Raises:
        ValueError: on construction, when the tensors are not 1-D, ``token_ids`` is not an
            integer tensor, or ``offsets`` is not a valid CSR offset vector for ``token_ids``.
    """

    __slots__ = ("token_ids", "offsets")

    def __init__(self, token_ids: torch.Tensor, offsets: torch.Tensor):
        import torch

        if not isinstance(token_ids, torch.Tensor) or not isinstance(offsets, torch.Tensor):
            raise ValueError("SamplingMask: token_ids and offsets must be torch tensors")
        if token_ids.dim() != 1 or offsets.dim() != 1 or offsets.numel() < 1:
            raise ValueError(f"SamplingMask: token_ids [N] and offsets [R + 1] must be 1-D, got "
                             f"{list(token_ids.shape)} and {list(offsets.shape)}")
        if token_ids.is_floating_point() or offsets.is_floating_point():
            raise ValueError("SamplingMask: token_ids and offsets must be integer tensors")
        offsets = offsets.to(torch.int64)
        bad = int(offsets[0]) != 0 or int(offsets[-1]) != token_ids.numel()
        if bad or bool((offsets.diff() < 0).any()):
            raise ValueError(f"SamplingMask: offsets must start at 0, be non-decreasing and end "
                             f"at len(token_ids) = {token_ids.numel()}")
        self.token_ids = token_ids.to(torch.int32)
        self.offsets = offsets

    def __len__(self) -> int:
        """Number of tokens ``R`` described."""
        return self.offsets.numel() - 1

    def __eq__(self, other: object) -> bool:
        import torch

        return (isinstance(other, SamplingMask) and torch.equal(self.offsets, other.offsets)
                and torch.equal(self.token_ids, other.token_ids))

    __hash__ = None  # mutable tensors

    def __repr__(self) -> str:
        return f"SamplingMask(tokens={len(self)}, kept_ids={self.token_ids.numel()})"

    def __getstate__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.token_ids, self.offsets

    def __setstate__(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.token_ids, self.offsets = state

    def sizes(self) -> torch.Tensor:
        """``[R]`` int64, the size of each token's kept set (0 = full vocabulary)."""
        return self.offsets.diff()

    def support(self, k: int) -> torch.Tensor:
        """Token ``k``'s kept ids (int32; empty = full vocabulary)."""
        return self.token_ids[self.offsets[k] : self.offsets[k + 1]]

    @property
    def nbytes(self) -> int:
        """Bytes held by the two tensors."""
        return self.token_ids.numel() * 4 + self.offsets.numel() * 8

    @staticmethod
    def concat(parts: Sequence[SamplingMask | int | None]) -> SamplingMask | None:
        """Concatenate the masks of consecutive token spans (e.g. the generation segments and the
        tool observations of one episode). An ``int`` part ``n`` stands for ``n`` tokens without
        a set (observations, untruncated segments).

        Returns:
            The mask of all tokens, or None when no part holds a set (nothing was truncated).

        Raises:
            ValueError: a part that is neither a :class:`SamplingMask` nor an int >= 0.
        """
        import torch

        if not any(isinstance(p, SamplingMask) for p in parts):
            return None
        ids, sizes = [], []
        for p in parts:
            if isinstance(p, SamplingMask):
                ids.append(p.token_ids)
                sizes.append(p.sizes())
            elif isinstance(p, int) and not isinstance(p, bool) and p >= 0:
                sizes.append(torch.zeros(p, dtype=torch.int64))
            else:
                raise ValueError(f"SamplingMask.concat: a part must be a SamplingMask or an "
                                 f"int >= 0, got {p!r}")
        size = torch.cat(sizes)
        return SamplingMask(torch.cat(ids), torch.cat([size.new_zeros(1), size.cumsum(0)]))


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
        sampling_mask: Optional :class:`SamplingMask` of length ``R``: the kept support of each
            token under truncated sampling (top-k / top-p / min-p), replayed by the trainer so
            that every log-prob is renormalised over it. None: no truncation (full vocabulary).
            Never written to the JSONL logs.
        turn_rewards: Optional per-turn rewards of a multi-turn episode: ``(k, r)`` pairs, the
            reward ``r`` of the turn whose last action token is response token ``k``
            (:mod:`conveyor.rollout.agent`). Token-level GAE puts each on its token; outcome
            estimators (GRPO, ...) use ``reward`` (their sum). None: one outcome reward on the
            last action token.
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
    sampling_mask: SamplingMask | None = None
    turn_rewards: list[tuple[int, float]] | None = None

    @property
    def oldest_version(self) -> int:
        """Version of the oldest response token (staleness is measured from it); -1 if empty."""
        return min(self.versions) if self.versions else -1

    @property
    def num_versions(self) -> int:
        """Number of distinct policy versions that produced this response."""
        return len(set(self.versions))
