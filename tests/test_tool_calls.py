"""Tool-call formats of agent turns (issue 14): Hermes / Qwen ``<tool_call>`` JSON and the fenced
```python fallback, parsed by pure functions (hand-written turns), the choice between them from
the chat template (SmolLM2's has no tools branch; a Qwen-style one does), and the observations a
malformed call, an unknown tool or two calls in one turn get."""

from __future__ import annotations

import copy

import pytest

from conveyor.envs.base import first_prompt_ids, turn_ids
from conveyor.envs.tool_calls import (
    ToolCallFormat,
    parse_fenced_calls,
    parse_hermes_calls,
    resolve_tool_format,
    template_supports_tools,
    truncate_observation,
)
from conveyor.envs.tools import CalculatorTool, ToolRegistry

# a Hermes-style template in the shape of Qwen2.5's (tools in the system prompt, tool results
# as <tool_response> in a user turn)
QWEN_LIKE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou are helpful.\\n\\n# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return <tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class Python:
    """A stand-in for the python tool: the schema of PythonTool, no sandbox."""

    name = "python"
    description = "Run a Python 3 program. Each call starts fresh; print() what you need."
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"],
                  "additionalProperties": False}

    async def call(self, arguments):  # pragma: no cover - never run here
        raise AssertionError


def registry():
    return ToolRegistry([Python(), CalculatorTool()])


def test_hermes_calls_are_parsed_with_their_errors():
    one = 'Let me compute.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(2 + 3)"}}\n</tool_call>'
    (c,) = parse_hermes_calls(one)
    assert c.ok and c.name == "python" and c.arguments == {"code": "print(2 + 3)"}
    # arguments as a JSON string (OpenAI's wire form) and Llama's "parameters" are accepted
    (c,) = parse_hermes_calls('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>')
    assert c.arguments == {"expression": "2*3"}
    (c,) = parse_hermes_calls('<tool_call>{"name": "calculator", "parameters": {"expression": "1"}}</tool_call>')
    assert c.arguments == {"expression": "1"}
    # an unclosed call at the end of a turn (cut by the token limit) still counts when it parses
    (c,) = parse_hermes_calls('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}')
    assert c.ok and c.arguments == {"code": "print(1)"}
    (c,) = parse_hermes_calls('<tool_call>{"name": "python", "arguments": {"code": "pri')
    assert not c.ok and "not valid JSON" in c.error
    # malformed calls: the error says what is wrong
    assert "not valid JSON" in parse_hermes_calls("<tool_call>{name: python}</tool_call>")[0].error
    assert "JSON object" in parse_hermes_calls("<tool_call>[1, 2]</tool_call>")[0].error
    assert 'no "name"' in parse_hermes_calls('<tool_call>{"arguments": {}}</tool_call>')[0].error
    assert '"arguments" must be a JSON object' in parse_hermes_calls(
        '<tool_call>{"name": "python", "arguments": [1]}</tool_call>')[0].error
    assert "empty" in parse_hermes_calls("<tool_call>  </tool_call>")[0].error
    # two calls, in order; no call at all
    two = parse_hermes_calls('<tool_call>{"name": "a"}</tool_call> and <tool_call>{"name": "b"}</tool_call>')
    assert [c.name for c in two] == ["a", "b"] and all(c.arguments == {} for c in two)
    assert parse_hermes_calls("The answer is 5. Answer: 5") == []


def test_fenced_python_blocks_are_calls_and_other_blocks_are_not():
    turn = "I will compute it.\n```python\nx = 17 * 23\nprint(x)\n```\nThat prints the product."
    (c,) = parse_fenced_calls(turn)
    assert c.ok and c.name == "python" and c.arguments == {"code": "x = 17 * 23\nprint(x)"}
    assert parse_fenced_calls("```py\nprint(1)\n```")[0].arguments == {"code": "print(1)"}
    assert parse_fenced_calls("```Python3\nprint(1)\n```")[0].arguments == {"code": "print(1)"}
    # output / plain / text blocks and inline code are not calls
    assert parse_fenced_calls("```output\n391\n```\n```\nplain\n```\n```text\nx\n``` and `print(1)`") == []
    # a block cut by the token limit runs as written (its SyntaxError is its own observation)
    assert parse_fenced_calls("```python\nfor i in range(3):\n")[0].arguments == {"code": "for i in range(3):\n"}
    assert not parse_fenced_calls("```python\n\n```")[0].ok
    assert len(parse_fenced_calls("```python\nprint(1)\n```\n```python\nprint(2)\n```")) == 2


