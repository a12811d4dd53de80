"""A maths agent written against the ``openai`` client, trained and evaluated by conveyor unchanged.

It solves one MAWPS question (any maths data set works): it asks the model through
``client.chat.completions.create`` with one tool, runs the tool when the model calls it, sends the
result back as a ``tool`` message, and grades the final answer with conveyor's grading
(``run.grade``: ``reward.fn`` in the reward service, "Answer: <number>" as the data set's
instruction asks). Nothing in it handles tokens: conveyor records every call on its
OpenAI-compatible endpoint and trains on exactly the tokens the model generated
(``conveyor.rollout.openai_agent``).

    pip install -e ".[openai]"
    PYTHONPATH=examples/openai_agent conveyor train env.name=openai:mawps_agent:solve
    PYTHONPATH=examples/openai_agent conveyor eval --model smollm2-135m-instruct \\
        --env openai:mawps_agent:solve --dataset mawps:singleop:heldout --n 50

Options (``env.options.*`` / ``--env-option``): ``tool`` (``calculator``, the default; ``python``,
conveyor's bubblewrap sandbox; ``none``), ``max_calls`` (model calls per question, default 3).
An unknown tool, ``tool=python`` without a working sandbox or a bad ``max_calls`` is refused at
start-up (``check_options``, which conveyor calls once before the run).
``solve_sync`` is the same agent with the synchronous client (conveyor runs it in a worker thread;
it names its session with the ``X-Session-Id`` header instead of the URL).
"""

from __future__ import annotations

import asyncio

from openai import AsyncOpenAI, OpenAI

from conveyor.envs.sandbox import SandboxUnavailable, check_sandbox
from conveyor.envs.tools import ToolRegistry, make_tool

_REGISTRIES: dict[str, ToolRegistry] = {}  # one tool object per process (the sandbox's concurrency limit)


def _registry(tool: str) -> ToolRegistry | None:
    if tool == "none":
        return None
    if tool not in _REGISTRIES:
        _REGISTRIES[tool] = ToolRegistry([make_tool(tool)])
    return _REGISTRIES[tool]


def _first_message(run) -> dict:
    return {"role": "user", "content": f"{run.sample.question}\n\n{run.instruction}".strip()}


async def solve(run, *, tool: str = "calculator", max_calls: int = 3):
    """One episode: at most ``max_calls`` model calls, then the graded final answer (the
    conveyor ``AgentResult`` of ``run.grade``)."""
    registry = _registry(tool)
    extra = {"tools": registry.schemas()} if registry else {}
    messages = [_first_message(run)]
    answer = ""
    async with AsyncOpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0) as client:
        for _ in range(max_calls):
            resp = await client.chat.completions.create(model=run.model, messages=messages, **extra)
            msg = resp.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))  # the answer as returned: the history stays exact
            answer = msg.content or ""
            if not msg.tool_calls or resp.choices[0].finish_reason == "length":
                break
            for call in msg.tool_calls:
                result = await registry.call(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result.observation})
    return await run.grade(answer)


def solve_sync(run, *, tool: str = "calculator", max_calls: int = 3):
    """:func:`solve` with ``openai.OpenAI`` (blocking; conveyor runs it in a worker thread)."""
    registry = _registry(tool)
    extra = {"tools": registry.schemas()} if registry else {}
    messages = [_first_message(run)]
    answer = ""
    with OpenAI(base_url=run.server_url, api_key=run.api_key, default_headers=run.headers, max_retries=0) as client:
        for _ in range(max_calls):
            resp = client.chat.completions.create(model=run.model, messages=messages, **extra)
            msg = resp.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            answer = msg.content or ""
            if not msg.tool_calls or resp.choices[0].finish_reason == "length":
                break
            for call in msg.tool_calls:
                result = asyncio.run(registry.call(call.function.name, call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result.observation})
    return run.grade_sync(answer)


def check_options(*, tool: str = "calculator", max_calls: int = 3) -> None:
    """Refuse options :func:`solve` cannot work with; conveyor calls this once at start-up (the
    agent's ``check_options`` attribute, ``conveyor.rollout.openai_agent.check_agent``), so a typo
    is an error before the run begins instead of every episode failing.

    Raises:
        ValueError: ``max_calls`` is not an int >= 1; ``tool`` is not ``none`` nor a tool conveyor
            can build (``conveyor.envs.tools.make_tool``); ``tool=python`` where the sandbox cannot
            run (e.g. bubblewrap missing: the install advice).
    """
    if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
        raise ValueError(f"max_calls must be an int >= 1, got {max_calls!r}")
    if tool == "none":
        return
    try:
        make_tool(tool)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"tool={tool!r}: {exc} (or none)") from exc
    if tool == "python":
        try:
            asyncio.run(check_sandbox())
        except SandboxUnavailable as exc:
            raise ValueError(f"tool=python needs the Python sandbox: {exc}") from exc


solve.check_options = check_options
solve_sync.check_options = check_options
