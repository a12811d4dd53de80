"""Environments by name: what ``env.name`` selects and how one episode's environment is made
(issue 14, section 3).

``env.name`` (:class:`conveyor.config.EnvConfig`):

* ``none`` (the default): no environment; the single-turn workflow
  (:class:`~conveyor.rollout.workflow.SingleTurnMathWorkflow`) as before.
* ``guess``: :class:`~conveyor.envs.guess.GuessNumberEnv`, guess-the-number with per-turn
  feedback and rewards; ``env.options`` are its arguments (``high``, ``max_guesses``,
  ``shaping``). Its data are the ``guess:`` specs (``data.train`` / ``data.heldout`` default to
  ``guess:train`` / ``guess:heldout`` with this environment); an explicit ``high`` is written into
  them (``guess:train?high=10``, :func:`conveyor.envs.guess.guess_spec_for`: the option wins over
  the spec's default range, a spec with another ``high=`` is an error).
* ``math_python``: :class:`~conveyor.envs.math_python.MathPythonEnv`, maths with the sandboxed
  python tool on any maths data set (``data.train``, default ``mawps:singleop:train``); the
  final answer is graded in the run's reward service; ``env.sandbox.*`` set the sandbox's
  limits, ``env.tool_format`` the call syntax, ``env.max_observation_chars`` the observation cut.
* ``package.module:attr``: a user environment, like ``reward.fn``. ``attr`` is a class or
  function called once per episode (each response of a group gets its own) as
  ``attr(**env.options)``, plus ``context=EnvContext(...)`` when it has a parameter named
  ``context`` (the run's tokenizer, reward service, answer instruction and env settings); it
  must return an :class:`~conveyor.envs.base.Environment`. The module must be importable (install
  it or put its folder on ``PYTHONPATH``).
* ``openai:package.module:fn``: not an environment but agent code written against the ``openai``
  client (:mod:`conveyor.rollout.openai_agent`): ``fn(run, **env.options)`` is called once per
  episode and talks to conveyor's OpenAI-compatible endpoint; its calls become the trajectory.

:func:`check_env` validates all of this before a run starts (import, arguments, the sandbox);
:func:`make_env_factory` builds the ``() -> Environment`` the agent workflow calls per episode;
:func:`build_env_workflow` the episode workflow of any ``env.name`` but ``none``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conveyor.envs.base import Environment

__all__ = ["BUILTIN_ENVS", "ENV_DATA", "EnvContext", "build_env_workflow", "check_env", "load_env_class",
           "make_env_factory", "needs_reward_service", "sandbox_config"]

# the names live in a leaf module so that conveyor.config validates them without importing this one
from conveyor.envs.names import BUILTIN_ENVS, ENV_DATA  # noqa: E402


@dataclass
class EnvContext:
    """What a user environment may need from the run (passed as ``context=`` to a factory that
    declares that parameter).

    Attributes:
        tokenizer: The policy's tokenizer.
        reward_service: The run's :class:`~conveyor.rewards.RewardService` (``score(text,
            sample)`` grades in worker processes with a timeout; never grade in the event loop).
        instruction: The answer instruction (``data.instruction``).
        settings: The ``env`` config section (:class:`conveyor.config.EnvConfig`).
        shared: A dict shared by every episode of the run (e.g. one tool object per run).
    """

    tokenizer: Any
    reward_service: Any
    instruction: str
    settings: Any
    shared: dict[str, Any] = field(default_factory=dict)


def needs_reward_service(settings) -> bool:
    """Whether the environment of ``settings`` grades in a reward service (``guess`` rewards by
    itself; ``math_python`` grades its final answer; a user environment may use
    ``context.reward_service``)."""
    return settings.name not in ("none", "guess")


def sandbox_config(settings):
    """The :class:`~conveyor.envs.sandbox.SandboxConfig` of ``env.sandbox`` (``settings``: an
    :class:`conveyor.config.EnvConfig`)."""
    from conveyor.envs.sandbox import MiB, SandboxConfig

    s = settings.sandbox
    return SandboxConfig(cpu_s=s.cpu_s, wall_s=s.wall_s, memory_bytes=s.memory_mb * MiB,
                         max_processes=s.max_processes, max_output_bytes=s.max_output_kb * 1024,
                         python=s.python, site_packages=tuple(s.site_packages))


def load_env_class(spec: str) -> Callable[..., Environment]:
    """The class or factory named by ``package.module:attr``.

    Raises:
        ValueError: not of that form, the module cannot be imported or has no such attribute,
            or it is not callable (the message names ``env.name``).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"env.name={spec!r}: use none, {', '.join(BUILTIN_ENVS)} or 'package.module:factory'")
    return import_callable(spec, module_name, attr, "a class or function")