def test_auto_format_follows_the_chat_template(tiny):
    smol = tiny.tokenizer
    assert not template_supports_tools(smol)  # SmolLM2's template renders role + content only
    fmt = resolve_tool_format("auto", smol, registry())
    assert (fmt.name, fmt.observation_role, fmt.tools, fmt.stop) == ("fenced", "user", None, ("```output",))
    assert "```python" in fmt.instructions() and fmt.observation("391") == "```output\n391\n```"
    # hermes asked for with a template without tools: schemas and syntax go in the user message
    h = resolve_tool_format("hermes", smol, registry())
    assert h.tools is None and h.observation_role == "user" and '"name": "python"' in h.instructions()
    assert h.observation("42") == "<tool_response>\n42\n</tool_response>" and h.stop == ("</tool_call>",)

    qwen = copy.deepcopy(smol)
    qwen.chat_template = QWEN_LIKE
    assert template_supports_tools(qwen)
    q = resolve_tool_format("auto", qwen, registry())
    assert q.name == "hermes" and q.observation_role == "tool" and q.observation("42") == "42"
    assert [t["function"]["name"] for t in q.tools] == ["python", "calculator"]
    prompt = qwen.decode(first_prompt_ids(qwen, "What is 6 x 7?", tools=q.tools))
    assert '"name": "python"' in prompt and "<tool_call>" in prompt
    # a tool result continues the conversation token-exactly as the template renders it
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6*7)"}}\n</tool_call>'
    ids = (first_prompt_ids(qwen, "What is 6 x 7?", tools=q.tools) + qwen.encode(call, add_special_tokens=False)
           + turn_ids(qwen, "42", role="tool", after_eos=False))
    msgs = [{"role": "user", "content": "What is 6 x 7?"}, {"role": "assistant", "content": call},
            {"role": "tool", "content": "42"}]
    assert qwen.decode(ids) == qwen.apply_chat_template(msgs, tools=q.tools, tokenize=False, add_generation_prompt=True)

    with pytest.raises(ValueError, match="env.tool_format"):
        resolve_tool_format("json", smol, registry())
    with pytest.raises(ValueError, match="tool named 'python'"):
        ToolCallFormat("fenced", ToolRegistry([CalculatorTool()]))


def test_error_observations_for_calls_that_cannot_run(tiny):
    fmt = resolve_tool_format("hermes", tiny.tokenizer, registry())
    assert fmt.error_observation(parse_hermes_calls('<tool_call>{"name": "python", "arguments": {"code": "1"}}'
                                                    '</tool_call>')) is None
    two = fmt.error_observation(parse_hermes_calls('<tool_call>{"name": "python"}</tool_call>'
                                                   '<tool_call>{"name": "python"}</tool_call>'))
    assert "Error: 2 tool calls in one turn; make one call per turn" in two
    unknown = fmt.error_observation(parse_hermes_calls('<tool_call>{"name": "shell", "arguments": {}}</tool_call>'))
    assert "Error: unknown tool 'shell'; available tools: python, calculator" in unknown
    bad = fmt.error_observation(parse_hermes_calls("<tool_call>{oops}</tool_call>"))
    assert bad.startswith("<tool_response>\nError: the tool call is not valid JSON")


def test_truncate_observation_keeps_head_and_tail():
    assert truncate_observation("short", 64) == "short"
    text = "".join(f"line {i}\n" for i in range(1000)) + "ZeroDivisionError: division by zero"
    out = truncate_observation(text, 300)
    assert out.startswith("line 0\n") and out.endswith("ZeroDivisionError: division by zero")
    assert len(out) < 360 and f"[... {len(text) - 300} characters cut ...]" in out
    with pytest.raises(ValueError):
        truncate_observation("x", 10)
