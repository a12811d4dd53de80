"""How a model's turn calls a tool: the Hermes / Qwen ``<tool_call>`` format, the fenced-code
fallback for chat templates without tools, and the choice between them (issue 14, section 1).

Two formats; :func:`resolve_tool_format` builds a :class:`ToolCallFormat` for a tokenizer and
a :class:`~conveyor.envs.tools.ToolRegistry`:

* **hermes** (NousResearch's Hermes function calling, the format of Qwen2.5 / Qwen3 chat
  templates): the tool schemas (:meth:`ToolRegistry.schemas`, OpenAI's function-tool shape)
  are rendered by the chat template itself, ``tokenizer.apply_chat_template(messages,
  tools=schemas)``, and a call is a JSON object between tags anywhere in the turn::

      <tool_call>
      {"name": "python", "arguments": {"code": "print(17 * 23)"}}
      </tool_call>

  Parsing follows vLLM's ``Hermes2ProToolParser`` (``vllm/entrypoints/openai/tool_parsers/
  hermes_tool_parser.py``): every ``<tool_call>...</tool_call>`` span, plus an unclosed
  ``<tool_call>`` at the end of the turn (a turn cut by the token limit), each decoded with
  ``json.loads``. ``"arguments"`` may also be a JSON string (as in OpenAI's
  ``tool_calls[i].function.arguments``) and is accepted under Llama 3's name ``"parameters"``.
  The turn stops at ``</tool_call>`` (a stop string), so the model never writes the tool's
  answer itself; the observation is a ``tool`` message, which such templates wrap in
  ``<tool_response></tool_response>``. With a template that has no tools branch (the schemas
  would be silently dropped) the schemas and the call syntax are written into the first user
  message instead, and observations are user messages wrapped in ``<tool_response>`` tags.
* **fenced** (the fallback): a Markdown code block whose info string is ``python`` or ``py`` is a
  call to the python tool (its whole text is ``{"code": ...}``)::

      ```python
      print(17 * 23)
      ```

  The observation is a user message holding a fenced ``output`` block, the convention of
  tool-integrated reasoning (ToRA, arXiv 2309.17452, whose generation stops at the stop word
  ``"```output"``): a turn stops when the model starts
  writing that block itself (stop string ``"```output"``), so it never sees its own invented
  output; otherwise the turn ends at the end-of-turn token. A stop right after the closing
  fence is not possible with substring stops (``"```\\n"`` would also end a turn at a bare
  opening fence). An unclosed block at the end of the turn (cut by the token limit) is run as it
  is (a cut program fails with its own ``SyntaxError``). Blocks with another info string
  (``text``, ``output``, none) are not calls.

``auto`` (the default of ``env.tool_format``) picks **hermes** when the tokenizer's chat
template renders tools (:func:`template_supports_tools`: a probe schema appears in the rendered
prompt), else **fenced**. SmolLM2-135M-Instruct's template has no tools branch (it renders
``<|im_start|>{role}\\n{content}<|im_end|>`` per message and ignores ``tools``), so it gets
fenced code blocks, which small instruction models write far more readily than JSON.

One call per turn: a turn with two or more calls runs none of them, and the observation says
so (``Error: 2 tool calls in one turn; make one call per turn and wait for its result.``).
Every malformed call (invalid JSON, no ``"name"``, arguments that are not an object, an unknown
tool, an empty code block) comes back as a :class:`ToolCall` with ``error`` set, which the
environment shows to the model as ``"Error: ..."`` (:meth:`ToolCallFormat.error_observation`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from conveyor.envs.tools import ToolRegistry

__all__ = [
    "TOOL_FORMATS",
    "ToolCall",
    "ToolCallFormat",
    "parse_fenced_calls",
    "parse_hermes_calls",
    "resolve_tool_format",
    "template_supports_tools",
    "truncate_observation",
]

TOOL_FORMATS: tuple[str, ...] = ("auto", "hermes", "fenced")
"""Accepted values of ``env.tool_format`` (module docstring)."""

ToolFormatName = Literal["hermes", "fenced"]

_HERMES_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
# an opening fence at the start of a line with info string python / py, then the code up to a
# closing fence at the start of a line, or to the end of the turn
_FENCED_RE = re.compile(r"(?:^|\n)[ \t]*```[ \t]*(?:python3?|py)[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)",
                        re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class ToolCall:
    """One tool call read from a model's turn.

    Attributes:
        name: The tool the model named (None when it could not be read).
        arguments: The decoded arguments (a dict; None when they could not be read).
        raw: The call's text as the model wrote it (between the tags / fences).
        error: Why the call cannot be run, a one-line message for the model without the
            ``"Error: "`` prefix; None for a well-formed call (the tool may still reject its
            arguments: :meth:`ToolRegistry.call` checks them against the schema).
    """

    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the call was read completely (``error is None``)."""
        return self.error is None


