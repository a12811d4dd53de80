"""Tools an agent can call: the protocol, the result of a call, a registry, the calculator.

A tool is described to the model the way chat templates and the OpenAI API expect it, so the
same description works for both:

* :meth:`ToolRegistry.schemas` returns the OpenAI *function tool* shape, one entry per tool::

      {"type": "function",
       "function": {"name": "python", "description": "...",
                    "parameters": {"type": "object", "properties": {...}, "required": [...]}}}

  ``parameters`` is a JSON Schema object (source: the ``tools`` parameter of the OpenAI Chat
  Completions API, https://platform.openai.com/docs/api-reference/chat/create, and its
  function-calling guide https://platform.openai.com/docs/guides/function-calling).
* The list is what Hugging Face chat templates take as their ``tools`` argument:
  ``tokenizer.apply_chat_template(messages, tools=registry.schemas(), ...)`` (transformers'
  chat-templating guide, "Tool use / function calling"; ``transformers.utils.get_json_schema``
  produces the same shape from a Python function). Qwen2.5 / Qwen3 templates render each entry
  as JSON inside ``<tools></tools>`` in the system prompt and expect the model to answer with
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; Llama 3.1 / 3.2 templates put
  the JSON list in the first user message and expect ``{"name": ..., "parameters": {...}}``.
  Parsing those calls out of generated text belongs to the agent workflow, not to this module:
  a tool only ever sees the decoded ``arguments`` (a dict, or its JSON text).

A tool's :meth:`Tool.call` never raises for anything the model can do: bad arguments, a failing
computation or a contained sandbox incident all come back as a :class:`ToolResult` whose
``observation`` is the text the model reads next (``"Error: ..."`` on failure).
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one tool call.

    Attributes:
        observation: The text returned to the model (the result, or ``"Error: ..."``).
        ok: True when the call did what was asked (valid arguments, the computation succeeded,
            no incident); False otherwise.
        incident: For sandboxed tools, the kind of limit or attack that was contained
            (:data:`conveyor.envs.sandbox.INCIDENT_KINDS`: ``"timeout"``, ``"cpu_limit"``,
            ``"memory"``, ``"output_limit"``, ``"fork_limit"``, ``"killed"``,
            ``"sandbox_error"``); None when nothing was contained.
        elapsed_s: Wall-clock seconds the call took (0.0 when the tool does not measure it).
    """

    observation: str
    ok: bool
    incident: str | None = None
    elapsed_s: float = 0.0


