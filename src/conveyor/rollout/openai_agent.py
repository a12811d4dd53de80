"""Agent code written against the ``openai`` client as a rollout workflow (issue 14, section 4).

``env.name=openai:package.module:fn`` selects :class:`OpenAIAgentWorkflow`: for each of
``rollout.group_size`` episodes per sample it opens a *session* on conveyor's in-process
OpenAI-compatible endpoint (:mod:`conveyor.rollout.openai_server`, one server per process,
127.0.0.1, an ephemeral port and a random API key by default), calls the agent function with an
:class:`AgentRun` (base URL, API key, session id, the sample, a grader), awaits its reward, and
builds the episode's :class:`~conveyor.types.Trajectory` from the calls the session recorded:
the first call's prompt, then every generated token as sampled (log-probs and per-token policy
versions from the engine) with the new messages of later calls between them as observation
tokens (action mask 0). The agent never handles tokens.

The agent function (a module attribute, loaded like ``reward.fn``)::

    async def solve(run: AgentRun, **env.options) -> float | AgentResult | dict
        client = openai.AsyncOpenAI(base_url=run.base_url, api_key=run.api_key)
        ... any number of client.chat.completions.create(...) / client.completions.create(...)
        return await run.grade(final_text)      # conveyor's grading -> AgentResult

A plain ``def`` function runs in a worker thread (use ``openai.OpenAI`` and
:meth:`AgentRun.grade_sync` there); an ``async def`` one runs on the episode's event loop and must
use ``openai.AsyncOpenAI`` (a blocking call there would stall every episode). It returns the
episode's reward: a number, an :class:`AgentResult`, or a dict of its fields.

The calls of one session must form one conversation (each call extends the previous one:
:mod:`conveyor.rollout.openai_server`, "Token exactness"); a call that rewrites history is refused
and the episode fails with :class:`OpenAISessionError`, even when the agent catches the refusal.
Limits: ``env.max_turns`` model calls and ``env.max_episode_tokens`` response tokens per episode
(a call past them gets an empty ``finish_reason="length"`` answer, the episode counts as cut).
The sampling settings are the run's, whatever a request says.

The outcome reward sits on the last action token (``turn_rewards`` None). Trajectory metadata,
read by the run's agent metrics and ``conveyor eval --env``: ``turns`` (model calls),
``tool_calls`` (observations appended), ``env_done`` (False: a limit cut the episode),
``env_info`` (:attr:`AgentResult.info`), ``env_stats`` (``tool_calls``: turns that wrote a
``<tool_call>``, ``tool_calls_ok``: those whose calls were well-formed and returned as OpenAI
``tool_calls``, plus :attr:`AgentResult.stats`), ``format_ok``, ``reward_failed``,
``reward_error``, ``request_spans`` (old-log-prob patches), ``num_interruptions``,
``session_id``, ``openai_calls`` (one summary per call) and ``sampling_ignored``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conveyor.rollout.agent import run_group
from conveyor.rollout.engine import SamplingParams
from conveyor.rollout.openai_server import (
    ChatTemplate,
    OpenAIServer,
    Session,
    acquire_server,
    release_server,
)
from conveyor.types import Sample, Trajectory

log = logging.getLogger("conveyor.rollout.openai_agent")

__all__ = ["OPENAI_PREFIX", "AgentResult", "AgentRun", "OpenAIAgentWorkflow", "OpenAISessionError",
           "check_agent", "is_openai_agent", "load_agent"]

OPENAI_PREFIX = "openai:"
"""``env.name`` values starting with it name an OpenAI-client agent: ``openai:package.module:fn``."""


def is_openai_agent(name: str | None) -> bool:
    """Whether ``env.name`` selects an OpenAI-client agent."""
    return isinstance(name, str) and name.startswith(OPENAI_PREFIX)


class OpenAISessionError(RuntimeError):
    """An episode's calls could not be assembled into one trajectory (a refused call, no call)."""


@dataclass
class AgentResult:
    """What an agent returns for its episode.

    Attributes:
        reward: The episode's reward (finite).
        correct: Whether the answer was right (the run's accuracy), None when unknown.
        format_ok: Whether the answer was well-formatted, None when unknown.
        info: Free-form extras (``reward_failed`` / ``reward_error`` are lifted into the
            trajectory's metadata), copied to ``metadata["env_info"]``.
        stats: Counters merged into ``metadata["env_stats"]`` (e.g. ``{"tool_calls_ok": 2}``
            when the agent knows which of its tool runs succeeded).
    """

    reward: float
    correct: bool | None = None
    format_ok: bool | None = None
    info: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)