def import_callable(spec: str, module_name: str, attr: str, kind: str) -> Callable:
    """``module_name.attr`` imported for ``env.name=spec`` (a user environment or agent).

    Raises:
        ValueError: the module does not import, has no ``attr``, or it is not callable (the
            message names ``env.name`` and says it should be ``kind``).
    """
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        raise ValueError(f"env.name={spec!r}: cannot import module {module_name!r} ({exc}); install it or put its "
                         "folder on PYTHONPATH") from exc
    except AttributeError as exc:
        raise ValueError(f"env.name={spec!r}: module {module_name!r} has no attribute {attr!r}") from exc
    if not callable(obj):
        raise ValueError(f"env.name={spec!r}: {attr!r} is a {type(obj).__name__}, not {kind}")
    return obj


def _takes_context(fn: Callable) -> bool:
    try:
        return "context" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _check_options(fn: Callable, options: dict[str, Any], what: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(**options, **({"context": None} if "context" in sig.parameters else {}))
    except TypeError as exc:
        raise ValueError(f"env.options {options} do not fit {what}: {exc}") from exc


def make_env_factory(settings, *, tokenizer, reward_service, instruction: str = "") -> Callable[[], Environment]:
    """The per-episode environment factory of ``settings`` (module docstring).

    Args:
        settings: The ``env`` config section (:class:`conveyor.config.EnvConfig`), ``name`` not
            ``none``.
        tokenizer: The policy's tokenizer (tool-call format, user context).
        reward_service: The run's reward service (``math_python`` grades in it; user
            environments get it through ``context``).
        instruction: The answer instruction (``data.instruction``).

    Returns:
        ``() -> Environment``, a fresh environment per call. For ``math_python`` one
        :class:`~conveyor.envs.sandbox.PythonTool` is shared by all of them (its
        ``env.sandbox.max_concurrency`` holds across episodes, its counters cover the run).

    Raises:
        ValueError: ``name`` is ``none`` or unknown, options that the environment does not take,
            a user factory that cannot be loaded, a tool-call format that cannot work.
    """
    name = settings.name
    options = dict(settings.options or {})
    if name in (None, "none"):
        raise ValueError("make_env_factory: env.name is none (the single-turn workflow has no environment)")
    if name.startswith("openai:"):
        raise ValueError(f"make_env_factory: env.name={name} is an OpenAI-client agent, not an environment "
                         "(build_env_workflow builds its workflow)")
    if name == "guess":
        from conveyor.envs.guess import GuessNumberEnv

        _check_options(GuessNumberEnv, options, "the guess environment (high, max_guesses, shaping)")
        GuessNumberEnv(**options)  # argument errors now, not in the first episode
        return lambda: GuessNumberEnv(**options)
    if name == "math_python":
        from conveyor.envs.math_python import MathPythonEnv
        from conveyor.envs.sandbox import PythonTool
        from conveyor.envs.tool_calls import resolve_tool_format
        from conveyor.envs.tools import ToolRegistry

        if options:
            raise ValueError(f"env.options {options}: math_python takes none (its settings are env.sandbox.*, "
                             "env.tool_format, env.max_observation_chars)")
        registry = ToolRegistry([PythonTool(sandbox_config(settings), max_concurrency=settings.sandbox.max_concurrency)])
        fmt = resolve_tool_format(settings.tool_format, tokenizer, registry)
        kwargs = dict(reward_service=reward_service, instruction=instruction,
                      max_observation_chars=settings.max_observation_chars)
        MathPythonEnv(registry, fmt, **kwargs)  # argument errors now
        return lambda: MathPythonEnv(registry, fmt, **kwargs)
    factory = load_env_class(name)
    _check_options(factory, options, f"env.name={name}")
    if _takes_context(factory):
        ctx = EnvContext(tokenizer, reward_service, instruction, settings)
        return lambda: _checked(factory(**options, context=ctx), name)
    return lambda: _checked(factory(**options), name)


def _checked(env: Any, name: str) -> Environment:
    if not isinstance(env, Environment):
        raise TypeError(f"env.name={name}: the factory returned a {type(env).__name__}, not an Environment "
                        "(async reset(sample) -> str and async step(action) -> StepResult)")
    return env


def check_env(settings, tokenizer) -> list[str]:
    """Refuse an environment that cannot run, before the run directory exists.

    Checks: the environment loads and takes ``env.options`` (a user factory is imported and
    called once, with ``reward_service=None`` in its context); ``math_python``: the sandbox runs
    ``print(1)`` here (:func:`~conveyor.envs.sandbox.check_sandbox`) and the tool-call format
    resolves for the tokenizer.

    Args:
        settings: The ``env`` config section.
        tokenizer: The policy's tokenizer.

    Returns:
        Notes for the console (e.g. which tool-call format ``auto`` chose).

    Raises:
        ValueError: what cannot work, naming the ``env.*`` key (a
            :class:`~conveyor.envs.sandbox.SandboxUnavailable` becomes a ValueError with its
            advice, e.g. how to install bubblewrap).
    """
    notes: list[str] = []
    name = settings.name
    if name in (None, "none"):
        return notes
    if name.startswith("openai:"):
        from conveyor.envs.tool_calls import template_supports_tools
        from conveyor.rollout.openai_agent import check_agent, load_agent

        fn = load_agent(name)
        check_agent(fn, dict(settings.options or {}), name)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"env.name={name}: the tokenizer has no chat template (the chat endpoint needs one)")
        notes.append(f"env.name={name}: the agent talks to an OpenAI-compatible endpoint on {settings.openai.host} "
                     f"({'a free port' if not settings.openai.port else f'port {settings.openai.port}'}); tool schemas "
                     + ("rendered by the chat template" if template_supports_tools(tokenizer) else
                        "go into a system message (the chat template has no tools branch)"))
        return notes
    if name == "guess":
        make_env_factory(settings, tokenizer=tokenizer, reward_service=None)
    elif name == "math_python":
        import asyncio

        from conveyor.envs.sandbox import PythonTool, SandboxUnavailable, check_sandbox
        from conveyor.envs.tool_calls import resolve_tool_format
        from conveyor.envs.tools import ToolRegistry

        if settings.options:
            raise ValueError(f"env.options {dict(settings.options)}: math_python takes none (its settings are "
                             "env.sandbox.*, env.tool_format, env.max_observation_chars)")
        try:
            asyncio.run(check_sandbox(sandbox_config(settings)))
        except SandboxUnavailable as exc:
            raise ValueError(f"env.name=math_python needs the Python sandbox: {exc}") from exc
        fmt = resolve_tool_format(settings.tool_format, tokenizer, ToolRegistry([PythonTool(sandbox_config(settings))]))
        notes.append(f"env.name=math_python: tool calls in the {fmt.name} format (env.tool_format={settings.tool_format}"
                     f"{'; the chat template renders the tool schemas' if fmt.template_tools else ''})")
    else:
        factory = make_env_factory(settings, tokenizer=tokenizer, reward_service=None)
        try:
            factory()  # imports, binds the options and checks the protocol
        except TypeError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's constructor: name it, keep the cause
            raise ValueError(f"env.name={name}: creating the environment failed: {type(exc).__name__}: {exc}") from exc
    return notes