@runtime_checkable
class Tool(Protocol):
    """What the agent workflow needs from a tool.

    Attributes:
        name: The function name the model calls (``[A-Za-z0-9_-]``, 1 to 64 characters, as the
            OpenAI API requires).
        description: One or two sentences telling the model what the tool does and returns.
        parameters: JSON Schema (an ``{"type": "object", ...}`` dict) of the call's arguments,
            the ``function.parameters`` of the OpenAI tools shape (module docstring).
    """

    name: str
    description: str
    parameters: dict[str, Any]

    async def call(self, arguments: Mapping[str, Any]) -> ToolResult:
        """Run the tool on decoded arguments.

        Args:
            arguments: The call's arguments (already decoded from JSON).

        Returns:
            A :class:`ToolResult`; model mistakes are reported in it, never raised.
        """
        ...


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI function-tool entry of ``tool``.

    Args:
        tool: Any :class:`Tool`.

    Returns:
        ``{"type": "function", "function": {"name", "description", "parameters"}}`` (a new dict;
        ``parameters`` is the tool's own dict, not a copy).
    """
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        },
    }


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def check_arguments(parameters: Mapping[str, Any], arguments: Mapping[str, Any]) -> str | None:
    """A light check of ``arguments`` against a tool's ``parameters`` schema.

    Checks what the tools here rely on: the arguments form an object, every ``required``
    property is present, no property outside ``properties`` appears when
    ``additionalProperties`` is false, and each property given has its declared primitive
    ``type`` (``string``, ``integer``, ``number``, ``boolean``, ``object``, ``array``, ``null``;
    ``true`` / ``false`` are not integers). Nested schemas are not checked.

    Args:
        parameters: The tool's JSON Schema object.
        arguments: The decoded arguments.

    Returns:
        None when the arguments pass, else a one-line message for the model (without the
        ``"Error: "`` prefix).
    """
    if not isinstance(arguments, Mapping):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    props: Mapping[str, Any] = parameters.get("properties", {}) or {}
    missing = [k for k in parameters.get("required", ()) if k not in arguments]
    if missing:
        return "missing argument(s): " + ", ".join(repr(k) for k in missing)
    if parameters.get("additionalProperties") is False:
        extra = [k for k in arguments if k not in props]
        if extra:
            return "unknown argument(s): " + ", ".join(repr(k) for k in extra)
    for key, value in arguments.items():
        declared = (props.get(key) or {}).get("type")
        if declared is None:
            continue
        names = [declared] if isinstance(declared, str) else list(declared)
        ok = False
        for tname in names:
            types = _JSON_TYPES.get(tname)
            if types is None:
                ok = True  # a type this light check does not know: accept
            elif isinstance(value, types) and not (
                isinstance(value, bool) and tname in ("integer", "number")
            ):
                ok = True
        if not ok:
            return f"argument {key!r} must be of type {'/'.join(names)}, got {type(value).__name__}"
    return None


class ToolRegistry:
    """The tools of an environment, by name.

    Args:
        tools: Tools to register (in the order :meth:`schemas` lists them).

    Raises:
        ValueError: If a name is invalid or given twice (see :meth:`register`).
        TypeError: If an object is not a :class:`Tool`.
    """

    def __init__(self, tools: Iterable[Tool] = ()):
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        """Add a tool.

        Args:
            tool: The tool; its name must be new to this registry.

        Raises:
            TypeError: If ``tool`` lacks the :class:`Tool` attributes or ``call``.
            ValueError: If its name is not 1 to 64 characters of ``[A-Za-z0-9_-]`` or is taken,
                or its ``parameters`` is not a JSON Schema object (a dict with
                ``"type": "object"``).
        """
        if not isinstance(tool, Tool):
            raise TypeError(f"{tool!r} is not a Tool (needs name, description, parameters, call)")
        if not isinstance(tool.name, str) or not _NAME_RE.match(tool.name):
            raise ValueError(f"tool name must match {_NAME_RE.pattern}, got {tool.name!r}")
        if tool.name in self._tools:
            raise ValueError(f"a tool named {tool.name!r} is already registered")
        if not isinstance(tool.parameters, dict) or tool.parameters.get("type") != "object":
            raise ValueError(f"tool {tool.name!r}: parameters must be a JSON Schema object")
        self._tools[tool.name] = tool

    def get(self, name: str) -> Tool:
        """The tool called ``name``.

        Args:
            name: A registered tool name.

        Returns:
            The tool.

        Raises:
            KeyError: If there is none (the message lists the registered names).
        """
        try:
            return self._tools[name]
        except KeyError:
            raise KeyError(
                f"no tool named {name!r}; registered: {', '.join(self._tools) or 'none'}"
            ) from None

    @property
    def names(self) -> list[str]:
        """Registered tool names, in registration order."""
        return list(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def __iter__(self):
        return iter(self._tools.values())

    def schemas(self) -> list[dict[str, Any]]:
        """Every tool in the OpenAI function-tool shape (:func:`tool_schema`), for the OpenAI API's
        ``tools`` field and for ``tokenizer.apply_chat_template(..., tools=...)``."""
        return [tool_schema(t) for t in self._tools.values()]

    async def call(self, name: str, arguments: Mapping[str, Any] | str | None) -> ToolResult:
        """Call a tool the way a model asked for it; never raises for a bad call.

        Args:
            name: The tool name the model wrote.
            arguments: Its arguments: a dict, the JSON text of one (as in OpenAI's
                ``tool_calls[i].function.arguments``), or None / ``""`` for no arguments.

        Returns:
            The tool's :class:`ToolResult`; or ``ok=False`` with an ``"Error: ..."`` observation
            when the tool is unknown, the JSON does not parse, the arguments fail
            :func:`check_arguments`, or the tool itself raised (a bug in the tool: the message
            names the exception, and the episode goes on).
        """
        tool = self._tools.get(name)
        if tool is None:
            return ToolResult(
                f"Error: unknown tool {name!r}; available tools: {', '.join(self._tools) or 'none'}",
                ok=False,
            )
        if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
            arguments = {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                return ToolResult(f"Error: the arguments are not valid JSON ({exc})", ok=False)
        problem = check_arguments(tool.parameters, arguments)
        if problem is not None:
            return ToolResult(f"Error: {problem}", ok=False)
        try:
            return await tool.call(arguments)
        except Exception as exc:  # noqa: BLE001 - a tool bug must not end the episode
            return ToolResult(f"Error: tool {name!r} failed: {type(exc).__name__}: {exc}", ok=False)


class CalculatorTool:
    """The calculator as a tool: exact arithmetic on one expression.

    Wraps :func:`conveyor.rollout.tools.calculate` (numbers, ``+ - * /`` and ``x × ÷``,
    parentheses, thousands separators; evaluated by walking Python's ``ast``, no ``eval``;
    results above 1e12 in magnitude are refused). ``rollout.tools`` is imported on the first
    call, not with this module (it pulls in the engine and torch, ~2.7 s).

    Args:
        name: The tool name (default ``"calculator"``).
    """

    description = (
        "Evaluate one arithmetic expression exactly: numbers, + - * /, parentheses. "
        "Returns the result (integers as integers, otherwise up to 4 decimals)."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "expression": {
                "type": "string",
                "description": 'The expression, e.g. "(12 + 3) * 15 / 4".',
            }
        },
        "required": ["expression"],
        "additionalProperties": False,
    }

    def __init__(self, name: str = "calculator"):
        self.name = name

    async def call(self, arguments: Mapping[str, Any]) -> ToolResult:
        """Evaluate ``arguments["expression"]``.

        Args:
            arguments: ``{"expression": str}``; a trailing ``=`` is ignored.

        Returns:
            ``ok=True`` with the formatted result, or ``ok=False`` with an ``"Error: ..."``
            observation (missing / non-string argument, not arithmetic, division by zero,
            result too large).
        """
        from conveyor.rollout.tools import calculate, format_number

        problem = check_arguments(self.parameters, arguments)
        if problem is not None:
            return ToolResult(f"Error: {problem}", ok=False)
        expr = arguments["expression"].strip().rstrip("=").strip()
        result = calculate(expr)
        if result is None:
            try:  # a bare number is its own value
                result = format_number(float(expr.replace(",", "")))
            except ValueError:
                result = None
        if result is None:
            return ToolResult(
                "Error: not an arithmetic expression I can evaluate (numbers, + - * /, "
                "parentheses; no division by zero; results up to 1e12)",
                ok=False,
            )
        return ToolResult(result, ok=True)


def _python_tool(**kwargs: Any) -> Tool:
    from conveyor.envs.sandbox import PythonTool

    return PythonTool(**kwargs)


BUILTIN_TOOLS: dict[str, Callable[..., Tool]] = {
    "calculator": CalculatorTool,
    "python": _python_tool,
}
"""Factories of the built-in tools by name: ``"calculator"`` (:class:`CalculatorTool`) and
``"python"`` (:class:`conveyor.envs.sandbox.PythonTool`, sandboxed Python; needs bubblewrap)."""


def make_tool(spec: str, **kwargs: Any) -> Tool:
    """Build a tool from a built-in name or an import path.

    Args:
        spec: A key of :data:`BUILTIN_TOOLS`, or ``"package.module:attr"`` naming a tool class
            or factory (called with ``kwargs``) or a ready tool instance (then ``kwargs`` must be
            empty).
        **kwargs: Passed to the factory (e.g. ``config=SandboxConfig(wall_s=5)`` for
            ``"python"``).

    Returns:
        The tool.

    Raises:
        ValueError: If ``spec`` is neither a built-in name nor an importable ``module:attr``, or
            ``kwargs`` are given with a ready instance.
        TypeError: If the result is not a :class:`Tool`.
    """
    if spec in BUILTIN_TOOLS:
        tool = BUILTIN_TOOLS[spec](**kwargs)
    elif ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load tool {spec!r}: {exc}") from exc
        if isinstance(obj, Tool) and not isinstance(obj, type):
            if kwargs:
                raise ValueError(f"{spec!r} is a tool instance; it takes no arguments")
            tool = obj
        else:
            tool = obj(**kwargs)
    else:
        raise ValueError(
            f"unknown tool {spec!r}: use one of {', '.join(BUILTIN_TOOLS)} or 'package.module:attr'"
        )
    if not isinstance(tool, Tool):
        raise TypeError(f"{spec!r} did not give a Tool, got {type(tool).__name__}")
    return tool
