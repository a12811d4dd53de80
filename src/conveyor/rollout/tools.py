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
from dataclasses import dataclass, field, replace

from conveyor.rollout.engine import SamplingParams
from conveyor.types import SamplingMask

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


@dataclass
class ToolRollout:
    """One response generated with tool calls.

    Attributes:
        prompt_ids: The prompt (length P).
        token_ids: Response tokens, policy actions and tool observations interleaved (length R).
        logprobs: Behaviour log-probs (0.0 on observation tokens), length R.
        versions: Policy version per token (an observation gets the version of the action token
            before it, so staleness is measured on actions only), length R.
        action_mask: 1 for tokens the policy generated, 0 for observations, length R.
        text: Decoded response (actions and observations).
        finish_reason: Of the last generation segment.
        tool_calls: Observations inserted.
        num_interruptions: Weight updates that interrupted any segment.
        sampling_mask: Kept set of every token (length R) when sampling truncates: the
            segments' sets concatenated, observations without a set (full vocabulary); None
            without truncation (:class:`~conveyor.types.SamplingMask`).
    """

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    tool_calls: int = 0
    num_interruptions: int = 0
    sampling_mask: SamplingMask | None = None


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
        A :class:`ToolRollout`.
    """
    out = ToolRollout(prompt_ids=list(prompt_ids))
    masks: list[SamplingMask | int] = []  # per span: its kept sets, or its token count (no set)
    budget = params.max_new_tokens
    while budget > 0:
        calls_left = out.tool_calls < max_calls
        seg_params = replace(params, max_new_tokens=budget, stop=tuple(params.stop) + (("=",) if calls_left else ()))
        seg = await engine.generate(out.prompt_ids + out.token_ids, seg_params)
        out.token_ids += seg.token_ids
        out.logprobs += seg.logprobs
        seg_mask = getattr(seg, "sampling_mask", None)
        masks.append(seg_mask if seg_mask is not None else len(seg.token_ids))
        out.versions += seg.versions
        out.action_mask += [1] * len(seg.token_ids)
        out.num_interruptions += seg.num_interruptions
        out.finish_reason = seg.finish_reason
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
        out.token_ids += obs
        out.logprobs += [0.0] * len(obs)
        masks.append(len(obs))  # observations: no kept set (they carry no loss)
        out.versions += [out.versions[-1] if out.versions else engine.version] * len(obs)
        out.action_mask += [0] * len(obs)
        out.tool_calls += 1
        budget -= len(obs)
    out.text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    out.sampling_mask = SamplingMask.concat(masks)
    return out
