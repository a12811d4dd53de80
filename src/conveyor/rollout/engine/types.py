"""Request / output value types of the inference engine: :class:`SamplingParams` (how to sample
one request), :class:`GenerationOutput` (one finished request), :class:`PartialRequest` (a
request's state at a pause, for partial-rollout sync), :class:`PromptTooLongError`, and the
finish reasons (``FINISH_STOP`` / ``FINISH_LENGTH`` / ``FINISH_ABORT``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from conveyor.types import SamplingMask

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's response.

    Attributes:
        max_new_tokens: Maximum number of generated tokens (>= 1). Generation also stops when
            ``len(prompt) + len(response)`` reaches the model's ``max_position_embeddings``
            (finish reason ``"length"`` in both cases).
        temperature: Softmax temperature (>= 0, finite). ``0`` means greedy decoding.
        top_p: Nucleus sampling mass in ``(0, 1]``; ``1`` disables it. Applied last, on the
            distribution renormalised after min-p and top-k; the smallest set of most likely
            tokens whose mass reaches ``top_p`` is kept.
        top_k: Keep only the ``top_k`` most likely tokens (>= 0); ``0`` disables it.
        min_p: Keep only tokens with ``p >= min_p * p_max`` under ``softmax(logits / T)``
            (vLLM / Nguyen et al. arXiv 2407.01082), in ``[0, 1]``; ``0`` disables it. Applied
            after temperature and before top-k / top-p, as vLLM v1 does (its min-p is an
            argmax-invariant logits processor run before ``apply_top_k_top_p``). The test is
            a probability ratio, so it commutes with top-k; it changes what top-p sees.
        stop: Stop strings. After every generated token the decoded response (special tokens
            skipped) is searched; when one occurs, generation stops with finish reason
            ``"stop"``. The stop string is *kept*: ``token_ids`` ends with the token that
            completed it and ``text`` is the decoding of all tokens, so it contains the stop
            string (plus any characters the last token adds after it). Checking decodes the
            whole response each step, O(response length) per token; use stop strings only
            when needed. A list is accepted and stored as a tuple.
        stop_token_ids: Token ids that end generation (finish reason ``"stop"``, the token is
            kept), in addition to the tokenizer's ``eos_token_id`` and the ids in the model's
            ``generation_config.eos_token_id``. A list is accepted and stored as a tuple.
        seed: Optional seed of this request's random stream. ``None`` derives it from the
            engine seed and the request's submission index.
        ignore_eos: Do not stop at the tokenizer's / model's end-of-sequence ids (vLLM's
            ``ignore_eos``): the response then has exactly ``max_new_tokens`` tokens unless a stop
            string or ``stop_token_ids`` ends it. For benchmarks that need controlled lengths.

    Raises:
        ValueError: on an invalid field; the message names the field.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, int | float)
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if (
            isinstance(self.top_p, bool)
            or not isinstance(self.top_p, int | float)
            or not (0.0 < self.top_p <= 1.0)
        ):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if (
            isinstance(self.min_p, bool)
            or not isinstance(self.min_p, int | float)
            or not (0.0 <= self.min_p <= 1.0)
        ):
            raise ValueError(
                f"min_p must be a number in [0, 1] (0 disables it), got {self.min_p!r}"
            )
        if isinstance(self.stop, str):
            raise ValueError(f"stop must be a tuple of strings, not a single string: {self.stop!r}")
        stop = tuple(self.stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain non-empty strings, got {s!r}")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids)
        for t in ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must contain ints >= 0, got {t!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0`` (argmax decoding)."""
        return self.temperature == 0

    @property
    def truncated(self) -> bool:
        """True when sampling is random and min-p, top-k or top-p removes tokens (a kept set is
        then recorded for every sampled token)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


@dataclass(frozen=True)
class GenerationOutput:
    """One finished generation: a single engine request, or a multi-segment one (a tool episode:
    action segments from the engine with observations between them), built with
    :meth:`extend` and :meth:`observe` so the tokens the model generated are kept exactly
    (token in, token out: the history is never re-tokenised).

    Attributes:
        prompt_ids: The prompt token ids, length ``P``.
        token_ids: Generated token ids, length ``R`` (the eos / stop token is included when it
            was generated; observations included in a multi-segment output).
        logprobs: ``log pi_behav`` of each generated token (natural log, length ``R``) under the
            distribution actually sampled from (temperature, then min-p / top-k / top-p
            truncation and renormalisation over the kept set; greedy: ``log_softmax`` of the
            logits at ``T = 1``); 0.0 on observation tokens.
        versions: Policy version that produced each generated token, length ``R``
            (non-decreasing; several values when weights were updated mid-request); an
            observation gets the version of the action token before it.
        finish_reason: ``"stop"`` (eos, stop token or stop string), ``"length"``
            (``max_new_tokens`` or the model's context length) or ``"abort"`` (engine stopped
            or the request aborted); of the last segment in a multi-segment output.
        text: Decoded response (special tokens skipped).
        num_interruptions: Number of weight updates applied while this request (any segment)
            was in the running batch (each one dropped its KV cache and re-encoded it).
        sampling_mask: The kept set of every generated token (length ``R``,
            :class:`~conveyor.types.SamplingMask`) when the request's sampling truncates
            (:attr:`SamplingParams.truncated`); None otherwise (full vocabulary). Observations
            have no set.
        key: The engine request's key, ``"<engine id>:<request id>"``, unique across engines,
            processes and resumes (old-log-prob patches are addressed by it:
            :mod:`conveyor.rollout.old_logprobs`); ``""`` when the engine has none, and for a
            multi-segment output (see ``request_spans``).
        action_mask: 1 for tokens the policy generated, 0 for observations (length ``R``);
            None when every token is an action.
        tool_calls: Observations inserted.
        request_spans: ``(key, offset, n)`` of each engine request in a multi-segment output:
            its ``n`` tokens are ``token_ids[offset : offset + n]``; empty for a single request
            (:meth:`spans` gives ``[(key, 0, R)]`` then).
    """

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = FINISH_LENGTH
    text: str = ""
    num_interruptions: int = 0
    sampling_mask: SamplingMask | None = None
    key: str = ""
    action_mask: list[int] | None = None
    tool_calls: int = 0
    request_spans: tuple[tuple[str, int, int], ...] = ()

    def spans(self) -> list[tuple[str, int, int]]:
        """``(key, offset, n)`` of every engine request in this output (empty when the engine
        gave no keys)."""
        if self.request_spans:
            return list(self.request_spans)
        return [(self.key, 0, len(self.token_ids))] if self.key and self.token_ids else []

    def extend(self, seg: GenerationOutput) -> GenerationOutput:
        """This output followed by the engine's next segment ``seg`` (a new object).

        Raises:
            ValueError: ``seg.prompt_ids`` is not ``prompt_ids + token_ids`` (the segment was
                not generated from this history, token for token).
        """
        if list(seg.prompt_ids) != list(self.prompt_ids) + list(self.token_ids):
            raise ValueError("GenerationOutput.extend: the segment's prompt_ids are not this output's "
                             "prompt_ids + token_ids (a re-tokenised history?)")
        r, n = len(self.token_ids), len(seg.token_ids)
        parts = [self.sampling_mask if self.sampling_mask is not None else r,
                 seg.sampling_mask if seg.sampling_mask is not None else n]
        return replace(
            self, token_ids=self.token_ids + list(seg.token_ids), logprobs=self.logprobs + list(seg.logprobs),
            versions=self.versions + list(seg.versions), finish_reason=seg.finish_reason,
            num_interruptions=self.num_interruptions + seg.num_interruptions,
            sampling_mask=SamplingMask.concat(parts), key="",
            action_mask=self._actions() + [1] * n,
            request_spans=tuple(self.spans()) + tuple((k, r + o, m) for k, o, m in seg.spans()),
        )

    def observe(self, ids: list[int], version: int) -> GenerationOutput:
        """This output followed by the observation tokens ``ids`` (a new object): behaviour
        log-prob 0.0, action mask 0, no kept set, policy version ``version``; counts one tool
        call."""
        r, n = len(self.token_ids), len(ids)
        parts = [self.sampling_mask if self.sampling_mask is not None else r, n]
        return replace(
            self, token_ids=self.token_ids + list(ids), logprobs=self.logprobs + [0.0] * n,
            versions=self.versions + [version] * n, sampling_mask=SamplingMask.concat(parts), key="",
            action_mask=self._actions() + [0] * n, tool_calls=self.tool_calls + 1,
            request_spans=tuple(self.spans()),
        )

    def _actions(self) -> list[int]:
        return list(self.action_mask) if self.action_mask is not None else [1] * len(self.token_ids)


@dataclass(frozen=True)
class PartialRequest:
    """A request's state at a pause, for partial-rollout sync (MISSION.md section 2, recovery 3):
    copies, nothing shared with the engine.

    Attributes:
        rid: Request id. prompt_ids / token_ids / versions: copies (``R`` generated tokens).
        key: The request's key (``GenerationOutput.key``): old-log-prob patches of these tokens
            are addressed by it (:class:`~conveyor.rollout.old_logprobs.OldLogprobPatch`).
        finished: True for a request that finished since the previous call.
        sampling_mask: The kept sets of ``token_ids`` (length ``R``) under truncated sampling,
            None otherwise; scoring renormalises over them like the trainer.
    """

    rid: int
    prompt_ids: list[int]
    token_ids: list[int]
    versions: list[int]
    key: str
    finished: bool
    sampling_mask: SamplingMask | None = None


class PromptTooLongError(ValueError):
    """A prompt fills the model's context (``len(prompt) >= max_position_embeddings``): nothing
    can be generated. Retrying cannot help; the rollout controller skips such a sample."""
