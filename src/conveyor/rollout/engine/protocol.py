"""The :class:`Engine` protocol: exactly what the rest of conveyor calls on an inference engine
today (the runtime, workflows, tools, evaluation, the proximal strategies, the CLI and the
benchmarks), written down so that other implementations (issue 12: an HTTP client, a Ray actor)
have one interface to meet. :class:`~conveyor.rollout.engine.local.InferenceEngine` satisfies it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from conveyor.rollout.engine.types import GenerationOutput, PartialRequest, SamplingParams
from conveyor.sync import WeightUpdate


@runtime_checkable
class Engine(Protocol):
    """What conveyor calls on an inference engine today (one member per use; nothing more).

    Data plane (workflows, tools, evaluation):

    * :meth:`generate` -- ``SingleTurnMathWorkflow.run_episode`` (``rollout/workflow.py``),
      ``generate_with_calculator`` (``rollout/tools.py``), ``eval.evaluate``.

    Control plane (the runtime in ``train.py``, the CLI, benchmarks):

    * :attr:`version` -- ``train.py`` (partial-sync scoring, evaluation labels),
      ``rollout/tools.py`` (version of observation tokens before any action token).
    * :meth:`start` / :meth:`stop` -- ``train.py``, ``cli.py`` (``conveyor eval``), benchmarks.
    * :meth:`pause` / :meth:`resume` -- ``train.py`` (partial-rollout sync around a publish).
    * :meth:`update_weights` -- ``train.py``, ``benchmarks/weight_sync.py``,
      ``benchmarks/behaviour_weight.py``.
    * :meth:`stats` -- ``train.py`` (busy fraction, throughput, ``engine_stats.json`` that
      ``conveyor simulate`` calibrates from), ``benchmarks/weight_sync.py``.

    Old-log-prob scoring (``proximal.method=partial_sync`` / ``dedicated``;
    :mod:`conveyor.runtime.publish`):

    * :meth:`partial_requests` -- copies of the requests with tokens (each with its request
      key; nothing shared), paused for ``partial_sync``, while running for ``dedicated``.
    * ``score_old_logprobs(spec, items, version=None)`` -- an optional capability, not in the
      protocol: the paused engine scores tokens with its own weights and returns old-log-prob
      patches (``InferenceEngine`` has it; only ``partial_sync`` asks for it, and refuses an
      engine without it). No caller reads an engine's model.

    Scheduling: ``generate(prompt_ids, params, priority=p)`` -- an optional capability, not in
    the protocol: an engine whose ``supports_priority`` attribute is true takes a keyword
    ``priority`` (int; its waiting queue serves lower values first, FIFO among equals; vLLM's
    convention). The rollout controller passes each episode's admission sequence
    (``rollout.priority=oldest_first``) to such engines only; others run FIFO.

    Not in the protocol: ``abort`` (``InferenceEngine.abort``, ``HttpEngine.abort``; used by
    the engine server's ``/abort_request``, not by the runtime: :meth:`stop` finishes every
    unfinished request with ``finish_reason="abort"``); ``submit``, ``generate_batch``, ``paused``,
    ``max_batch_size``, ``tokenizer`` and the context manager are ``InferenceEngine``
    conveniences, called only by code that built an ``InferenceEngine`` itself
    (``benchmarks/engine.py``, ``benchmarks/weight_sync.py``, tests).

    ``isinstance(obj, Engine)`` checks that every member exists (``runtime_checkable``), not
    the signatures.
    """

    @property
    def version(self) -> int:
        """Policy version of the weights currently loaded (tokens generated now carry it)."""
        ...

    def start(self) -> None:
        """Start generating (idempotent while running); queued requests then run.

        Raises:
            RuntimeError: the engine previously crashed.
        """
        ...

    def stop(self) -> None:
        """Stop generating; every unfinished request resolves with ``finish_reason="abort"``
        and the tokens it had. Weight updates accepted before the call are still applied.
        Idempotent; :meth:`start` may be called again."""
        ...

    def pause(self) -> None:
        """Stop scheduling forward passes after the current one; returns when it has finished.
        Requests stay (queued or in flight) and weight updates are still applied. Idempotent."""
        ...

    def resume(self) -> None:
        """Resume scheduling after :meth:`pause` (idempotent)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters since construction (a snapshot copy).

        Returns:
            A dict; callers read ``busy_seconds`` (float, s), ``generated_tokens`` (int),
            ``decode_steps`` (int), ``pause_seconds_total`` (float, s), ``reencoded_tokens``
            (int), and, through ``engine_stats.json``, ``decode_profile`` (``{batch size:
            [steps, seconds]}``), ``sample_seconds``, ``prefill_seconds`` and
            ``prefill_tokens``. The full list is in ``InferenceEngine.stats``.
        """
        ...

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None
    ) -> GenerationOutput:
        """Generate one response; awaitable from any asyncio event loop.

        Args:
            prompt_ids: Prompt token ids (length >= 1, chat template already applied).
            params: Sampling parameters (None: ``SamplingParams()``).

        Returns:
            The finished :class:`GenerationOutput` (token ids, behaviour log-probs, per-token
            policy versions, finish reason, kept sets under truncated sampling).

        Raises:
            ValueError: an invalid prompt (``PromptTooLongError`` when it fills the context).
            RuntimeError: the engine is stopped or crashed.
        """
        ...

    def update_weights(
        self, update: WeightUpdate, *, wait: bool = True
    ) -> concurrent.futures.Future:
        """Load new policy weights between two forward passes, interrupting generation.

        Args:
            update: The tensors and their version (must exceed every accepted version).
            wait: Block until applied (default); ``False`` returns at once.

        Returns:
            A :class:`concurrent.futures.Future` resolving to None when the update is applied
            (already done when ``wait``).

        Raises:
            ValueError / KeyError / TypeError: an invalid update (nothing is applied).
        """
        ...

    def partial_requests(self, *, require_pause: bool = True) -> list[PartialRequest]:
        """Requests with generated tokens (in flight and, with ``track_partials``, finished since
        the previous call), for old-log-prob scoring (``partial_sync`` / ``dedicated``).

        Args:
            require_pause: Raise unless the engine is paused (``False``: a consistent snapshot
                taken while it runs, for the dedicated old-logit worker).

        Returns:
            :class:`PartialRequest` copies, each with its request key.

        Raises:
            RuntimeError: ``require_pause`` and the engine is running.
        """
        ...