def _as_result(value: Any, spec: str) -> AgentResult:
    """An agent's return value -> :class:`AgentResult`.

    Raises:
        TypeError: not a number, an AgentResult or a dict of its fields.
        ValueError: a non-finite reward.
    """
    if isinstance(value, dict):
        unknown = set(value) - {"reward", "correct", "format_ok", "info", "stats"}
        if unknown or "reward" not in value:
            raise TypeError(f"env.name={spec}: the agent returned a dict with keys {sorted(value)}; it needs 'reward' "
                            "and may have correct, format_ok, info, stats")
        value = AgentResult(**value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        value = AgentResult(float(value))
    if not isinstance(value, AgentResult):
        raise TypeError(f"env.name={spec}: the agent returned a {type(value).__name__}; return its reward (a number, "
                        "an AgentResult or a dict with 'reward')")
    if not isinstance(value.reward, int | float) or not math.isfinite(value.reward):
        raise ValueError(f"env.name={spec}: the agent's reward must be a finite number, got {value.reward!r}")
    return value


@dataclass
class AgentRun:
    """What an agent function is handed for one episode.

    Attributes:
        base_url: ``http://127.0.0.1:<port>/sessions/<session_id>/v1``: the ``openai`` client's
            ``base_url``; every call through it belongs to this episode.
        server_url: ``http://127.0.0.1:<port>/v1``: the same endpoint without the session in the
            path (then send :attr:`headers` or ``user=session_id``).
        api_key: The ``openai`` client's ``api_key``.
        session_id: This episode's session.
        model: A model name to pass (any name is accepted).
        sample: The data-set sample (``question``, ``answer``, ``id``, ``metadata``).
        instruction: The run's answer instruction (``data.instruction``, e.g. "Give the final
            answer as a number after 'Answer:'."), what :meth:`grade` expects.
    """

    base_url: str
    server_url: str
    api_key: str
    session_id: str
    model: str
    sample: Sample
    instruction: str = ""
    _reward_service: Any = field(default=None, repr=False)

    @property
    def headers(self) -> dict[str, str]:
        """``{"X-Session-Id": session_id}`` (for :attr:`server_url`, e.g. as the client's
        ``default_headers``)."""
        return {"X-Session-Id": self.session_id}

    async def grade(self, text: str) -> AgentResult:
        """Grade a final answer with the run's grading (``reward.fn`` in the reward service's
        worker processes, with its timeout; :mod:`conveyor.rewards`).

        Returns:
            ``AgentResult(reward, correct, format_ok, info={"reward_failed", "reward_error"})``.

        Raises:
            RuntimeError: no reward service (the start-up check's dry run).
        """
        if self._reward_service is None:
            raise RuntimeError("AgentRun.grade: this run has no reward service")
        return self._result(await self._reward_service.score(text, self.sample))

    def grade_sync(self, text: str) -> AgentResult:
        """:meth:`grade` for a synchronous agent (blocks its worker thread)."""
        if self._reward_service is None:
            raise RuntimeError("AgentRun.grade_sync: this run has no reward service")
        return self._result(self._reward_service.score_sync(text, self.sample))

    @staticmethod
    def _result(r) -> AgentResult:
        correct, fmt = r.metrics.get("correct"), r.metrics.get("format_ok")
        return AgentResult(float(r.score), None if correct is None else correct >= 1.0,
                           None if fmt is None else fmt >= 1.0,
                           info={"reward_failed": r.failed, "reward_error": r.error})


def load_agent(spec: str) -> Callable[..., Any]:
    """The agent function named by ``openai:package.module:fn``.

    Raises:
        ValueError: not of that form, the module cannot be imported, no such attribute, or not
            callable (the message names ``env.name``).
    """
    rest = spec[len(OPENAI_PREFIX):] if is_openai_agent(spec) else spec
    module_name, sep, attr = rest.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise ValueError(f"env.name={spec!r}: an OpenAI-client agent is named 'openai:package.module:function'")
    from conveyor.envs.registry import import_callable

    return import_callable(spec, module_name, attr, "a function")


def check_agent(fn: Callable[..., Any], options: dict[str, Any], spec: str) -> None:
    """Refuse ``env.options`` the agent function does not take (it is called ``fn(run,
    **options)``), and those its own check refuses: an agent function may carry a
    ``check_options`` attribute, a callable taking the same keyword options that raises
    ``ValueError`` / ``TypeError`` for values it cannot work with (an unknown tool name, a tool
    this machine cannot run); it is called once here, before the run directory is made, so a
    bad value is a start-up error rather than every episode failing.

    Raises:
        ValueError: the options do not bind, or ``check_options`` refused them (the message
            names them and the agent's reason).
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        try:
            sig.bind(None, **options)
        except TypeError as exc:
            raise ValueError(f"env.options {options} do not fit env.name={spec} (called as fn(run, "
                             f"**env.options)): {exc}") from exc
    check = getattr(fn, "check_options", None)
    if callable(check):
        try:
            check(**options)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"env.options {options}: env.name={spec} refuses them: {exc}") from exc


def _is_async(fn: Callable) -> bool:
    call = type(fn).__call__ if not inspect.isfunction(fn) and not inspect.ismethod(fn) else None
    return inspect.iscoroutinefunction(fn) or (call is not None and inspect.iscoroutinefunction(call))


class OpenAIAgentWorkflow:
    """Runs OpenAI-client agents as episodes (module docstring).

    Args:
        tokenizer: The policy's tokenizer (chat template).
        agent: The agent function (:func:`load_agent`).
        params: The run's sampling parameters (``max_new_tokens`` per call at most).
        reward_service: Grades answers (:meth:`AgentRun.grade`); None: grading raises.
        group_size: Episodes per sample (>= 1), each its own session.
        max_turns: Model calls per episode at most (>= 1).
        max_total_tokens: Response tokens (actions and observations) per episode at most.
        instruction: The answer instruction handed to the agent.
        options: Keyword arguments of every agent call (``env.options``).
        host, port, api_key: The endpoint's (:func:`~conveyor.rollout.openai_server.acquire_server`;
            api_key None: a random one per server).
        model_name: The model name the endpoint reports.
        spec: ``env.name``, for messages.

    The server is acquired at the first episode and released by :meth:`close` (idempotent).

    Raises:
        ValueError: a limit < 1, options the agent does not take, a tokenizer without a chat
            template.
    """

    def __init__(self, tokenizer, agent: Callable[..., Any], params: SamplingParams, *, reward_service=None,
                 group_size: int = 1, max_turns: int = 4, max_total_tokens: int = 512, instruction: str = "",
                 options: dict[str, Any] | None = None, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, model_name: str = "conveyor", spec: str = "openai:agent"):
        for name, v in (("group_size", group_size), ("max_turns", max_turns), ("max_total_tokens", max_total_tokens)):
            if int(v) < 1:
                raise ValueError(f"OpenAIAgentWorkflow: {name} must be >= 1, got {v}")
        self.options = dict(options or {})
        check_agent(agent, self.options, spec)
        self.template = ChatTemplate(tokenizer)
        self.tokenizer, self.agent, self.params = tokenizer, agent, params
        self.reward_service, self.instruction, self.spec = reward_service, instruction, spec
        self.group_size, self.max_turns, self.max_total_tokens = group_size, max_turns, max_total_tokens
        self._server_args = dict(host=host, port=port, api_key=api_key, model_name=model_name)
        self._server: OpenAIServer | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._warned: set[str] = set()
        self._closed = False
        for name in ("httpx", "httpx2", "openai"):  # the agent's client would log every call at INFO
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)

    @classmethod
    def from_settings(cls, settings, *, tokenizer, params: SamplingParams, reward_service, group_size: int,
                      instruction: str = "") -> OpenAIAgentWorkflow:
        """The workflow of an ``env`` config section (:class:`conveyor.config.EnvConfig`) whose
        ``name`` is ``openai:package.module:fn``: ``env.options`` are the agent's keyword
        arguments, ``env.max_turns`` / ``env.max_episode_tokens`` the limits, ``env.openai.*``
        the endpoint's address and key.

        Raises:
            ValueError: as :func:`load_agent` / :func:`check_agent`.
        """
        o = settings.openai
        return cls(tokenizer, load_agent(settings.name), params, reward_service=reward_service,
                   group_size=group_size, max_turns=settings.max_turns, max_total_tokens=settings.max_episode_tokens,
                   instruction=instruction, options=dict(settings.options or {}), host=o.host, port=o.port,
                   api_key=o.api_key, spec=settings.name)

    @property
    def server(self) -> OpenAIServer:
        """The endpoint (acquired on first use)."""
        if self._server is None:
            if self._closed:
                raise RuntimeError("OpenAIAgentWorkflow: closed")
            self._server = acquire_server(**self._server_args)
        return self._server

    def close(self) -> None:
        """Release the endpoint and the worker threads of synchronous agents (idempotent)."""
        self._closed = True
        if self._server is not None:
            release_server(self._server)
            self._server = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def run_episode(self, engine, sample: Sample) -> list[Trajectory] | None:
        """``group_size`` agent episodes on ``sample``; None when the engine stopped during any.

        Raises:
            PromptTooLongError: a first call's prompt fills the context (the controller skips
                the sample).
            OpenAISessionError: a refused call, or an agent that made no call.
            Whatever the agent raises (the controller counts a failed episode).
        """
        results = await run_group(self._one(engine, sample) for _ in range(self.group_size))
        if any(r is None for r in results):
            return None
        group_id = f"{sample.id}#{uuid.uuid4().hex[:12]}"
        return [self._trajectory(sample, group_id, *r) for r in results]

    async def _one(self, engine, sample: Sample):
        server = self.server
        sid = uuid.uuid4().hex
        session = Session(sid, engine, self.template, self.params, max_calls=self.max_turns,
                          max_total_tokens=self.max_total_tokens, model_name=server.model_name)
        run = AgentRun(base_url=f"{server.url}/sessions/{sid}/v1", server_url=f"{server.url}/v1",
                       api_key=server.api_key or "none", session_id=sid, model=server.model_name, sample=sample,
                       instruction=self.instruction, _reward_service=self.reward_service)
        server.open_session(session)
        failure: BaseException | None = None
        value = None
        try:
            value = await self._call_agent(run)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - decided below, after the session's own state
            failure = e
        finally:
            server.close_session(sid)  # new calls: 404
            await session.aclose()  # a call in flight finishes first
        if session.prompt_too_long is not None:
            raise session.prompt_too_long
        if session.aborted:
            return None
        if session.refused is not None:
            raise OpenAISessionError(f"env.name={self.spec}: episode {sample.id}: a call was refused: "
                                     f"{session.refused}") from failure
        if failure is not None:
            raise failure
        if session.out is None:
            raise OpenAISessionError(f"env.name={self.spec}: the agent returned without calling the endpoint for "
                                     f"{sample.id} (nothing to train on); it must use run.base_url")
        for k in session.sampling_ignored:
            if k not in self._warned:
                self._warned.add(k)
                log.warning("env.name=%s: the agent set %s=%r; ignored (episodes sample with the run's settings, "
                            "which the trainer's log-probs assume)", self.spec, k, session.sampling_ignored[k])
        return session, _as_result(value, self.spec)

    async def _call_agent(self, run: AgentRun):
        if _is_async(self.agent):
            return await self.agent(run, **self.options)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="conveyor-agent")
        loop = asyncio.get_running_loop()
        value = await loop.run_in_executor(self._executor, functools.partial(self.agent, run, **self.options))
        if inspect.isawaitable(value):  # a sync function that returned a coroutine
            value = await value
        return value

    def _trajectory(self, sample: Sample, group_id: str, session: Session, res: AgentResult) -> Trajectory:
        out = session.out
        stats = {"tool_calls": session.tool_turns, "tool_calls_ok": session.tool_turns_ok, **res.stats}
        metadata = {
            "turns": session.turns, "tool_calls": out.tool_calls, "env_done": not session.cut,
            "env_info": dict(res.info), "env_stats": stats,
            "num_interruptions": out.num_interruptions, "request_spans": [list(sp) for sp in out.spans()],
            "format_ok": res.format_ok, "reward_failed": bool(res.info.get("reward_failed", False)),
            "reward_error": res.info.get("reward_error"), "session_id": session.session_id,
            "openai_calls": list(session.calls), "sampling_ignored": dict(session.sampling_ignored),
        }
        return Trajectory(
            sample=sample, group_id=group_id, prompt_ids=list(out.prompt_ids), response_ids=list(out.token_ids),
            behaviour_logprobs=list(out.logprobs), versions=list(out.versions), reward=float(res.reward),
            correct=res.correct, finish_reason="length" if session.cut else out.finish_reason,
            text=self.tokenizer.decode(out.token_ids, skip_special_tokens=True),
            action_mask=list(out.action_mask) if out.action_mask is not None else None,
            sampling_mask=out.sampling_mask, turn_rewards=None, metadata=metadata,
        )
