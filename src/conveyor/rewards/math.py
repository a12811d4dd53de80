"""Math answer extraction, answer checking and the built-in math reward functions.

The checker is the reward, so a false positive is a reward hack the policy will find (issue 10,
section 4; the reward service of MISSION.md section 1). This module decides *which* part of a
response is the final answer and reads it; the symbolic comparison itself is done by ``math-verify``
(``math_verify.parse`` / ``math_verify.verify``), to which every comparison is handed after the
normalisation below.

Grading policy
==============

**Final-answer marks.** A response states its final answer with *marks* (:func:`extract_answers`):

1. ``boxed``: the content of each outermost balanced ``\\boxed{...}`` / ``\\fbox{...}``;
2. ``answer_xml``: the content of each ``<answer>...</answer>`` (reasoning-gym's own format);
3. ``answer_tag``: the rest of the line after each ``"Answer:"`` (case-insensitive, markdown
   ``**`` allowed; when the rest of the line is empty, the next non-empty line);
4. ``hashes``: the rest of the line after each GSM8K ``"####"``.

These are the *strict* marks. An *answer phrase* ``"... answer is X"`` (also an ``answer_tag``) is
looser (``"the answer is easy to find"``), so only the *last* phrase of a response is a mark: next
to the strict marks when the reference is a number (``"#### 1 ... The answer is 6."`` names two
values), and only when there is no strict mark otherwise (a word answer after ``Answer:`` is not
undone by an earlier sentence about the answer).

**Every mark must be right.** A response is correct only when each of its marks equals the
reference: ``\\boxed{2} then \\boxed{3}`` and ``Answer: 12`` followed by ``\\boxed{13}`` are wrong
whatever the reference, ``\\boxed{3} ... \\boxed{3}`` is one answer given twice. When the reference
is a number, marks without any digit (``"Answer: see below"``) are not answers and are skipped,
unless every mark is digit-free.

**Last-number fallback.** Only when the response has no mark at all, the final answer is the last
number of the text *together with the numbers listed or offered as alternatives right before it
on the same line* (joined by spaces, ``, ; & | ~ - – —``, ``or``, ``and``, ``to``, ``vs``, or
any short phrase containing ``or``). ``"2 4 6 8"``, ``"between 12 and 13"`` and ``"10-12"`` thus
name several values (wrong); ``"5 + 7 = 12"`` and ``"3 cats and -4 dogs"`` end in one value.

**Hedges.** A final answer that names several different values is wrong. When the reference is a
single number, an answer is read as numbers and text (:func:`read_answer`):

* one distinct number with only words, units, currency and punctuation around it is that number
  (``"12 apples"``, ``"x = 12"``, ``"12 (twelve)"``, ``"12, 12"``);
* two or more distinct numbers with nothing but words / punctuation between them are a hedge
  (``"12 or 13"``, ``"12, 13"``, ``"12 13"``, ``"between 12 and 13"``, ``"\\{12, 13\\}"``,
  ``"12 apples and 13 pears"``), and so are several numbers in an expression that contains a
  hedge operator (``or``, ``either``, ``±``, ``\\pm``, ``\\vee``, ``\\lor``, ``\\cup``, ``,``,
  ``;``, ``...``, ``–``, ``\\approx``, ..., or a hyphen right between two numbers: the range
  ``12-13``);
* anything else with arithmetic or LaTeX commands is an expression: an operation on plain
  numbers left for the reader (``"91 + 88"``, ``"700 = 7 * 100"``, ``"4 \\times 5"``) is wrong
  (:func:`is_unevaluated_expression`), others (``"\\sqrt{144}"``, ``"2\\sqrt{2}"``) go to
  math-verify, and must parse to a single number without free symbols (not a set, interval,
  relation or ``12 + 0x``).

**Equations** (issue 44, section 3; :func:`_read_equation`). An answer of the form
``expr = value`` (``"Answer: 7 * 100 = 700"``, ``"The answer is 12 - 5 = 7 apples."``) is graded
by its value when ``expr`` evaluates to it: the last side of the ``=`` is the value (one number,
words and units around it allowed), every other side a purely numeric arithmetic expression
(``+ - * / ^``, ``\\times``, ``\\cdot``, ``\\div``, ``\\frac``, parentheses; evaluated exactly,
never with ``eval``); the first side may follow words without digits (``"The total is 3 * 4 =
12"``) and a first side of words only is a label (``"total = 3 + 4 = 7"``). A value written with
decimals may be the expression rounded to them (``10 / 3 = 3.33``); otherwise the sides must be
equal. A false equation (``"5 * 8 = 41"``, ``"2 + 2 = 4 = 5"``, ``"12 = 13"``) is wrong whatever
the reference (reason ``"false_equation"``), also next to a right mark. Several different final
values stay a hedge (``"3 + 4 = 7 or 8"``; ``"Answer: 3 + 4 = 7"`` with ``\\boxed{8}``). Answers
that are not of this form (``"x = 12"``, ``"x + 3 = 7"``, ``"700 = 7 * 100"``, ``"3 times 7 =
21"``) are read as before. In the last-number fallback, ``expr =`` right before the last number on
its line is kept with it (``"5 * 8 = 41"`` is a false equation, ``"So 91 + 88 = 179"`` is 179)
when ``expr`` has an operator and does not follow an operator word (``x``, ``times``, ``by``,
``of``, ...: ``"3 x 7 = 21"`` is read as 21).

When the reference is not a single number (``"\\frac{1}{\\sqrt{2}}"``, ``"(x+1)^2"``, a word),
the answer is compared by math-verify after :func:`normalize_answer`; ``or`` / ``either`` /
``\\pm`` / ``\\vee`` / ``\\lor`` in the answer but not in the reference make it wrong. Plain words
(no digits, no LaTeX) also match case-insensitively.

**Normalisation** (:func:`normalize_answer`, :func:`read_answer`), in order:

* Unicode: vulgar fractions become ``n/d`` (``"1½"`` -> ``"1 1/2"``, ``"¾"`` -> ``"3/4"``);
  superscripts become ``^{...}`` (``"m²"`` -> ``"m^{2}"``); decimal digits of any script become
  ASCII (``unicodedata.decimal``: full-width, Arabic-Indic, Devanagari, ...); NFKC (no-break,
  narrow no-break and thin spaces become spaces); the minus sign ``−`` and the hyphens ``‐ ‑``
  become ``-``; the Arabic decimal / thousands separators become ``.`` / ``,``.
* LaTeX and text: math delimiters, ``\\boxed``, ``\\left`` / ``\\right`` and markdown ``**`` are
  dropped; ``\\text{}``-like commands are unwrapped; ``\\dfrac`` / ``\\tfrac`` become ``\\frac``;
  LaTeX spacing (``\\, \\; \\! \\quad ~``) becomes a space; currency (``$ \\$ US$ USD € £ ¥ ₹``) and
  degrees (``^\\circ``, ``°``) are dropped; ``\\%`` becomes ``%``.
* Thousands separators (a number is one value, never several): commas (``1,234,567``), Indian
  lakh grouping (``12,34,567``), apostrophes (``1'000``, ``1’000``), spaces of any width between
  groups of exactly three digits (``1 000 000``), and dots only with two or more groups of exactly
  three digits (``1.234.567``, optionally followed by a decimal comma: ``1.234.567,5``). A single
  dot is a decimal point: ``1.234`` is 1.234, not 1234. A comma followed by other than three
  digits separates numbers (``1,5`` is two numbers).
* Mixed numbers: an integer followed by a *proper* fraction is their sum (``1 3/4``,
  ``1\\frac{3}{4}``, ``1½`` -> 7/4); ``1 4/3`` and ``1 3`` are two numbers.
* Scientific notation: ``2e3``, ``2.5E4``, ``4 \\times 10^{5}``, ``4×10⁵``, ``4*10^5`` become plain
  decimals (lower-case ``e`` between digits is an exponent, never Euler's number); exponents
  have at most three digits.
* Units: an exponent on a unit word (``cm^2``, ``\\text{ cm}^2``, ``m²``, ``ft^{3}``) is dropped
  with the unit; a unit is a word of two or more letters, or one of the letters ``m s g L``.
  A single letter glued to a number (``12x``) is a product, not a unit.
* Percentages: ``"50%"`` matches both 50 and 0.5, and ``"10"`` matches a reference ``"10%"``.

Numbers are read exactly (``fractions.Fraction``) and handed to math-verify as exact decimals or
``\\frac{p}{q}``. Number words (``"twelve"``) are not read.

Reward functions follow ``RewardFn = Callable[[str, Sample], float]``: they take the response
text and the data-set sample and return a reward (a plain float, no unit). They are run by
:class:`conveyor.rewards.service.RewardService`, which adds timeouts and failure handling.
reasoning-gym samples are scored by reasoning-gym's own scorer on the extracted marks (the
lowest score of the marks; each mark tried raw and lightly cleaned), so word answers
(``Answer: apple, banana``) are graded by the task that made them.

Timeouts: math-verify bounds its own parsing / comparison with ``signal.alarm``, which only works
in the main thread. :func:`is_correct` therefore passes math-verify's timeout (in whole seconds,
:data:`MAIN_THREAD_TIMEOUT_S`) only when it runs in the main thread, and disables it
(``parsing_timeout=None`` / ``timeout_seconds=None``) in any other thread, where the reward
service's own timeout bounds the call instead. Everything this module does before math-verify
is linear-time regular expressions on at most the response's length.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import math
import re
import signal
import threading
import time
import unicodedata
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal, localcontext
from fractions import Fraction
from functools import lru_cache
from typing import Any, Literal

import sympy
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from conveyor.rewards.styles import style_reward
from conveyor.types import Sample

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, Sample], float]
"""A reward function: ``(response text, sample) -> reward`` (float, no unit).