def _decode_hermes(body: str) -> ToolCall:
    """One ``<tool_call>`` body -> a :class:`ToolCall` (errors in ``error``, never raised)."""
    raw = body.strip()
    if not raw:
        return ToolCall(None, None, raw, 'empty <tool_call>; write {"name": ..., "arguments": {...}} inside it')
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return ToolCall(None, None, raw, f"the tool call is not valid JSON ({exc.msg} at character {exc.pos}); "
                                         'write {"name": ..., "arguments": {...}}')
    if not isinstance(obj, dict):
        return ToolCall(None, None, raw, f'a tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, '
                                         f"got a JSON {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, raw, 'the tool call has no "name" (a string)')
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCall(name, None, raw, f'"arguments" is a string that is not valid JSON ({exc.msg})')
    if not isinstance(args, dict):
        return ToolCall(name, None, raw, f'"arguments" must be a JSON object, got a JSON {type(args).__name__}')
    return ToolCall(name, args, raw)


def parse_hermes_calls(text: str) -> list[ToolCall]:
    """Every Hermes-format tool call in a turn (module docstring), in order.

    Args:
        text: The turn's text (special tokens removed).

    Returns:
        One :class:`ToolCall` per ``<tool_call>`` span (closed, or unclosed at the end of the
        text); malformed ones have ``error`` set. Empty when the turn calls nothing.
    """
    return [_decode_hermes(m.group(1) if m.group(1) is not None else m.group(2))
            for m in _HERMES_RE.finditer(text)]


def parse_fenced_calls(text: str, tool: str = "python") -> list[ToolCall]:
    """Every fenced ```` ```python ```` block of a turn as a call ``tool({"code": block})``
    (module docstring), in order.

    Args:
        text: The turn's text.
        tool: The tool a block calls (its schema must take ``{"code": str}``).

    Returns:
        One :class:`ToolCall` per block (closed, or unclosed at the end of the text); an empty
        block has ``error`` set. Empty when the turn has no python block.
    """
    out = []
    for m in _FENCED_RE.finditer(text):
        code = m.group(1)
        if not code.strip():
            out.append(ToolCall(tool, None, code, "the python code block is empty"))
        else:
            out.append(ToolCall(tool, {"code": code}, code))
    return out


_PROBE_NAME = "conveyor_probe_tool_7f3a"
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": _PROBE_NAME, "description": "probe", "parameters": {"type": "object", "properties": {}}}}]


def template_supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders tool schemas
    (``apply_chat_template(..., tools=...)``).

    A template without a tools branch ignores the argument (transformers passes ``tools`` to
    the Jinja template, which may never read it), so the test is behavioural: a probe schema's
    unique name must appear in the rendered prompt.

    Args:
        tokenizer: A Hugging Face tokenizer.

    Returns:
        True when the probe's name is rendered; False when it is not, when the template raises
        with tools, or when there is no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        return False
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=_PROBE_TOOLS,
                                             tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that fails with tools does not support them
        return False
    return isinstance(text, str) and _PROBE_NAME in text


class ToolCallFormat:
    """How the model calls the tools of a registry, and how their results come back
    (module docstring).

    Args:
        name: ``"hermes"`` or ``"fenced"``.
        registry: The tools offered.
        template_tools: hermes only: the chat template renders the schemas (from
            :func:`template_supports_tools`); False writes them into the first user message.
        fenced_tool: fenced only: the tool a python block calls (default ``"python"``).

    Attributes:
        stop: Stop strings of a model turn (the turn ends right after a call).
        observation_role: The chat role of an observation message (``"tool"`` for hermes
            with a tools-aware template, else ``"user"``).
        tools: The schemas to pass to ``apply_chat_template(..., tools=...)`` for the first
            prompt, or None when the template is not to render them.

    Raises:
        ValueError: an unknown ``name``; fenced with no tool named ``fenced_tool`` in the
            registry, or one whose schema does not take ``{"code": str}``.
    """

    def __init__(self, name: str, registry: ToolRegistry, *, template_tools: bool = False,
                 fenced_tool: str = "python"):
        if name not in ("hermes", "fenced"):
            raise ValueError(f"tool-call format must be 'hermes' or 'fenced', got {name!r}")
        self.name: ToolFormatName = name  # type: ignore[assignment]
        self.registry = registry
        self.fenced_tool = fenced_tool
        if name == "fenced":
            if fenced_tool not in registry:
                raise ValueError(f"the fenced tool-call format runs a tool named {fenced_tool!r}; the environment "
                                 f"has {', '.join(registry.names) or 'no tools'} (use env.tool_format=hermes)")
            props = registry.get(fenced_tool).parameters.get("properties", {})
            if "code" not in props:
                raise ValueError(f"the fenced tool-call format passes {{'code': ...}}; tool {fenced_tool!r} takes "
                                 f"{sorted(props)} (use env.tool_format=hermes)")
        self.template_tools = bool(template_tools) and name == "hermes"
        self.stop: tuple[str, ...] = ("</tool_call>",) if name == "hermes" else ("```output",)
        self.observation_role = "tool" if self.template_tools else "user"
        self.tools: list[dict[str, Any]] | None = registry.schemas() if self.template_tools else None

    def parse(self, text: str) -> list[ToolCall]:
        """The calls in a turn's text (:func:`parse_hermes_calls` / :func:`parse_fenced_calls`)."""
        if self.name == "hermes":
            return parse_hermes_calls(text)
        return parse_fenced_calls(text, self.fenced_tool)

    def instructions(self) -> str:
        """The sentence(s) appended to the first user message telling the model how to call a
        tool (hermes with a tools-aware template: the template already describes the syntax)."""
        if self.name == "fenced":
            tool = self.registry.get(self.fenced_tool)
            return ("You can run Python code: write a complete program in a ```python code block and stop; "
                    "you will then see what it prints. " + _limits_sentence(tool.description))
        if self.template_tools:
            return "You can call the tools described above; call one at a time and wait for its result."
        schemas = "\n".join(json.dumps(s) for s in self.registry.schemas())
        return ("You can call these tools (JSON schemas):\n<tools>\n" + schemas + "\n</tools>\n"
                "To call one, write <tool_call>\n{\"name\": <tool name>, \"arguments\": <arguments object>}\n"
                "</tool_call> and stop; you will then see its result. Call one tool at a time.")

    def observation(self, text: str) -> str:
        """The observation message for a tool's output ``text`` (fenced: an ``output`` block;
        hermes without a tools-aware template: ``<tool_response>`` tags; else ``text``)."""
        if self.name == "fenced":
            return f"```output\n{text}\n```"
        if not self.template_tools:
            return f"<tool_response>\n{text}\n</tool_response>"
        return text

    def error_observation(self, calls: list[ToolCall]) -> str | None:
        """The observation for a turn whose calls cannot be run, or None when it holds exactly
        one well-formed call of a registered tool.

        Args:
            calls: The turn's calls (:meth:`parse`), at least one.

        Returns:
            ``"Error: ..."`` text (already wrapped by :meth:`observation`): two or more calls,
            a malformed call, or an unknown tool (the message lists the tools).
        """
        if len(calls) > 1:
            return self.observation(f"Error: {len(calls)} tool calls in one turn; make one call per turn and wait "
                                    "for its result.")
        (call,) = calls
        if call.error is not None:
            return self.observation(f"Error: {call.error}")
        if call.name not in self.registry:
            return self.observation(f"Error: unknown tool {call.name!r}; available tools: "
                                    f"{', '.join(self.registry.names)}")
        return None


def _limits_sentence(description: str) -> str:
    """The part of a tool description from "Each call" on (the python tool's state and limits)."""
    i = description.find("Each call")
    return description[i:] if i >= 0 else description


def resolve_tool_format(spec: str, tokenizer, registry: ToolRegistry, *,
                        fenced_tool: str = "python") -> ToolCallFormat:
    """The :class:`ToolCallFormat` for ``env.tool_format`` (module docstring).

    Args:
        spec: ``"auto"`` (hermes when :func:`template_supports_tools`, else fenced), ``"hermes"``
            or ``"fenced"``.
        tokenizer: The policy's tokenizer.
        registry: The environment's tools.
        fenced_tool: The tool a fenced python block calls.

    Returns:
        The format.

    Raises:
        ValueError: an unknown ``spec`` (the message names ``env.tool_format``), or what
            :class:`ToolCallFormat` raises.
    """
    if spec not in TOOL_FORMATS:
        raise ValueError(f"env.tool_format must be one of {', '.join(TOOL_FORMATS)}, got {spec!r}")
    supports = template_supports_tools(tokenizer)
    name = ("hermes" if supports else "fenced") if spec == "auto" else spec
    return ToolCallFormat(name, registry, template_tools=supports, fenced_tool=fenced_tool)


def truncate_observation(text: str, max_chars: int) -> str:
    """Cut a tool's output to at most about ``max_chars`` characters, keeping its head and its
    tail (a traceback's last line names the error) and saying how much was cut.

    Args:
        text: The output.
        max_chars: The budget (>= 64).

    Returns:
        ``text`` itself when it fits, else ``head + "\\n[... N characters cut ...]\\n" + tail``.

    Raises:
        ValueError: ``max_chars < 64``.
    """
    if max_chars < 64:
        raise ValueError(f"max_chars must be >= 64, got {max_chars}")
    if len(text) <= max_chars:
        return text
    head = max_chars * 2 // 3
    tail = max_chars - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters cut ...]\n{text[-tail:]}"
