"""Math answer extraction, answer checking and the built-in math reward functions.

The symbolic comparison is done by ``math-verify`` (``math_verify.parse`` / ``math_verify.verify``);
this module only decides *which* part of a response is the final answer and cleans it up
(currency, units, thousands separators, trailing period) before handing it over.

Reward functions follow ``RewardFn = Callable[[str, Sample], float]``: they take the response
text and the data-set sample and return a reward (a plain float, no unit). They are run by
:class:`conveyor.rewards.service.RewardService`, which adds timeouts and failure handling.

Timeouts: math-verify bounds its own parsing / comparison with ``signal.alarm``, which only works
in the main thread. :func:`is_correct` therefore passes math-verify's timeout (in whole seconds,
:data:`MAIN_THREAD_TIMEOUT_S`) only when it runs in the main thread, and disables it
(``parsing_timeout=None`` / ``timeout_seconds=None``) in any other thread, where the reward
service's own timeout bounds the call instead.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from conveyor.types import Sample

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, Sample], float]
"""A reward function: ``(response text, sample) -> reward`` (float, no unit)."""

AnswerSource = Literal["boxed", "answer_tag", "hashes", "last_number"]

MAIN_THREAD_TIMEOUT_S = 5
"""math-verify's own signal-based timeout (whole seconds, per parse / comparison) in the main thread."""

MAX_ANSWER_CHARS = 1000
"""Extracted answers longer than this (characters) are only compared as exact strings, never
parsed symbolically (parsing very long LaTeX is where math-verify gets slow)."""


