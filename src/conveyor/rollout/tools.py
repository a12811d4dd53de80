"""Tools an episode can call while generating. The first one: a calculator.

The calculator turns a single response into an agent loop (action, observation, action, ...):
generation stops at every ``=``; if the text right before it is an arithmetic expression
(numbers, ``+ - * / x × ÷``, parentheses), the environment appends the exact result as
*observation* tokens, which the policy did not produce and is never trained on (their
``action_mask`` is 0: the skip-observation idea of SAO, MISSION.md section 3), and generation
continues. Expressions are evaluated by walking Python's ``ast`` (no ``eval``); anything else
(words, division by zero, results above 1e12) gets no observation.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import replace

from conveyor.rollout.engine import GenerationOutput, SamplingParams

TOOLS = ("none", "calculator")

_EXPR_TAIL = re.compile(r"([0-9.,\s+\-*/x×÷()]+)$")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_MAX_ABS = 1e12


def _eval_node(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _eval_node(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        out = _OPS[type(node.op)](left, right)
        if abs(out) > _MAX_ABS:
            raise ValueError("result too large")
        return out
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


def format_number(x: float) -> str:
    """``12`` for integral values, else up to 4 decimals without trailing zeros (``0.3333``)."""
    if abs(x - round(x)) < 1e-9:
        return str(int(round(x)))
    return f"{x:.4f}".rstrip("0").rstrip(".")


def calculate(text_before_equals: str) -> str | None:
    """The result of the arithmetic expression that ends ``text_before_equals``, or None.

    The expression is the longest tail made of digits, ``.``, ``,`` (thousands separator),
    spaces, ``+ - * / x × ÷`` and parentheses that contains at least one operator between two
    numbers, e.g. ``"Ellen spent 12 * 15 "`` -> ``"180"``, ``"so 7 x 8"`` -> ``"56"``.

    Returns:
        The formatted result (:func:`format_number`), or None when there is no expression, it
        does not parse, divides by zero or exceeds 1e12 in magnitude.
    """
    m = _EXPR_TAIL.search(text_before_equals)
    if not m:
        return None
    expr = m.group(1).strip()
    # a leading operator / unmatched parenthesis belongs to the words before: trim it
    expr = expr.lstrip("+*/x×÷)").strip()
    while expr.count("(") > expr.count(")") and expr.startswith("("):
        expr = expr[1:].strip()
    if not re.search(r"\d", expr) or not re.search(r"\d\s*[+\-*/x×÷]\s*\(?\s*-?\d", expr):
        return None
    expr = re.sub(r"(?<=\d),(?=\d{3}\b)", "", expr).replace("×", "*").replace("÷", "/").replace("x", "*")
    try:
        return format_number(_eval_node(ast.parse(expr, mode="eval")))
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError, RecursionError):
        return None


#: One output type for single- and multi-segment generations: a tool episode is a
#: :class:`~conveyor.rollout.engine.GenerationOutput` built with ``extend`` / ``observe``
#: (``action_mask``, ``tool_calls`` and ``request_spans`` set). The old name stays for a release.
ToolRollout = GenerationOutput


async def generate_with_calculator(engine, tokenizer, prompt_ids: list[int], params: SamplingParams, *, max_calls: int = 4) -> ToolRollout:
    """Generate one response, inserting calculator results after each ``=`` (see the module
    docstring). The total response (actions + observations) stays within
    ``params.max_new_tokens`` tokens; after ``max_calls`` observations generation continues
    without stopping at ``=``.

    Args:
        engine: A started :class:`~conveyor.rollout.engine.InferenceEngine`.
        tokenizer: Its tokenizer (observations are encoded with it, no special tokens).
        prompt_ids: Chat-formatted prompt ids.
        params: Sampling parameters (``stop`` is extended with ``"="`` while calls remain).
        max_calls: Maximum observations per response.

    Returns:
        A :class:`~conveyor.rollout.engine.GenerationOutput` with ``action_mask`` (0 on
        observations), ``tool_calls`` and ``request_spans`` (one per engine request).
    """
    out = GenerationOutput(prompt_ids=list(prompt_ids), action_mask=[])
    budget = params.max_new_tokens
    while budget > 0:
        calls_left = out.tool_calls < max_calls
        seg_params = replace(params, max_new_tokens=budget, stop=tuple(params.stop) + (("=",) if calls_left else ()))
        seg = await engine.generate(out.prompt_ids + out.token_ids, seg_params)
        out = out.extend(seg)  # token in, token out: the segment's tokens exactly
        budget -= len(seg.token_ids)
        if seg.finish_reason != "stop" or not calls_left or "=" not in seg.text or budget <= 0:
            break
        text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        before, _, after = text.rpartition("=")
        if after.strip():  # the stop token carried more text after "=": no clean place to answer
            continue
        result = calculate(before)
        if result is None:
            continue
        obs = tokenizer.encode(" " + result, add_special_tokens=False)[:budget]
        # an observation gets the version of the action token before it (staleness on actions)
        out = out.observe(obs, out.versions[-1] if out.versions else engine.version)
        budget -= len(obs)
    return replace(out, text=tokenizer.decode(out.token_ids, skip_special_tokens=True))