What a reward function of your own receives (``reward.fn=module:fn``): ``response`` is the
model's text (an agent's or tool-using episode: its generated text); ``sample.answer`` is always a
string (a number in a JSONL file arrives as ``"76"``; compare with ``float(sample.answer)``);
``sample.question`` the question without the instruction; the JSONL fields beyond the question
and the answer are in ``sample.metadata["fields"]`` (a dict, e.g. ``{"difficulty": 3}``). The
prompt asked for the answer after ``"Answer:"``: ``data.instruction`` not set, a ``file:`` data
set's instruction is "Give the final answer after 'Answer:'." (numeric sets: "... as a number
after 'Answer:'."; ``conveyor.data.registry.source_format``); the run's ``config.json`` records
the one used. At start-up the function is called once on ``"Answer: <sample.answer>"``
(:mod:`conveyor.rewards.guard`): it must return a finite number there. An optional attribute
``fn.correct`` (a function of ``(response, sample)``, 1.0 = correct) is its own correctness
metric for the evaluations (:mod:`conveyor.eval`); without it a response passes at reward >=
``reward.pass_threshold``.
"""

AnswerSource = Literal["boxed", "answer_xml", "answer_tag", "hashes", "last_number"]

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
    """A final answer (a *mark*) found in a response.

    Attributes:
        raw: The answer text as it appears in the (Unicode-normalised, see the module docstring)
            response: the content of a ``\\boxed{...}`` or ``<answer>...</answer>``, the rest of
            the line after ``"Answer:"`` / ``"####"``, or for ``"last_number"`` the last number
            with the numbers listed before it (``"2 4 6 8"``); stripped of surrounding whitespace.
        source: The rule that matched: ``"boxed"``, ``"answer_xml"``, ``"answer_tag"``,
            ``"hashes"`` or ``"last_number"`` (see :func:`extract_answers`).
    """

    raw: str
    source: AnswerSource


@dataclass(frozen=True)
class Verdict:
    """The outcome of grading one response against a reference (:func:`grade`).

    Attributes:
        correct: Whether the response is graded correct.
        reason: ``"correct"``, ``"wrong"`` (a single answer that differs), ``"hedge"`` (several
            different values, in one mark or across marks), ``"unevaluated"`` (an operation on
            numbers left for the reader), ``"false_equation"`` (an ``expr = value`` whose sides
            differ: ``5 * 8 = 41``), ``"no_answer"`` (nothing to grade), ``"too_long"``
            (an answer over :data:`MAX_ANSWER_CHARS` that is not an exact string match) or
            ``"error"`` (math-verify failed; logged at debug level).
        answers: The raw text of the marks that were graded.
    """

    correct: bool
    reason: str
    answers: tuple[str, ...] = ()


# --------------------------------------------------------------------------- Unicode

_VULGAR = {
    "½": "1/2", "⅓": "1/3", "⅔": "2/3", "¼": "1/4", "¾": "3/4", "⅕": "1/5", "⅖": "2/5",
    "⅗": "3/5", "⅘": "4/5", "⅙": "1/6", "⅚": "5/6", "⅐": "1/7", "⅛": "1/8", "⅜": "3/8",
    "⅝": "5/8", "⅞": "7/8", "⅑": "1/9", "⅒": "1/10", "↉": "0/3",
}  # fmt: skip
_VULGAR_RE = re.compile(f"(\\d?)([{''.join(_VULGAR)}])")
_SUPERSCRIPTS = {
    "⁰": "0", "¹": "1", "²": "2", "³": "3", "⁴": "4", "⁵": "5", "⁶": "6", "⁷": "7", "⁸": "8",
    "⁹": "9", "⁻": "-", "⁺": "+",
}  # fmt: skip
_SUPERSCRIPT_RE = re.compile(f"[{''.join(_SUPERSCRIPTS)}]+")
_CHAR_MAP = str.maketrans({
    "\u2212": "-", "\u2010": "-", "\u2011": "-", "\u2044": "/", "\u2215": "/",
    "\u066b": ".", "\u066c": ",", "\u2019": "'",
})  # fmt: skip


def _ascii_digits(s: str) -> str:
    """Replace decimal digits of any script (category Nd) by ASCII digits."""
    if s.isascii():
        return s
    return "".join(
        str(unicodedata.decimal(ch)) if not ("0" <= ch <= "9") and ch.isdecimal() else ch
        for ch in s
    )


def _unicode_normalize(s: str) -> str:
    """Unicode step of the normalisation (see the module docstring): vulgar fractions,
    superscripts, digits of any script, NFKC, minus signs and separators. Linear in ``len(s)``."""
    if s.isascii():
        return s
    s = _VULGAR_RE.sub(lambda m: f"{m.group(1)} {_VULGAR[m.group(2)]}" if m.group(1)
                       else _VULGAR[m.group(2)], s)  # fmt: skip
    s = _SUPERSCRIPT_RE.sub(lambda m: "^{" + "".join(_SUPERSCRIPTS[c] for c in m.group(0)) + "}", s)
    s = _ascii_digits(s)
    s = unicodedata.normalize("NFKC", s)
    return s.translate(_CHAR_MAP)


# --------------------------------------------------------------------------- extraction

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG_RE = re.compile(
    r"\banswer\b\**(?:(?P<phrase>\s+is\b)|\s*:)\**:?\**\s*(?P<val>[^\n]*)",
    re.IGNORECASE,
)
_BRACE_RE = re.compile(r"\\[{}]|[{}]")  # escaped braces match as one (ignored) token
_HASHES_RE = re.compile(r"####[ \t]*(?P<val>[^\n]*)")
_XML_OPEN_RE = re.compile(r"<answer>", re.IGNORECASE)
_XML_CLOSE_RE = re.compile(r"</answer>", re.IGNORECASE)
_PRECEDENCE: dict[str, int] = {"boxed": 0, "answer_xml": 1, "answer_tag": 2, "hashes": 3}


def _boxed_spans(text: str) -> list[tuple[int, int]]:
    """Return ``(content_start, content_end)`` of every *balanced* ``\\boxed{...}`` in ``text``.

    One left-to-right pass with a brace stack (linear in ``len(text)``, so huge or adversarial
    responses stay cheap). Escaped braces ``\\{`` / ``\\}`` are not counted. A ``\\boxed{`` whose
    brace never closes (a truncated response) yields nothing. Nested boxes yield both spans.
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


def _outermost(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The spans not contained in another span, in text order."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start < out[-1][1]:
            continue
        out.append((start, end))
    return out


def _xml_spans(text: str) -> list[tuple[int, int]]:
    """``(content_start, content_end)`` of each ``<answer>...</answer>`` (innermost pairing)."""
    events = [(m.start(), m.end(), True) for m in _XML_OPEN_RE.finditer(text)]
    if not events:
        return []
    events += [(m.start(), m.end(), False) for m in _XML_CLOSE_RE.finditer(text)]
    spans, last_open = [], None
    for start, end, is_open in sorted(events):
        if is_open:
            last_open = end
        elif last_open is not None:
            spans.append((last_open, start))
            last_open = None
    return spans


@dataclass(frozen=True)
class _Mark:
    pos: int
    raw: str
    source: AnswerSource
    strict: bool


def _marks(text: str) -> list[_Mark]:
    """Every final-answer mark of ``text`` (already Unicode-normalised), in text order."""
    marks: list[_Mark] = []
    for start, end in _outermost(_boxed_spans(text)):
        if text[start:end].strip():
            marks.append(_Mark(start, text[start:end].strip(), "boxed", True))
    for start, end in _xml_spans(text):
        if text[start:end].strip():
            marks.append(_Mark(start, text[start:end].strip(), "answer_xml", True))
    for m in _ANSWER_TAG_RE.finditer(text):
        val = m.group("val").strip().strip("*").strip()
        if val:
            marks.append(_Mark(m.start(), val, "answer_tag", m.group("phrase") is None))
    for m in _HASHES_RE.finditer(text):
        val = m.group("val").strip().strip("*").strip()
        if val:
            marks.append(_Mark(m.start(), val, "hashes", True))
    marks.sort(key=lambda mk: mk.pos)
    return marks


def _select(marks: list[_Mark], numeric: bool) -> list[_Mark]:
    """The marks that make the final answer (module docstring): every strict mark and the last
    answer phrase (``numeric``), or the strict marks, else the last phrase (otherwise)."""
    strict = [mk for mk in marks if mk.strict]
    last_phrase = [mk for mk in marks if not mk.strict][-1:]
    if numeric:
        return sorted(strict + last_phrase, key=lambda mk: mk.pos)
    return strict or last_phrase


def _final_answers(text: str, numeric: bool, normalize: bool = True) -> list[ExtractedAnswer]:
    """:func:`extract_answers` for a numeric (or not) reference; ``normalize=False`` keeps the
    marks as written (reasoning-gym word answers)."""
    norm = _unicode_normalize(text)
    chosen = _select(_marks(norm if normalize else text), numeric)
    if chosen:
        return [ExtractedAnswer(mk.raw, mk.source) for mk in chosen]
    run = _last_number_run(norm)
    return [ExtractedAnswer(run, "last_number")] if run is not None else []


def extract_answers(text: str) -> list[ExtractedAnswer]:
    """All the final-answer marks of a response, in text order (see the module's grading policy).

    Every strict mark (``\\boxed{}``, ``<answer></answer>``, ``Answer:``, ``####``) and the last
    ``"... answer is X"`` phrase; when there is none, the last-number fallback (the last number
    with the numbers listed before it, source ``"last_number"``); otherwise ``[]``. This is the
    selection used for a numeric reference; for any other reference the phrase is dropped when
    strict marks exist.

    Args:
        text: The response text (any string; it is Unicode-normalised first).

    Returns:
        The marks, possibly empty. ``raw`` is taken from the Unicode-normalised text (for
        ``"last_number"``, from the fully normalised text: ``"$1,000.50"`` gives ``"1000.50"``).

    Raises:
        TypeError: If ``text`` is not a ``str``.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return _final_answers(text, numeric=True)


def extract_answer(text: str) -> ExtractedAnswer | None:
    """The single final answer of a response: of :func:`extract_answers`, the last mark of the
    highest-precedence kind.

    Precedence: ``"boxed"`` (the last balanced ``\\boxed{...}`` / ``\\fbox{...}``; nested braces
    are matched; an unclosed ``\\boxed{`` is ignored) > ``"answer_xml"`` > ``"answer_tag"``
    (``"Answer:"`` or the last ``"answer is"``; when the rest of the line is empty, the next
    non-empty line) > ``"hashes"`` (GSM8K ``"####"``) > ``"last_number"``
    (the last number with the numbers listed before it: ``"10-12"``, ``"7/2"``, ``"-6"``).

    Grading uses every mark (:func:`grade`); this function only names the one a reader would.

    Args:
        text: The response text. Any string is accepted (empty, huge, broken LaTeX).

    Returns:
        The :class:`ExtractedAnswer`, or None when nothing matches (e.g. empty text or text
        without any number).

    Raises:
        TypeError: If ``text`` is not a ``str``.
    """
    answers = extract_answers(text)
    if not answers:
        return None
    best = min(_PRECEDENCE.get(a.source, 9) for a in answers)
    return [a for a in answers if _PRECEDENCE.get(a.source, 9) == best][-1]


# --------------------------------------------------------------------------- normalisation

_D = r"(?:\d+(?:\.\d+)?|\.\d+)"
_TEXT_CMD_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|textsf|texttt|mathrm|mathbf|mathit|mathsf|mbox|hbox"
    r"|operatorname)\s*\{([^{}]*)\}"
)
_CURRENCY_RE = re.compile(r"(?:\\\$|\bUS\$|\$|\bUSD\b|€|£|¥|₹|\\euro\b|\\pounds\b|\\yen\b)\s*")
_SPACING_RE = re.compile(r"\\[,;:! ]|\\q?quad\b|~|\\enspace\b|\\thinspace\b")
_DEGREE_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree\b|\\circ\b")
_GROUP_LAKH_RE = re.compile(r"(?<![\w.,'])\d{1,2}(?:,\d{2})+,\d{3}(?![\d,])")
_GROUP_COMMA_RE = re.compile(r"(?<![\w.,'])\d{1,3}(?:,\d{3})+(?![\d,])")
_GROUP_APOS_RE = re.compile(r"(?<![\w.,'])\d{1,3}(?:'\d{3})+(?![\d'])")
_GROUP_DOT_RE = re.compile(r"(?<![\w.,'])(\d{1,3}(?:\.\d{3}){2,})(?:,(\d+))?(?![\d.,])")
_GROUP_SPACE_RE = re.compile(r"(?<![\w.,'/])\d{1,3}(?:[ \t]\d{3})+(?![\d/]|[ \t]*/)")
_SCI_TIMES_RE = re.compile(
    rf"(?<![\w.])(-?{_D})\s*(?:\\times|\\cdot|×|\*|·|x|X)\s*10\s*\^\s*"
    r"(?:\{\s*([+-]?\d{1,3})\s*\}|([+-]?\d{1,3}))(?![\d.])"
)
_SCI_E_RE = re.compile(rf"(?<![\w.])({_D})[eE]([+-]?\d{{1,3}})(?![\w.])")
_MIXED_LATEX_RE = re.compile(
    r"(?<![\w.])(\d+)\s*\\frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}"
)
_MIXED_PLAIN_RE = re.compile(r"(?<![\w.,/])(\d+)[ \t]+(\d+)[ \t]*/[ \t]*(\d+)(?![\d.]|[ \t]*/)")
_UNIT_POWER_RE = re.compile(
    r"(?<![A-Za-z\\])((?:[A-Za-z]{2,})|[msgL])\s*\^\s*(?:\{\s*-?[1-4]\s*\}|-?[1-4])(?![\d.])"
)


_BLANKS_RE = re.compile(r"[^\S\n]+")


def _sci_to_decimal(mantissa: str, exponent: str) -> str:
    """``("2.5", "4")`` -> ``"25000"``: the exact decimal of ``mantissa * 10**exponent``."""
    value = Decimal(mantissa).scaleb(int(exponent))
    text = format(value.normalize(), "f")
    return text[:-2] if text.endswith(".0") else text


def _mixed(whole: str, num: str, den: str, latex: bool) -> str | None:
    """``1 3/4`` -> ``"7/4"``; None unless ``num / den`` is a proper fraction."""
    n, d = int(num), int(den)
    if d == 0 or n >= d:
        return None
    total = int(whole) * d + n
    return f"\\frac{{{total}}}{{{d}}}" if latex else f"{total}/{d}"


def _latex_clean(s: str) -> str:
    """LaTeX, markdown, currency, spacing, grouping, scientific-notation, mixed-number and unit
    steps of the normalisation (see the module docstring). ``s`` is already Unicode-normalised.
    Linear-time regular expressions only."""
    if "\\" in s or "{" in s:
        s = _unwrap_boxes(s)
        for _ in range(3):  # nested \text{\textbf{...}}
            new = _TEXT_CMD_RE.sub(lambda m: f" {m.group(1)} ", s)
            if new == s:
                break
            s = new
        s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
        s = s.replace("\\left", "").replace("\\right", "").replace("\\%", "%")
        s = s.replace("{,}", ",").replace("{.}", ".")
        for delim in ("\\(", "\\)", "\\[", "\\]"):
            s = s.replace(delim, " ")
    s = s.replace("**", "")
    s = _DEGREE_RE.sub("", s)
    s = _SPACING_RE.sub(" ", s)
    s = _CURRENCY_RE.sub("", s)
    s = _GROUP_LAKH_RE.sub(lambda m: m.group(0).replace(",", ""), s)
    s = _GROUP_COMMA_RE.sub(lambda m: m.group(0).replace(",", ""), s)
    s = _GROUP_APOS_RE.sub(lambda m: m.group(0).replace("'", ""), s)
    s = _GROUP_DOT_RE.sub(
        lambda m: m.group(1).replace(".", "") + (f".{m.group(2)}" if m.group(2) else ""), s
    )
    s = _SCI_TIMES_RE.sub(lambda m: _sci_to_decimal(m.group(1), m.group(2) or m.group(3)), s)
    s = _SCI_E_RE.sub(lambda m: _sci_to_decimal(m.group(1), m.group(2)), s)
    s = _MIXED_LATEX_RE.sub(
        lambda m: _mixed(m.group(1), m.group(2), m.group(3), True) or m.group(0), s
    )
    s = _MIXED_PLAIN_RE.sub(
        lambda m: _mixed(m.group(1), m.group(2), m.group(3), False) or m.group(0), s
    )
    s = _GROUP_SPACE_RE.sub(lambda m: re.sub(r"[ \t]", "", m.group(0)), s)
    s = _UNIT_POWER_RE.sub(lambda m: m.group(1), s)
    return _BLANKS_RE.sub(" ", s).strip()


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


def _unwrap_boxes(s: str) -> str:
    """Replace every balanced ``\\boxed{X}`` / ``\\fbox{X}`` in ``s`` by `` X `` (the marks were
    already taken; inside an answer a box is only decoration). Linear in ``len(s)``."""
    spans = _boxed_spans(s)
    if not spans:
        return s
    command_start = {m.end(): m.start() for m in _BOXED_RE.finditer(s)}
    drop = bytearray(len(s))
    for start, end in spans:
        cmd = command_start.get(start)
        if cmd is not None:
            drop[cmd:start] = b"\x01" * (start - cmd)
            drop[end] = 1
    return "".join(" " if drop[i] else ch for i, ch in enumerate(s))


def _strip_wrappers(s: str) -> str:
    """Strip trailing periods, surrounding math delimiters and a whole-string ``\\boxed{}``."""
    s = s.strip()
    for _ in range(3):  # delimiters and boxes can be stacked: "$\boxed{5}$."
        before = s
        s = s.rstrip(".").strip()
        s = _unwrap_whole_boxed(_strip_math_delims(s))
        if s == before:
            break
    return s


def normalize_answer(answer: str) -> str:
    """Clean an extracted answer string before symbolic comparison.

    Steps: the Unicode step of the module docstring; strip math delimiters (``$...$``,
    ``\\(...\\)``, ``\\[...\\]``) and a whole-string ``\\boxed{}``; the LaTeX / currency /
    grouping / scientific-notation / mixed-number / unit steps of the module docstring (``"1,000"`` ->
    ``"1000"``, ``"2e3"`` -> ``"2000"``, ``"1 3/4"`` -> ``"7/4"``); drop trailing words after a
    leading number (units or prose: ``"18 dollars"`` -> ``"18"``); reduce a prose sentence without
    LaTeX to its last number (``"The total is 18"`` -> ``"18"``); drop a trailing period.
    ``%`` is left to the comparison.

    This is the cleaning of the general (non-numeric) comparison; answers to a numeric reference
    are read with :func:`read_answer`, which also detects hedges.

    Args:
        answer: A raw answer string (e.g. :attr:`ExtractedAnswer.raw` or a reference answer).

    Returns:
        The cleaned string (possibly empty).

    Raises:
        TypeError: If ``answer`` is not a ``str``.
    """
    if not isinstance(answer, str):
        raise TypeError(f"answer must be a str, got {type(answer).__name__}")
    s = _strip_wrappers(_unicode_normalize(answer))
    s = _latex_clean(s)
    m = _NUMBER_THEN_WORDS_RE.match(s)
    if m:
        s = m.group("num").strip()
    elif "\\" not in s and _PROSE_RE.search(s):
        numbers = _LOOSE_NUMBER_RE.findall(s)
        if numbers:
            s = numbers[-1]
    return s.rstrip(".").strip()


# --------------------------------------------------------------------------- reading numbers

_LOOSE_NUMBER_RE = re.compile(r"(?<![\w.])(?:(?<![\d)])-)?\d+(?:\.\d+)?(?:/\d+(?:\.\d+)?)?")
_LITERAL_RE = re.compile(
    rf"(?<![\w.])(?P<sign>(?<![\d)\]}}])-)?(?:"
    rf"\\frac\s*\{{\s*(?P<fn>-?{_D})\s*\}}\s*\{{\s*(?P<fd>-?{_D})\s*\}}"
    r"|\\frac(?P<fn2>\d)(?P<fd2>\d)"
    rf"|(?P<num>{_D})(?:[ \t]*/[ \t]*(?P<den>{_D}))?"
    r")(?P<pct>[ \t]*%)?"
)
_PLAIN_TOKEN_RE = re.compile(
    r"\s+|\x00|[A-Za-z]+(?:[-'/.][A-Za-z]+)*|-[A-Za-z]+(?:[-'][A-Za-z]+)*"
    r"|[.,:;!?()\[\]{}\"'=%#&|…–—]"
)
_DIGITS_RE = re.compile(r"\d+")
_GLUED_LETTER_RE = re.compile(r"\x00[A-Za-z](?![A-Za-z])")
_PERCENT_WORD_RE = re.compile(r"\bper\s*cent\b|\bpercent(?:age)?\b", re.IGNORECASE)
_HEDGE_RE = re.compile(
    r"\b(?:or|either|between|to|vs|versus|and)\b|±|∓|\\pm\b|\\mp\b|\\vee\b|\\lor\b|\\cup\b"
    r"|\\wedge\b|\\land\b|\\ldots\b|\\cdots\b|\\dots\b|\\approx\b|\\sim\b|\\mid\b|\\\\|\\\{"
    r"|\.\.|…|[,;|&–—]|\x00-\x00",  # the last: a range "12-13" (no spaces)
    re.IGNORECASE,
)
_HEDGE_WORDS_RE = re.compile(
    r"\b(?:or|either)\b|±|∓|\\pm\b|\\mp\b|\\vee\b|\\lor\b", re.IGNORECASE
)


@dataclass(frozen=True)
class AnswerReading:
    """How an answer reads as numbers (:func:`read_answer`).

    Attributes:
        kind: ``"number"`` (one distinct number among words / units / punctuation), ``"hedge"``
            (several different numbers offered side by side), ``"expression"`` (arithmetic or
            LaTeX around the numbers: left to math-verify), ``"empty"`` (no digit at all).
        values: The distinct numbers in order of appearance (exact).
        percent: Whether the number carries ``%`` (or the word percent).
        text: The normalised text that was read.
    """

    kind: Literal["number", "hedge", "expression", "empty"]
    values: tuple[Fraction, ...]
    percent: bool
    text: str


def _literal_value(m: re.Match[str]) -> Fraction | None:
    """The exact value of a ``_LITERAL_RE`` match (None if a denominator is zero)."""
    if m.group("fn") is not None:
        num, den = Fraction(m.group("fn")), Fraction(m.group("fd"))
    elif m.group("fn2") is not None:
        num, den = Fraction(m.group("fn2")), Fraction(m.group("fd2"))
    else:
        num = Fraction(m.group("num"))
        den = Fraction(m.group("den")) if m.group("den") is not None else Fraction(1)
    if den == 0:
        return None
    value = num / den
    return -value if m.group("sign") else value


def _read_clean(text: str) -> AnswerReading:
    """:func:`read_answer` on text that already went through the normalisation steps."""
    values: list[Fraction] = []
    percent = False
    parts: list[str] = []
    prev = 0
    bad_literal = False
    for m in _LITERAL_RE.finditer(text):
        value = _literal_value(m)
        if value is None:
            bad_literal = True
            continue
        parts.append(text[prev : m.start()])
        parts.append("\x00")
        prev = m.end()
        percent = percent or m.group("pct") is not None
        if value not in values:
            values.append(value)
    parts.append(text[prev:])
    residual = "".join(parts)
    if not values:
        kind = "expression" if any(c.isdigit() for c in text) else "empty"
        return AnswerReading(kind, (), False, text)
    percent = percent or _PERCENT_WORD_RE.search(residual) is not None
    plain = (
        not bad_literal
        and not _PLAIN_TOKEN_RE.sub("", residual)
        and _GLUED_LETTER_RE.search(residual) is None
    )
    stray = len(_DIGITS_RE.findall(residual))  # digits glued to words or dots ("12...13")
    if len(values) + stray > 1 and (plain or _HEDGE_RE.search(residual)):
        return AnswerReading("hedge", tuple(values), percent, text)
    if plain:
        return AnswerReading("number", tuple(values), percent, text)
    return AnswerReading("expression", tuple(values), percent, text)


def read_answer(answer: str) -> AnswerReading:
    """Read an answer as numbers: one number, a hedge, an expression, or no digit at all.

    The answer goes through the normalisation of the module docstring (Unicode, LaTeX, currency,
    thousands separators, mixed numbers, scientific notation, unit exponents); then its numbers
    (``12``, ``-3.5``, ``7/4``, ``\\frac{7}{4}``, ``50%``) are found and what is left around them
    decides the kind (see the module's grading policy).

    Args:
        answer: An answer string (a mark's raw text, or a reference answer).

    Returns:
        The :class:`AnswerReading`.

    Raises:
        TypeError: If ``answer`` is not a ``str``.
    """
    if not isinstance(answer, str):
        raise TypeError(f"answer must be a str, got {type(answer).__name__}")
    return _read_clean(_clean_answer(answer))


def _clean_answer(answer: str) -> str:
    """An answer through every normalisation step of the module docstring."""
    return _latex_clean(_strip_wrappers(_unicode_normalize(answer)))


# --------------------------------------------------------------------------- equations

MAX_EQUATION_CHARS = 300
"""Answers longer than this (characters, normalised) are never read as equations."""

_ARITH_SYMBOLS = (("\\times", "*"), ("\\cdot", "*"), ("×", "*"), ("·", "*"), ("\\div", "/"),
                  ("÷", "/"))  # fmt: skip
_ARITH_CHARS = frozenset("0123456789 \t.+-*/()^{}")
_EXPR_FRAC_RE = re.compile(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_EXPR_NUMBER_RE = re.compile(r"\d+(?:\.\d+)?|\.\d+")
_EXPR_LEFTOVER_RE = re.compile(r"[^\s_\d+\-*/()]")
_NOT_EQUATION_RE = re.compile(r"[<>!=]=|=[=<>]|\\[a-zA-Z]*eq\b")
_LABEL_RE = re.compile(r"[A-Za-z_ \t]+")
_MAX_POWER = 64
_MAX_BITS = 4096


class _NotArithmetic(Exception):
    """An expression :func:`_eval_arithmetic` does not evaluate."""


def _arith_symbols(s: str) -> str:
    """``\\times \\cdot × ·`` -> ``*``, ``\\div ÷`` -> ``/`` and ``\\frac{a}{b}`` -> ``((a)/(b))``."""
    for symbol, op in _ARITH_SYMBOLS:
        s = s.replace(symbol, op)
    for _ in range(3):  # nested \frac
        new = _EXPR_FRAC_RE.sub(r"((\1)/(\2))", s)
        if new == s:
            break
        s = new
    return s


def _eval_node(node: ast.AST, values: list[Fraction]) -> Fraction:
    """Exact value of a parsed arithmetic expression (``+ - * / ^``, parentheses, numbers)."""
    if isinstance(node, ast.Name) and node.id[1:].isdigit():
        return values[int(node.id[1:])]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _eval_node(node.operand, values)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval_node(node.left, values), _eval_node(node.right, values)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Div) and right != 0:
            return left / right
        if (
            isinstance(node.op, ast.Pow)
            and right.denominator == 1
            and abs(right) <= _MAX_POWER
            and not (left == 0 and right < 0)
            and max(abs(left.numerator), left.denominator).bit_length() * abs(right) <= _MAX_BITS
        ):
            return left ** int(right)
    raise _NotArithmetic(ast.dump(node))


def _eval_arithmetic(expr: str) -> Fraction | None:
    """The exact value of a purely numeric arithmetic expression (``"7 * 100"``, ``"12 - 5"``,
    ``"(3 + 4) \\times 2"``, ``"\\frac{6}{4} + 1"``, ``"2^3"``), or None when ``expr`` is
    anything else (letters, a function, two numbers side by side, a division by zero, a huge
    power). ``expr`` is normalised text (:func:`_latex_clean`). Never calls ``eval``."""
    s = _arith_symbols(expr).replace("{", "(").replace("}", ")").replace("^", "**")
    values: list[Fraction] = []

    def placeholder(m: re.Match[str]) -> str:
        values.append(Fraction(m.group(0)))
        return f" _{len(values) - 1} "

    s = _EXPR_NUMBER_RE.sub(placeholder, s)
    if not values or _EXPR_LEFTOVER_RE.search(s):
        return None
    try:
        return _eval_node(ast.parse(s.strip(), mode="eval").body, values)
    except (SyntaxError, _NotArithmetic, ZeroDivisionError, OverflowError, RecursionError):
        return None


def _arithmetic_tail(side: str) -> str | None:
    """The arithmetic expression at the end of the first side of an equation, after words
    without digits (``"The total is 7 * 100"`` -> ``"7 * 100"``); None when there is none or the
    words hold a digit or touch the expression (``"x+3"``, ``"2x + 3"``)."""
    s = _arith_symbols(side)
    i = len(s)
    while i > 0 and s[i - 1] in _ARITH_CHARS:
        i -= 1
    head, expr = s[:i], s[i:].strip()
    if not expr or expr[0] not in "0123456789(.-" or any(c.isdigit() for c in head):
        return None
    if head and not s[i].isspace():
        return None  # a letter glued to the expression: "x+3", "2x"
    return expr


@dataclass(frozen=True)
class _Equation:
    """An answer of the form ``expr = value`` (:func:`_read_equation`)."""

    holds: bool
    value_text: str
    reading: AnswerReading


def _rounding_tolerance(value_text: str) -> Fraction:
    """Half a unit of the last decimal place the value is written with (``"3.33"`` -> 0.005), 0
    for a value without decimals: ``10 / 3 = 3.33`` holds, ``7 / 2 = 3`` does not."""
    m = _LITERAL_RE.search(value_text)
    if m is None or m.group("num") is None or "." not in m.group("num") or m.group("den"):
        return Fraction(0)
    places = len(m.group("num").split(".", 1)[1])
    return Fraction(1, 2 * 10**places)


def _read_equation(clean: str) -> _Equation | None:
    """Read a normalised answer as an equation ``expr = value`` (grading policy, *Equations*).

    The text is split at ``=``; the last side is the value (one number, with words or units
    around it: ``"7 apples"``), every other side an arithmetic expression (the first may follow
    words without digits, and a first side of words only is a label: ``"total = 3 + 4 = 7"``).
    Returns None when the answer is not such an equation (no ``=``, ``<=`` / ``==`` / ``\\neq``,
    a side that is not arithmetic, a value that is not one number); otherwise whether every side
    evaluates to the value (a value written with decimals may be rounded to them)."""
    if "=" not in clean or len(clean) > MAX_EQUATION_CHARS or _NOT_EQUATION_RE.search(clean):
        return None
    *sides, value_text = (part.strip() for part in clean.split("="))
    if len(sides) > 1 and _LABEL_RE.fullmatch(sides[0]):
        sides = sides[1:]  # "total = 3 + 4 = 7"
    if not value_text or not all(sides):
        return None
    reading = _read_clean(value_text)
    if reading.kind != "number" or reading.percent:
        return None
    first = _arithmetic_tail(sides[0])
    if first is None:
        return None
    values = [_eval_arithmetic(expr) for expr in [first, *sides[1:]]]
    if any(v is None for v in values):
        return None
    tolerance = _rounding_tolerance(value_text)
    holds = all(abs(v - reading.values[0]) <= tolerance for v in values)  # type: ignore[operator]
    return _Equation(holds, value_text, reading)


_HEAD_OPERATOR_RE = re.compile(r"[+*/^]|[\d)]\s*-")
_OPERATOR_WORD_RE = re.compile(
    r"\b(?:x|X|times|plus|minus|by|of|over|divided|multiplied|squared|cubed)\W*$"
)


def _equation_head(line: str) -> str | None:
    """The ``expr =`` (or ``expr = expr =``) that ends ``line`` (the text before the last-number
    run on its line), or None: the last-number fallback keeps an equation whole."""
    s = _arith_symbols(line)
    i = len(s.rstrip())
    if not s[:i].endswith("="):
        return None
    while i > 0 and (s[i - 1] in _ARITH_CHARS or s[i - 1] == "="):
        i -= 1
    head = s[i:].lstrip()
    if not head or head[0] not in "0123456789(.-" or (i > 0 and not s[i].isspace()):
        return None
    if _HEAD_OPERATOR_RE.search(head) is None or _OPERATOR_WORD_RE.search(s[max(0, i - 40) : i]):
        return None  # "7 = 21" of "3 times 7 = 21", "3 x 7 = 21": only part of the equation
    return head


_RUN_GAP_RE = re.compile(
    r"[ \t]*(?:[,;&|~–—-][ \t]*)?(?:(?:or|and|to|vs\.?|versus|through)[ \t]+)?",
    re.IGNORECASE,
)
_OR_GAP_RE = re.compile(r"[^\n\d]{0,30}", re.IGNORECASE)
_OR_RE = re.compile(r"\bor\b", re.IGNORECASE)


def _last_number_run(text: str) -> str | None:
    """The last-number fallback: the last number of ``text`` (Unicode-normalised) with the numbers
    joined to it as a list or as alternatives on the same line, as one string; None if no
    number."""
    clean = _latex_clean(text)
    literals = [m for m in _LITERAL_RE.finditer(clean)]
    if not literals:
        return None
    first = len(literals) - 1
    while first > 0:
        gap = clean[literals[first - 1].end() : literals[first].start()]
        joined = _RUN_GAP_RE.fullmatch(gap) is not None or (
            _OR_GAP_RE.fullmatch(gap) is not None and _OR_RE.search(gap) is not None
        )
        if not joined:
            break
        first -= 1
    start, end = literals[first].start(), literals[-1].end()
    head = _equation_head(clean[clean.rfind("\n", 0, start) + 1 : start])
    if head is not None and _read_equation(head + clean[start:end]) is not None:
        return (head + clean[start:end]).strip()  # "5 * 8 = 41": graded as an equation
    return clean[start:end].strip()


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


def _canonical(value: Fraction) -> str:
    """An exact string of ``value`` for math-verify: a finite decimal, else ``\\frac{p}{q}``."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den == 1:
        digits = len(str(value.numerator)) + len(str(value.denominator)) + 5
        with localcontext() as ctx:
            ctx.prec = digits
            return format((Decimal(value.numerator) / Decimal(value.denominator)).normalize(), "f")
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _value_variants(reading: AnswerReading) -> list[Fraction]:
    value = reading.values[0]
    return [value, value / 100] if reading.percent else [value]


def _numbers_match(pred: AnswerReading, gold: AnswerReading, timeout: int | None) -> bool:
    """One number against a numeric reference: exact equality, else math-verify on the exact
    strings (percent variants on both sides)."""
    for g in _value_variants(gold):
        gold_parsed = None
        for p in _value_variants(pred):
            if p == g:
                return True
            if gold_parsed is None:
                gold_parsed = _parse(_canonical(g), timeout)
            target = _parse(_canonical(p), timeout)
            if gold_parsed and target and verify(gold_parsed, target, timeout_seconds=timeout):
                return True
    return False


def _single_number(parsed: list[Any]) -> bool:
    """Whether math-verify's parse is one number (a sympy expression without free symbols)."""
    if not parsed:
        return False
    expr = parsed[0]
    return isinstance(expr, sympy.Expr) and not expr.free_symbols


def _general_match(predicted: str, reference: str, timeout: int | None) -> bool:
    """The comparison for a reference that is not a single number (module docstring)."""
    pred_norm, ref_norm = normalize_answer(predicted), normalize_answer(reference)
    if not pred_norm or not ref_norm:
        return False
    if _HEDGE_WORDS_RE.search(pred_norm) and not _HEDGE_WORDS_RE.search(ref_norm):
        return False
    if pred_norm == ref_norm:
        return True
    if (
        "\\" not in pred_norm + ref_norm
        and not any(c.isdigit() for c in pred_norm + ref_norm)
        and " ".join(pred_norm.casefold().split()) == " ".join(ref_norm.casefold().split())
    ):
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


def _grade_numeric(raw: str, gold: AnswerReading, timeout: int | None) -> str:
    """Reason (see :class:`Verdict`) for one answer against a numeric reference."""
    equation = _read_equation(_clean_answer(raw))
    if equation is not None:
        if not equation.holds:
            return "false_equation"
        return "correct" if _numbers_match(equation.reading, gold, timeout) else "wrong"
    reading = read_answer(raw)
    if reading.kind == "hedge":
        return "hedge"
    if reading.kind == "number":
        return "correct" if _numbers_match(reading, gold, timeout) else "wrong"
    if is_unevaluated_expression(reading.text):
        return "unevaluated"
    if reading.kind == "empty" and not reading.text:
        return "no_answer"
    target = _parse(reading.text, timeout)
    if not _single_number(target):
        return "wrong"
    for g in _value_variants(gold):
        gold_parsed = _parse(_canonical(g), timeout)
        if gold_parsed and verify(gold_parsed, target, timeout_seconds=timeout):
            return "correct"
    return "wrong"


def _grade_general(raw: str, reference: str, timeout: int | None) -> str:
    """Reason (see :class:`Verdict`) for one answer against a non-numeric reference."""
    equation = _read_equation(_clean_answer(raw))
    if equation is not None:
        if not equation.holds:
            return "false_equation"
        raw = equation.value_text
    if is_unevaluated_expression(_latex_clean(_unicode_normalize(raw))):
        return "unevaluated"
    if _HEDGE_WORDS_RE.search(normalize_answer(raw)) and not _HEDGE_WORDS_RE.search(
        normalize_answer(reference)
    ):
        return "hedge"
    return "correct" if _general_match(raw, reference, timeout) else "wrong"


def _numeric_reference(reference: str) -> AnswerReading | None:
    """The reading of a reference that is a single number, else None."""
    if len(reference) > MAX_ANSWER_CHARS:
        return None
    gold = read_answer(reference)
    return gold if gold.kind == "number" and len(gold.values) == 1 else None


def _grade_answers(answers: list[str], reference: str, timeout: int | None) -> Verdict:
    """Grade the marks of one response: every mark must be right (module docstring)."""
    if not answers:
        return Verdict(False, "no_answer")
    gold = _numeric_reference(reference)
    numeric = gold is not None
    if numeric:
        with_digits = [a for a in answers if any(c.isdigit() for c in _unicode_normalize(a))]
        answers = with_digits or answers[-1:]
    reasons = []
    for raw in answers:
        if len(raw) > MAX_ANSWER_CHARS or len(reference) > MAX_ANSWER_CHARS:
            reasons.append("correct" if raw.strip() == reference.strip() else "too_long")
        elif numeric:
            reasons.append(_grade_numeric(raw, gold, timeout))  # type: ignore[arg-type]
        else:
            reasons.append(_grade_general(raw, reference, timeout))
    bad = [r for r in reasons if r != "correct"]
    if not bad:
        return Verdict(True, "correct", tuple(answers))
    if len(answers) > 1 and "correct" in reasons and "false_equation" not in bad:
        return Verdict(False, "hedge", tuple(answers))  # right once, wrong elsewhere
    return Verdict(False, bad[0], tuple(answers))


def _with_timeout(fn: Callable[[int | None], Verdict]) -> Verdict:
    """Run ``fn(timeout)`` with math-verify's timeout in the main thread, none elsewhere; any
    error is a wrong answer (logged at debug level)."""
    try:
        if _in_main_thread():
            with _keep_outer_alarm():
                return fn(MAIN_THREAD_TIMEOUT_S)
        return fn(None)
    except Exception:  # noqa: BLE001 - weird model output must never crash a reward
        logger.debug("answer comparison failed", exc_info=True)
        return Verdict(False, "error")


def answers_match(predicted: str, reference: str) -> bool:
    """Whether one answer string equals the reference, by the grading policy of the module
    docstring (hedges are wrong) and math-verify.

    ``"50%"`` matches both ``"50"`` and ``"0.5"``; ``"1 3/4"`` matches ``"1.75"``; ``"12 or 13"``
    matches nothing. Safe in any thread (see the module docstring about timeouts).

    Args:
        predicted: The model's answer (already extracted, e.g. :attr:`ExtractedAnswer.raw`).
        reference: The reference answer.

    Returns:
        True when equal; False when different, a hedge, unparsable, empty, or on any internal
        error.

    Raises:
        TypeError: If either argument is not a ``str``.
    """
    for name, value in (("predicted", predicted), ("reference", reference)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return _with_timeout(lambda t: _grade_answers([predicted], reference, t)).correct


def grade(response: str, reference: str) -> Verdict:
    """Grade a response against a reference answer, with the reason (module grading policy).

    The marks are found with :func:`extract_answers`; each must equal the reference.

    Args:
        response: The model's response text (any string).
        reference: The reference answer (e.g. ``Sample.answer``).

    Returns:
        The :class:`Verdict`; never raises on odd response content.

    Raises:
        TypeError: If ``response`` or ``reference`` is not a ``str``.
    """
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    if not isinstance(reference, str):
        raise TypeError(f"reference must be a str, got {type(reference).__name__}")

    def run(timeout: int | None) -> Verdict:
        numeric = _numeric_reference(reference) is not None
        answers = [a.raw for a in _final_answers(response, numeric)]
        return _grade_answers(answers, reference, timeout)

    return _with_timeout(run)


def is_correct(response: str, reference: str) -> bool:
    """Whether the final answer of ``response`` equals ``reference`` (``grade(...).correct``).

    Examples: ``\\frac{1}{2}`` = ``0.5`` = ``1/2``, ``"1,000"`` = ``"1 000"`` = ``"1000"``,
    ``"$18.00"`` = ``"18"`` = ``"18 dollars"``, ``"43.0"`` = ``"43"``, ``"50%"`` = ``"50"``,
    ``"1 3/4"`` = ``"1.75"``, ``"2e3"`` = ``"2000"``; ``"12 or 13"`` equals nothing.

    Args:
        response: The model's response text (any string).
        reference: The reference answer (e.g. ``Sample.answer``).

    Returns:
        True when the answers match. False otherwise, including empty or unparsable output;
        never raises on odd response content.

    Raises:
        TypeError: If ``response`` or ``reference`` is not a ``str``.
    """
    return grade(response, reference).correct


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
    letters (``x^2+2x+1``, ``\\sqrt{2}+1``) are values. Scientific notation (``4 \\times 10^{5}``)
    is a value: it is rewritten to a plain number before this check.
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
      ``"**Answer:**"`` allowed) followed by a value (a number, words or an expression: word
      answers of reasoning-gym tasks count), or
    * it ends with a non-empty ``<answer>...</answer>`` (reasoning-gym's format).

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
    if lines and _FINAL_ANSWER_LINE_RE.match(lines[-1].strip()) is not None:
        return True
    opens = list(_XML_OPEN_RE.finditer(response))
    if not opens:
        return False
    tail = response[opens[-1].end() :].rstrip()
    closed = tail[-len("</answer>") :].lower() == "</answer>"
    return closed and bool(tail[: -len("</answer>")].strip())


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


_RG_QUOTES = "\"'`"


def _rg_candidates(raw: str) -> list[str]:
    """One mark's text as given to a reasoning-gym scorer: raw, then lightly cleaned (math
    delimiters, whole ``\\boxed{}``, ``\\text{}``, markdown ``**``, surrounding quotes and a
    trailing period removed)."""
    out = [raw]
    s = _strip_wrappers(raw)
    s = _TEXT_CMD_RE.sub(lambda m: m.group(1), s).strip().strip("*").strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in _RG_QUOTES:
        s = s[1:-1].strip()
    s = s.rstrip(".").strip()
    if s and s not in out:
        out.append(s)
    return out


def _rg_correctness(response: str, sample: Sample) -> float:
    """reasoning-gym's own scorer on the response's marks: each mark is scored raw and lightly
    cleaned (the better of the two counts), and the response gets the lowest score of its marks
    (every mark must be right, as in :func:`grade`). Marks are read from the response as written
    (no Unicode normalisation: word answers are compared by the task's own scorer)."""
    entry = sample.metadata["rg_entry"]
    if not isinstance(entry, dict):
        raise ValueError(
            f"sample {sample.id!r}: metadata['rg_entry'] must be a dict, got {type(entry).__name__}"
        )
    scorer = _rg_scorer(_rg_task(sample))
    chosen = [a.raw for a in _final_answers(response, numeric=False, normalize=False)]
    if not chosen:
        score = float(scorer(None, entry))
    else:
        score = min(max(float(scorer(c, entry)) for c in _rg_candidates(raw)) for raw in chosen)
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
    ``get_score_answer_fn(task)(answer, entry)`` is applied to each final-answer mark (``Answer:
    <words>``, ``\\boxed{}``, ``<answer></answer>``; it can give partial credit) and the lowest
    mark score counts. Otherwise 1.0 if :func:`is_correct` against ``sample.answer`` (the module's
    grading policy), else 0.0.

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
    # the preference-shift task's style judge (conveyor.rewards.styles; its model loads lazily)
    "style": style_reward,
}


def load_reward_fn(path: str) -> RewardFn:
    """Resolve a reward function by name or import path.

    Accepted forms: a built-in name (``"math"``, ``"correctness"``, ``"format"``, ``"style"``, see
    :data:`BUILTIN_REWARD_FNS`), ``"package.module:function"`` (the part after the colon may
    be dotted, e.g. ``"pkg.mod:Class.method"``) or ``"package.module.function"``.

    Args:
        path: The name or import path.

    Returns:
        The callable (its signature is not checked; it must accept ``(response, sample)``).

    Raises:
        ValueError: If ``path`` is empty or malformed, its module cannot be imported (the message
            says how to put its folder on ``PYTHONPATH``), names a ``.py`` file instead of a
            module, the attribute does not exist, or it is not callable. The message names
            ``path``; the original exception is chained.
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
    if module_name.endswith(".py"):  # a file name given for a module name
        fixed = f"{module_name[:-3]}:{attr_path}"
        raise ValueError(f"reward function {path!r}: {module_name!r} is a file name; give the module's name "
                         f"without .py: {fixed!r} (its folder on PYTHONPATH, e.g. PYTHONPATH=. conveyor train "
                         f"reward.fn={fixed})")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ValueError(
                f"reward function {path!r}: module {module_name!r} not found: its folder must be on the "
                "module search path (the conveyor command does not search the working directory: "
                f"PYTHONPATH=. conveyor train reward.fn={path} from the folder of {module_name.split('.')[0]}.py, "
                "or pip install your package)"
            ) from exc
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


def check_reward_signature(fn: Any, path: str) -> None:
    """Refuse a reward function that cannot be called as ``fn(response, sample)``.

    Checked once at start (``inspect.signature(fn).bind``), so a wrong signature is a clear
    error instead of every reward of the run failing. Callables whose signature Python cannot
    read (some C functions) pass unchecked.

    Args:
        fn: The callable :func:`load_reward_fn` returned.
        path: Its name or import path, for the message (``reward.fn``).

    Raises:
        ValueError: ``fn`` does not accept two positional arguments (response, sample); the
            message names ``reward.fn`` and the signature.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind("response", "sample")
    except TypeError as exc:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise ValueError(
            f"reward.fn={path!r}: {name}{sig} cannot be called as fn(response: str, sample: "
            f"conveyor.types.Sample) -> float ({exc})"
        ) from exc