class _DropDisabledTimeoutWarning(logging.Filter):
    """Drop math-verify's one-off "Timeout is disabled" warning: off the main thread the reward
    service bounds each call with its own timeout, so the warning would only mislead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutWarning())

_LATEX_ONLY = [LatexExtractionConfig(boxed_match_priority=0)]
_EXPR_ONLY = [ExprExtractionConfig()]


@dataclass(frozen=True)
class ExtractedAnswer:
    """The final answer found in a response.

    Attributes:
        raw: The answer text exactly as it appears in the response (e.g. the content of the last
            ``\\boxed{...}``, or the rest of the line after ``"Answer:"``), stripped of surrounding
            whitespace.
        source: The rule that matched: ``"boxed"``, ``"answer_tag"``, ``"hashes"`` or
            ``"last_number"`` (in precedence order, see :func:`extract_answer`).
    """

    raw: str
    source: AnswerSource


# --------------------------------------------------------------------------- extraction

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG_RE = re.compile(
    r"\banswer\b\**(?:\s+is\b|\s*:)\**:?\**\s*(?P<val>[^\n]*)",
    re.IGNORECASE,
)
_BRACE_RE = re.compile(r"\\[{}]|[{}]")  # escaped braces match as one (ignored) token
_HASHES_RE = re.compile(r"####[ \t]*(?P<val>[^\n]*)")
# A number not glued to a word: optional minus, thousands groups or plain digits, optional
# decimals, optionally a plain fraction "a/b".
_NUMBER_RE = re.compile(
    r"(?<![\w.])(?:(?<![\d)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?"
)


def _boxed_spans(text: str) -> list[tuple[int, int]]:
    """Return ``(content_start, content_end)`` of every *balanced* ``\\boxed{...}`` in ``text``.

    One left-to-right pass with a brace stack (linear in ``len(text)``, so huge or adversarial
    responses stay cheap). Escaped braces ``\\{`` / ``\\}`` are not counted. A ``\\boxed{`` whose
    brace never closes (a truncated response) yields nothing.
    """
    box_opens = {m.end() - 1 for m in _BOXED_RE.finditer(text)}
    if not box_opens:
        return []
    spans: list[tuple[int, int]] = []
    stack: list[int] = []
    for m in _BRACE_RE.finditer(text):
        tok, i = m.group(0), m.start()
        if tok == "{":
            stack.append(i)
        elif tok == "}" and stack:
            start = stack.pop()
            if start in box_opens:
                spans.append((start + 1, i))
    return spans


def _last_tagged_value(pattern: re.Pattern[str], text: str) -> str | None:
    """Return the value group of the last match of ``pattern`` whose value is non-empty."""
    value = None
    for m in pattern.finditer(text):
        val = m.group("val").strip().strip("*").strip()
        if val:
            value = val
    return value


def extract_answer(text: str) -> ExtractedAnswer | None:
    """Find the final answer in a model response.

    Precedence (the first rule that finds something wins; within a rule the *last* occurrence
    in the text wins):

    1. ``"boxed"``: the content of the last balanced ``\\boxed{...}`` (or ``\\fbox{...}``);
       nested braces are matched; an unclosed ``\\boxed{`` is ignored.
    2. ``"answer_tag"``: the rest of the line after ``"Answer:"`` or ``"answer is"``
       (case-insensitive, markdown ``**`` allowed, e.g. ``"The final answer is 42."``); when
       that is empty, the next non-empty line.
    3. ``"hashes"``: the rest of the line after GSM8K's ``"#### "``.
    4. ``"last_number"``: the last number in the text (``-3``, ``1,000``, ``2.5``, ``7/2``).

    Args:
        text: The response text. Any string is accepted (empty, huge, broken LaTeX).

    Returns:
        The :class:`ExtractedAnswer`, or None when no rule matches (e.g. empty text or text
        without any number).

    Raises:
        TypeError: If ``text`` is not a ``str``.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    spans = _boxed_spans(text)
    for start, end in sorted(spans, key=lambda s: s[1], reverse=True):
        content = text[start:end].strip()
        if content:
            return ExtractedAnswer(content, "boxed")
    value = _last_tagged_value(_ANSWER_TAG_RE, text)
    if value is not None:
        return ExtractedAnswer(value, "answer_tag")
    value = _last_tagged_value(_HASHES_RE, text)
    if value is not None:
        return ExtractedAnswer(value, "hashes")
    last = None
    for last in _NUMBER_RE.finditer(text):  # noqa: B007 - only the last match is wanted
        pass
    if last is not None:
        return ExtractedAnswer(last.group(0), "last_number")
    return None


# --------------------------------------------------------------------------- normalisation

_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox|textrm|mathbf)\s*\{([^{}]*)\}")
_CURRENCY_RE = re.compile(r"(?:\\\$|\bUS\$|\$|\bUSD\b|€|£|¥|\\euro\b|\\pounds\b)\s*")
_NUMBER_THEN_WORDS_RE = re.compile(
    r"^(?P<num>[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?\s*(?:%|\\%)?)\s*[A-Za-z]{2,}\b.*$",
    re.DOTALL,
)
_PROSE_RE = re.compile(r"[A-Za-z]{2,}[,;]?\s+[A-Za-z]{2,}")
_MATH_DELIMS = (("$$", "$$"), ("\\(", "\\)"), ("\\[", "\\]"), ("$", "$"))


def _strip_math_delims(s: str) -> str:
    """Remove one pair of surrounding math delimiters (``$$ $$``, ``\\( \\)``, ``\\[ \\]``, ``$ $``)."""
    for left, right in _MATH_DELIMS:
        if len(s) > len(left) + len(right) and s.startswith(left) and s.endswith(right):
            return s[len(left) : -len(right)].strip()
    return s


def _unwrap_whole_boxed(s: str) -> str:
    """If ``s`` is exactly ``\\boxed{X}`` (possibly repeated), return ``X``."""
    while True:
        spans = _boxed_spans(s)
        whole = [sp for sp in spans if s[: sp[0]].strip() in ("\\boxed{", "\\fbox{")]
        if not whole or s[whole[0][1] + 1 :].strip():
            return s
        start, end = whole[0]
        s = s[start:end].strip()


def normalize_answer(answer: str) -> str:
    """Clean an extracted answer string before symbolic comparison.

    Steps: strip math delimiters (``$...$``, ``\\(...\\)``, ``\\[...\\]``) and a whole-string
    ``\\boxed{}``; unwrap ``\\text{}``-like commands; drop currency markers (``$``, ``\\$``,
    ``USD``, ``€``, ``£``); drop trailing words after a leading number (units or prose:
    ``"18 dollars"`` -> ``"18"``); reduce a prose sentence without LaTeX to its last number
    (``"The total is 18"`` -> ``"18"``); drop a trailing sentence period and ``\\!`` / ``\\,`` spacing.
    Thousands separators and ``%`` are left to math-verify.

    Args:
        answer: A raw answer string (e.g. :attr:`ExtractedAnswer.raw` or a reference answer).

    Returns:
        The cleaned string (possibly empty).

    Raises:
        TypeError: If ``answer`` is not a ``str``.
    """
    if not isinstance(answer, str):
        raise TypeError(f"answer must be a str, got {type(answer).__name__}")
    s = answer.strip()
    for _ in range(3):  # delimiters and boxes can be stacked: "$\boxed{5}$."
        before = s
        s = s.rstrip(".").strip()
        s = _unwrap_whole_boxed(_strip_math_delims(s))
        if s == before:
            break
    s = _TEXT_CMD_RE.sub(lambda m: m.group(1), s)
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", " ")
    s = _CURRENCY_RE.sub("", s).strip()
    m = _NUMBER_THEN_WORDS_RE.match(s)
    if m:
        s = m.group("num").strip()
    elif "\\" not in s and _PROSE_RE.search(s):
        numbers = _NUMBER_RE.findall(s)
        if numbers:
            s = numbers[-1]
    return s.rstrip(".").strip()


# --------------------------------------------------------------------------- comparison


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def _keep_outer_alarm() -> Iterator[None]:
    """Restore a pending ``ITIMER_REAL`` timer (e.g. pytest-timeout's) after math-verify.

    math-verify's timeout calls ``signal.alarm(n)`` and then ``signal.alarm(0)``, which silently
    cancels any timer the caller had armed. This re-arms it with the time it had left.
    """
    remaining, interval = signal.getitimer(signal.ITIMER_REAL)
    t0 = time.monotonic()
    try:
        yield
    finally:
        if remaining > 0:
            left = max(remaining - (time.monotonic() - t0), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, interval)


def _parse(answer: str, timeout: int | None) -> list[Any]:
    """Parse a normalised answer with math-verify: as LaTeX first, as a plain expression second."""
    parsed = parse(
        "\\boxed{" + answer + "}", _LATEX_ONLY, fallback_mode="no_fallback", parsing_timeout=timeout
    )
    if not parsed:
        parsed = parse(answer, _EXPR_ONLY, fallback_mode="no_fallback", parsing_timeout=timeout)
    return parsed


def _variants(answer: str) -> list[str]:
    """The normalised answer, plus the same without a trailing percent sign."""
    out = [answer]
    for pct in ("\\%", "%"):
        if answer.endswith(pct) and answer[: -len(pct)].strip():
            out.append(answer[: -len(pct)].strip())
            break
    return out


def _answers_match(predicted: str, reference: str, timeout: int | None) -> bool:
    pred_norm, ref_norm = normalize_answer(predicted), normalize_answer(reference)
    if not pred_norm or not ref_norm:
        return False
    if pred_norm == ref_norm:
        return True
    if len(pred_norm) > MAX_ANSWER_CHARS or len(ref_norm) > MAX_ANSWER_CHARS:
        return False
    for ref in _variants(ref_norm):
        gold = _parse(ref, timeout)
        if not gold:
            continue
        for pred in _variants(pred_norm):
            target = _parse(pred, timeout)
            if target and verify(gold, target, timeout_seconds=timeout):
                return True
    return False


def answers_match(predicted: str, reference: str) -> bool:
    """Whether two answer strings are mathematically equal according to math-verify.

    Both strings go through :func:`normalize_answer`, then are parsed as LaTeX (falling back to
    a plain expression) and compared with ``math_verify.verify`` (reference as gold). A trailing
    ``%`` is also tried without the sign on either side, so ``"50%"`` matches both ``"50"`` and
    ``"0.5"``. Safe in any thread (see the module docstring about timeouts).

    Args:
        predicted: The model's answer (already extracted, e.g. :attr:`ExtractedAnswer.raw`).
        reference: The reference answer.

    Returns:
        True when equal; False when different, unparsable, empty, or on any internal error.

    Raises:
        TypeError: If either argument is not a ``str``.
    """
    for name, value in (("predicted", predicted), ("reference", reference)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    try:
        if _in_main_thread():
            with _keep_outer_alarm():
                return _answers_match(predicted, reference, MAIN_THREAD_TIMEOUT_S)
        return _answers_match(predicted, reference, None)
    except Exception:  # noqa: BLE001 - weird model output must never crash a reward
        logger.debug("answer comparison failed", exc_info=True)
        return False


def is_correct(response: str, reference: str) -> bool:
    """Whether the final answer of ``response`` equals ``reference``.

    The answer is found with :func:`extract_answer` and compared with :func:`answers_match`
    (math-verify): ``\\frac{1}{2}`` = ``0.5`` = ``1/2``, ``"1,000"`` = ``"1000"``,
    ``"$18.00"`` = ``"18"`` = ``"18 dollars"``, ``"43.0"`` = ``"43"``, ``"50%"`` = ``"50"``.

    Args:
        response: The model's response text (any string).
        reference: The reference answer (e.g. ``Sample.answer``).

    Returns:
        True when the answers match. False otherwise, including empty or unparsable output;
        never raises on odd response content.

    Raises:
        TypeError: If ``response`` or ``reference`` is not a ``str``.
    """
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    if not isinstance(reference, str):
        raise TypeError(f"reference must be a str, got {type(reference).__name__}")
    extracted = extract_answer(response)
    if extracted is None or is_unevaluated_expression(extracted.raw):
        return False
    return answers_match(extracted.raw, reference)


# Two numbers joined by an arithmetic operator: "91 + 88", "10 × 22", "45 - 9", "3*4", "8 \\times 3".
# A slash between two plain integers ("1/2") is a fraction and stays allowed, as is \\frac.
_UNEVALUATED_RE = re.compile(
    r"\d\s*(?:[+×*÷]|\\times|\\cdot|\\div)\s*-?\d|\d\s+[-−]\s*\d|\d\s*[-−]\s+\d"
)


def is_unevaluated_expression(answer: str) -> bool:
    """True when a final answer is an arithmetic expression left for the reader to compute
    (``"91 + 88"``, ``"10 × 22"``, ``"27 - 7"``), not a value.

    math-verify evaluates such expressions symbolically and would call ``"91 + 88"`` equal to
    ``"179"``; a policy trained with that verifier learns to write the operation instead of the
    result (observed on MAWPS with SmolLM2-135M). Only purely numeric expressions are matched:
    fractions (``1/2``, ``\\frac{1}{2}``), negative numbers (``-5``) and symbolic answers with
    letters (``x^2+2x+1``, ``\\sqrt{2}+1``) are values.
    """
    if re.search(r"[A-Za-z]", re.sub(r"\\(?:times|cdot|div|left|right)", "", answer)):
        return False  # symbolic answers ("x^2+2x+1", "\\sqrt{2}+1") are values of their own kind
    return bool(_UNEVALUATED_RE.search(answer))


_FINAL_ANSWER_LINE_RE = re.compile(r"^\W*answer\W*:\s*\S", re.IGNORECASE)


def format_ok(response: str) -> bool:
    """Strict format check: the response states its final answer in a machine-readable way.

    True when either

    * the response contains a balanced ``\\boxed{...}`` with non-empty content, or
    * its last non-empty line starts with ``"Answer:"`` (case-insensitive, markdown such as
      ``"**Answer:**"`` allowed) followed by a value.

    ``"The answer is 42"`` or a bare trailing number do *not* count.

    Args:
        response: The model's response text.

    Returns:
        Whether the format is respected.

    Raises:
        TypeError: If ``response`` is not a ``str``.
    """
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    if any(response[a:b].strip() for a, b in _boxed_spans(response)):
        return True
    lines = [line for line in response.splitlines() if line.strip()]
    return bool(lines) and _FINAL_ANSWER_LINE_RE.match(lines[-1].strip()) is not None


# --------------------------------------------------------------------------- reward functions


@lru_cache(maxsize=64)
def _rg_scorer(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def _rg_task(sample: Sample) -> str:
    task = sample.metadata.get("rg_task")
    if task is None:
        task = (sample.metadata["rg_entry"].get("metadata") or {}).get("source_dataset")
    if not isinstance(task, str) or not task:
        raise ValueError(
            f"sample {sample.id!r}: metadata['rg_task'] must name the reasoning-gym task, "
            f"got {task!r}"
        )
    return task


def _rg_correctness(response: str, sample: Sample) -> float:
    """reasoning-gym's own scorer on the extracted answer (raw, and lightly cleaned)."""
    entry = sample.metadata["rg_entry"]
    if not isinstance(entry, dict):
        raise ValueError(
            f"sample {sample.id!r}: metadata['rg_entry'] must be a dict, got {type(entry).__name__}"
        )
    scorer = _rg_scorer(_rg_task(sample))
    extracted = extract_answer(response)
    if extracted is None:
        return float(scorer(None, entry))
    candidates = [extracted.raw]
    cleaned = _strip_math_delims(extracted.raw.rstrip(".").strip())
    if cleaned != extracted.raw:
        candidates.append(cleaned)
    score = max(float(scorer(c, entry)) for c in candidates)
    if not math.isfinite(score):
        raise ValueError(f"reasoning-gym scorer for sample {sample.id!r} returned {score}")
    return min(max(score, 0.0), 1.0)


def _check_args(response: Any, sample: Any) -> None:
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    if not isinstance(sample, Sample):
        raise TypeError(f"sample must be a conveyor.types.Sample, got {type(sample).__name__}")


def correctness_reward(response: str, sample: Sample) -> float:
    """Correctness of the final answer, in [0, 1].

    For reasoning-gym samples (``sample.metadata`` has ``"rg_entry"``, and ``"rg_task"`` or the
    entry's ``metadata.source_dataset``), reasoning-gym's own scorer
    ``get_score_answer_fn(task)(answer, entry)`` is applied to the extracted answer (it can give
    partial credit). Otherwise 1.0 if :func:`is_correct` against ``sample.answer``, else 0.0.

    Args:
        response: The model's response text.
        sample: The sample the response answers.

    Returns:
        The reward in [0, 1].

    Raises:
        TypeError: If ``response`` is not a str or ``sample`` not a :class:`Sample`.
        ValueError: If a reasoning-gym sample has a malformed ``rg_entry`` / ``rg_task``
            (unknown tasks raise reasoning-gym's ``ValueError``).
    """
    _check_args(response, sample)
    if "rg_entry" in sample.metadata:
        return _rg_correctness(response, sample)
    return 1.0 if is_correct(response, sample.answer) else 0.0


def format_reward(response: str, sample: Sample) -> float:
    """1.0 if :func:`format_ok` (boxed answer or final ``"Answer: X"`` line), else 0.0.

    Args:
        response: The model's response text.
        sample: The sample (unused; part of the ``RewardFn`` signature).

    Raises:
        TypeError: If ``response`` is not a str or ``sample`` not a :class:`Sample`.
    """
    _check_args(response, sample)
    return 1.0 if format_ok(response) else 0.0


def math_reward(response: str, sample: Sample, format_weight: float = 0.1) -> float:
    """``correctness_reward + format_weight * format_reward``.

    With the default weight 0.1 the reward is in {0, 0.1, 1.0, 1.1} (reasoning-gym partial credit
    can give values in between): correctness dominates, and a well-formatted wrong answer earns a
    small bonus over an unformatted one.

    Args:
        response: The model's response text.
        sample: The sample the response answers.
        format_weight: Weight of the format term (finite, >= 0).

    Returns:
        The reward, in [0, 1 + format_weight].

    Raises:
        ValueError: If ``format_weight`` is negative or not finite.
        TypeError: As :func:`correctness_reward`.
    """
    if not isinstance(format_weight, int | float) or not (
        math.isfinite(format_weight) and format_weight >= 0
    ):
        raise ValueError(f"format_weight must be a finite number >= 0, got {format_weight!r}")
    return correctness_reward(response, sample) + format_weight * format_reward(response, sample)


BUILTIN_REWARD_FNS: dict[str, RewardFn] = {
    "math": math_reward,
    "correctness": correctness_reward,
    "format": format_reward,
}


def load_reward_fn(path: str) -> RewardFn:
    """Resolve a reward function by name or import path.

    Accepted forms: a built-in name (``"math"``, ``"correctness"``, ``"format"``, see
    :data:`BUILTIN_REWARD_FNS`), ``"package.module:function"`` (the part after the colon may
    be dotted, e.g. ``"pkg.mod:Class.method"``) or ``"package.module.function"``.

    Args:
        path: The name or import path.

    Returns:
        The callable (its signature is not checked; it must accept ``(response, sample)``).

    Raises:
        ValueError: If ``path`` is empty or malformed, its module cannot be imported, the
            attribute does not exist, or it is not callable. The message names ``path``; the
            original exception is chained.
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"reward function path must be a non-empty str, got {path!r}")
    path = path.strip()
    if path in BUILTIN_REWARD_FNS:
        return BUILTIN_REWARD_FNS[path]
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path or ":" in attr_path:
        raise ValueError(
            f"reward function {path!r}: expected a built-in name {sorted(BUILTIN_REWARD_FNS)}, "
            "'package.module:function' or 'package.module.function'"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ValueError(f"reward function {path!r}: module {module_name!r} not found") from exc
        raise ValueError(
            f"reward function {path!r}: importing {module_name!r} failed: {exc}"
        ) from exc
    except Exception as exc:
        raise ValueError(
            f"reward function {path!r}: importing {module_name!r} failed: {exc}"
        ) from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ValueError(
                f"reward function {path!r}: {module_name!r} has no attribute {attr_path!r}"
            ) from exc
    if not callable(obj):
        raise ValueError(
            f"reward function {path!r}: {attr_path!r} is a {type(obj).__name__}, not callable"
        )
    return obj
