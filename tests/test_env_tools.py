"""The tool protocol, registry and calculator tool (issue 14, section 1); no sandbox needed."""

from __future__ import annotations

import asyncio
import json

import pytest

from conveyor.envs.tools import (
    CalculatorTool,
    Tool,
    ToolRegistry,
    ToolResult,
    check_arguments,
    make_tool,
    tool_schema,
)


class Echo:
    name = "echo"
    description = "Echo the text."
    parameters = {
        "type": "object",
        "properties": {"text": {"type": "string"}, "times": {"type": "integer"}},
        "required": ["text"],
    }

    async def call(self, arguments):
        return ToolResult(arguments["text"] * arguments.get("times", 1), ok=True)


class Broken(Echo):
    name = "broken"

    async def call(self, arguments):
        raise RuntimeError("tool bug")


def test_schemas_have_the_openai_function_shape():
    reg = ToolRegistry([CalculatorTool(), Echo()])
    schemas = reg.schemas()
    assert [s["function"]["name"] for s in schemas] == ["calculator", "echo"]
    for s in schemas:
        assert s["type"] == "function"
        assert set(s["function"]) == {"name", "description", "parameters"}
        assert s["function"]["parameters"]["type"] == "object"
    assert json.loads(json.dumps(schemas)) == schemas  # JSON-serialisable, as templates need
    assert tool_schema(Echo())["function"]["parameters"]["required"] == ["text"]
    assert isinstance(CalculatorTool(), Tool)


def test_registry_rejects_bad_and_duplicate_tools():
    reg = ToolRegistry([Echo()])
    with pytest.raises(ValueError, match="already registered"):
        reg.register(Echo())
    bad = Echo()
    bad.name = "has space"
    with pytest.raises(ValueError, match="tool name"):
        reg.register(bad)
    with pytest.raises(TypeError):
        reg.register(object())
    with pytest.raises(KeyError, match="registered: echo"):
        reg.get("nope")
    assert "echo" in reg and len(reg) == 1 and reg.names == ["echo"]


def test_registry_call_reports_model_mistakes_as_observations():
    reg = ToolRegistry([Echo(), Broken()])

    async def go():
        return [
            await reg.call("echo", {"text": "ab", "times": 2}),
            await reg.call("echo", '{"text": "x"}'),
            await reg.call("nope", {}),
            await reg.call("echo", "{not json"),
            await reg.call("echo", {"times": 2}),
            await reg.call("echo", {"text": "a", "times": "2"}),
            await reg.call("broken", {"text": "a"}),
        ]

    ok, from_json, unknown, bad_json, missing, wrong_type, broken = asyncio.run(go())
    assert ok == ToolResult("abab", ok=True) and from_json.observation == "x"
    assert not unknown.ok and "unknown tool 'nope'" in unknown.observation
    assert "available tools: echo, broken" in unknown.observation
    assert not bad_json.ok and "not valid JSON" in bad_json.observation
    assert missing.observation == "Error: missing argument(s): 'text'"
    assert "argument 'times' must be of type integer, got str" in wrong_type.observation
    assert not broken.ok and "RuntimeError: tool bug" in broken.observation


def test_check_arguments():
    schema = CalculatorTool.parameters
    assert check_arguments(schema, {"expression": "1+1"}) is None
    assert "unknown argument(s): 'x'" in check_arguments(schema, {"expression": "1", "x": 1})
    assert "must be a JSON object" in check_arguments(schema, ["1+1"])
    num = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert "got bool" in check_arguments(num, {"n": True})


def test_calculator_tool_wraps_calculate():
    calc = CalculatorTool()

    async def go(expr):
        return await calc.call({"expression": expr})

    assert asyncio.run(go("12 * 15")) == ToolResult("180", ok=True)
    assert asyncio.run(go("(1 + 2) / 3 =")).observation == "1"
    assert asyncio.run(go("10 / 3")).observation == "3.3333"
    assert asyncio.run(go("42")).observation == "42"
    for bad in ("1 / 0", "import os", "10 ** 100"):
        r = asyncio.run(go(bad))
        assert not r.ok and r.observation.startswith("Error:"), bad


def test_make_tool():
    assert make_tool("calculator").name == "calculator"
    assert make_tool("python").name == "python"  # built lazily, no sandbox start
    assert make_tool("conveyor.envs.tools:CalculatorTool", name="calc").name == "calc"
    with pytest.raises(ValueError, match="unknown tool"):
        make_tool("nope")
    with pytest.raises(ValueError, match="cannot load"):
        make_tool("conveyor.envs.tools:Missing")