def build_env_workflow(settings, *, tokenizer, reward_service, params, group_size: int, instruction: str = ""):
    """The episode workflow of ``settings`` (``env.name`` not ``none``): an
    :class:`~conveyor.rollout.openai_agent.OpenAIAgentWorkflow` for ``openai:package.module:fn``,
    else an :class:`~conveyor.rollout.agent.AgentWorkflow` over :func:`make_env_factory`'s
    environments; ``group_size`` episodes per sample, each model turn at most
    ``params.max_new_tokens`` tokens, ``env.max_turns`` turns and ``env.max_episode_tokens``
    response tokens per episode. Callers close a workflow that has ``close`` (the OpenAI
    endpoint).

    Raises:
        ValueError: what :func:`make_env_factory` / the OpenAI workflow raise.
    """
    if settings.name.startswith("openai:"):
        from conveyor.rollout.openai_agent import OpenAIAgentWorkflow

        return OpenAIAgentWorkflow.from_settings(settings, tokenizer=tokenizer, params=params,
                                                 reward_service=reward_service, group_size=group_size,
                                                 instruction=instruction)
    from conveyor.rollout.agent import AgentWorkflow

    make_env = make_env_factory(settings, tokenizer=tokenizer, reward_service=reward_service, instruction=instruction)
    return AgentWorkflow(tokenizer, make_env, params, group_size=group_size, max_turns=settings.max_turns,
                         max_total_tokens=settings.max_episode_tokens)
