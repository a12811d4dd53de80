"""Dataset registry: turn a spec string into a list of :class:`~conveyor.types.Sample`.

A *spec* names a data set; it is what a config file or the command line passes around. Grammar::

    <name>[:train|:heldout]             vendored set (see list_datasets())
    rg:<task>[:train|:heldout][?key=value&...]
                                        reasoning-gym procedural task
    file:<path>[?question=F&answer=F&split=train|heldout]
    <path ending in .jsonl/.json/.parquet>[?...]   same as file:<path>
    hf:<directory>[:<split>][?question=F&answer=F&split=train|heldout]
                                        Hugging Face dataset on disk (read offline)
    guess[:train|:heldout][?size=N&high=H&seed=S]
                                        guess-the-number games (env.name=guess)

Vendored sets (files under ``conveyor/data/files``, described in its README.md):

==================  =====  ====================================================================
spec                rows   question / answer
==================  =====  ====================================================================
gsm8k:train         7473   ``question`` / number after ``####`` in ``answer``, commas removed
gsm8k:test          1319   same
mawps:addsub        395    ``input`` / ``target`` formatted by :func:`format_number`
mawps:singleop      562    same
mawps:singleeq      508    same
mawps:multiarith    600    same
mawps:all           1977   the four above concatenated, identical questions deduplicated
svamp               1000   ``Body + " " + Question`` (Body ends with ".", added if missing)
                           / ``Answer`` formatted by format_number
aime24              30     ``problem`` / ``answer`` (leading zeros dropped: "025" -> "25")
amc23               40     ``question`` / ``answer`` formatted by format_number
styles              100    ``prompt`` / ``""`` (no reference: writing prompts for the preference-
                           shift task, judged by :mod:`conveyor.rewards.styles`)
critic_mix          160    80 one-step sums in words (``question`` / ``answer``) and 80 MAWPS
                           multiarith rows (as mawps): a task where a value is learnable (issue 45)
==================  =====  ====================================================================

Splits. gsm8k has its own train/test files. Every other vendored set (and any ``file:`` or
``hf:`` set via ``?split=``) gets a deterministic train / held-out split: ``<name>:train`` and ``<name>:heldout``;
``<name>`` alone is every row in file order. Rows are grouped by their whitespace-normalised
question so identical questions never straddle the split; each distinct question gets the rank
``sha256(f"{split_seed}\\0{question}")`` and the ``round(heldout_fraction * n_distinct)`` lowest
ranked questions are held out. The split of a question therefore depends only on
``(split_seed, question text)`` (not on Python / numpy versions, nor on the other rows), the two
parts are disjoint and together cover every row, and each part is listed in rank order (so
``limit=N`` takes a seeded random subset, not the head of the file).

reasoning-gym (``rg:``). Options after ``?`` are ``size`` (rows, default 500), ``seed`` (generator
seed, default 0; never random) and any field of the task's config dataclass; values are parsed as
bool (``true``/``false``), int, float, else str (``+`` stays ``+``; use ``%xx`` escapes for ``&``,
``=``, ``#``). The same options may be given as keyword arguments ``rg_size``, ``rg_seed``,
``rg_config`` (needed for list / tuple values); a key given both ways with different values is an
error. The data is ``reasoning_gym.create_dataset(task, size=size, seed=seed, **config)``.
reasoning-gym seeds item ``i`` with ``Random(seed + i)``, so ``seed=0`` and ``seed=1`` share all but
one item: to get different data move the seed by more than ``size``. ``rg:<task>:train`` (and plain
``rg:<task>``) uses ``seed``; ``rg:<task>:heldout`` uses ``seed + RG_HELDOUT_SEED_OFFSET`` (10**9),
so the two never share a generator seed while ``size`` < 10**9 (identical questions can still occur
for tasks with few distinct problems). ``split_seed`` and ``heldout_fraction`` do not apply.
Each sample's ``metadata`` holds ``rg_task``, ``rg_seed`` and the original ``rg_entry`` so a reward
can call ``reasoning_gym.get_score_answer_fn(task)(answer, entry)``.

User files (``file:``). JSONL (one object per line, blank lines ignored), JSON (a top-level array
of objects; any other ``.json`` content is read as JSONL) or Parquet. The question field is
``?question=`` or the first present of ``question, problem, input, prompt``; the answer field is
``?answer=`` or the first present of ``answer, target, Answer, solution``. A malformed row
(invalid JSON, not an object, missing field, question not a non-empty string, answer not a
string or finite number) raises :class:`DatasetError` naming the file, the 1-based line (JSONL),
item (JSON) or row (Parquet) and the field; with ``skip_malformed=True`` it is skipped and listed
in :attr:`DatasetLoad.skipped`.

Hugging Face datasets (``hf:``). ``<directory>`` is a dataset saved with
``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (read with ``datasets.load_from_disk``) or
a local dataset repository: a directory of data files (JSONL, JSON, CSV, Parquet, ...) that
``datasets.load_dataset(directory)`` reads. ``:<split>`` names the dataset's own split (e.g.
``:train``, ``:test``); it is required when a ``DatasetDict`` has more than one. The rows then go
through exactly the ``file:`` path: the same field mapping (``?question=`` / ``?answer=`` or the
default field names), malformed-row errors (``row`` numbers) and the seeded ``?split=train|heldout``
on top of the chosen split. Nothing is ever downloaded: the loader runs with
``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1`` and a path that does not exist locally (e.g. a Hub
id such as ``HuggingFaceH4/MATH-500``) is a :class:`DatasetError` that says how to save the dataset first.

Guess-the-number (``guess``): ``size`` games (default 200) whose secret, in ``answer``, is drawn
uniformly from ``[1, high]`` (default 100) by ``random.Random(seed)`` (default 0;
:func:`conveyor.envs.guess.guess_samples`); ``guess:heldout`` uses ``seed +
RG_HELDOUT_SEED_OFFSET``. The question states the range; ``metadata["high"]`` carries it to the
environment (:class:`conveyor.envs.guess.GuessNumberEnv`). No instruction is appended. With
``env.name=guess`` an explicit ``env.options.high`` is written into a guess spec without ``high=``
(``guess:train`` -> ``guess:train?high=10``; :func:`conveyor.envs.guess.guess_spec_for`).

Ids. ``Sample.id = f"{spec_without_query}/{row}"`` with ``row`` the 0-based position of the row in
its source file (JSONL: line number - 1, so ids do not move when a malformed row is skipped);
``mawps:all`` ids name the subset: ``"mawps:all/singleop/17"``. ``Sample.dataset`` is the spec as
given. ``metadata`` holds ``source`` (file), ``row`` and, for vendored and user files, ``fields``:
the row's other columns (gsm8k: ``solution``, the worked answer text).

Instruction and answer format. Each source has an answer kind and a default instruction
(:func:`source_format`): the numeric sets ask for "the final answer as a number after
'Answer:'", reasoning-gym tasks for "the final answer after 'Answer:', in the form the question
asks for" (their answers are often words, graded by the task's own scorer), user files for "the
final answer after 'Answer:'". ``data.instruction`` uses it unless the config sets one.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote

from conveyor.types import Sample

__all__ = [
    "DATA_DIR",
    "HELDOUT_FRACTION",
    "RG_DEFAULT_SEED",
    "RG_DEFAULT_SIZE",
    "RG_HELDOUT_SEED_OFFSET",
    "GUESS_DEFAULT_SIZE",
    "INSTRUCTION_MATH",
    "INSTRUCTION_NUMBER",
    "INSTRUCTION_TEXT",
    "DatasetError",
    "DatasetLoad",
    "SourceFormat",
    "default_instruction",
    "format_number",
    "list_datasets",
    "load_dataset",
    "load_dataset_report",
    "parse_gsm8k_answer",
    "source_format",
]

DATA_DIR: Path = Path(__file__).with_name("files")
"""Folder of the vendored data files (shipped as package data)."""

HELDOUT_FRACTION: float = 0.2
"""Default share of distinct questions held out by ``:heldout`` splits."""

RG_DEFAULT_SIZE: int = 500
"""Default number of reasoning-gym rows (reasoning-gym's own default)."""

RG_DEFAULT_SEED: int = 0
"""Default reasoning-gym generator seed (fixed, so a spec always means the same data)."""

RG_HELDOUT_SEED_OFFSET: int = 10**9
"""Added to the reasoning-gym seed for ``rg:<task>:heldout``."""

_SPLITS = ("train", "heldout")
_QUESTION_FIELDS = ("question", "problem", "input", "prompt")
_ANSWER_FIELDS = ("answer", "target", "Answer", "solution")
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
_FILE_OPTIONS = ("question", "answer", "split")
_HF_SAVE_HINT = (
    "python -c \"import datasets; datasets.load_dataset('HuggingFaceH4/MATH-500')"
    ".save_to_disk('/data/math500')\" (on a machine with network access), then "
    "hf:/data/math500:test"
)
_MAWPS_SUBSETS = ("addsub", "singleop", "singleeq", "multiarith")


class DatasetError(ValueError):
    """A data set spec, option or data row is invalid.

    The message names what is wrong: the spec and option, or the file, the 1-based line / item /
    row and the field.
    """


@dataclass(frozen=True)
class DatasetLoad:
    """Result of :func:`load_dataset_report`.

    Attributes:
        spec: The spec as given.
        samples: The loaded samples (after split and ``limit``).
        skipped: ``(line, reason)`` for every malformed row skipped with ``skip_malformed=True``;
            ``line`` is the 1-based line (JSONL), item (JSON array) or row (Parquet) number.
    """

    spec: str
    samples: list[Sample]
    skipped: list[tuple[int, str]] = field(default_factory=list)


class _RowError(Exception):
    """A single row cannot be turned into a sample (internal; becomes DatasetError or a skip)."""


# --------------------------------------------------------------------------------------------
# Instruction and answer format per data source

AnswerKind = Literal["number", "math", "text"]

INSTRUCTION_NUMBER: str = "Give the final answer as a number after 'Answer:'."
"""Default instruction of the numeric sets (gsm8k, mawps, svamp, aime24, amc23)."""

INSTRUCTION_MATH: str = "Give the final answer after 'Answer:'."
"""Default instruction of user files (``file:``): answers may be numbers or expressions."""

INSTRUCTION_TEXT: str = "Give the final answer after 'Answer:', in the form the question asks for."
"""Default instruction of reasoning-gym tasks: answers may be words, lists, letters or numbers,
in the format the task's question states."""

INSTRUCTION_STYLES: str = "Answer in two or three sentences."
"""Default instruction of the ``styles`` writing prompts (the preference-shift task): a length,
never the target style, which the policy must learn from the judge's 0/1 reward
(:mod:`conveyor.rewards.styles`)."""

_NUMBER_SOURCES = ("gsm8k", "mawps", "svamp", "aime24", "amc23", "critic_mix")


@dataclass(frozen=True)
class SourceFormat:
    """How a data source's answers are asked for and graded (:func:`source_format`).

    Attributes:
        answer_kind: ``"number"`` (every reference is one number), ``"math"`` (numbers or
            expressions, compared by math-verify) or ``"text"`` (words, lists, letters or numbers;
            reasoning-gym's own scorer decides).
        instruction: The default instruction appended to each question (``data.instruction``
            when the config does not set one).
        scorer: ``"math"`` (:func:`conveyor.rewards.is_correct`, the grading policy of
            :mod:`conveyor.rewards.math`), ``"reasoning-gym"`` (the task's
            ``score_answer``, applied to the marks of the response) or ``"style"`` (no answer:
            the style judge of :mod:`conveyor.rewards.styles`, ``reward.fn=style``).
    """

    answer_kind: AnswerKind
    instruction: str
    scorer: Literal["math", "reasoning-gym", "style"]


def source_format(spec: str) -> SourceFormat:
    """The answer format and default instruction of the data source named by ``spec``.

    ================================  ==========  ============================================
    spec                              kind        default instruction
    ================================  ==========  ============================================
    gsm8k, mawps, svamp, aime24,      number      :data:`INSTRUCTION_NUMBER` ("... as a number
    amc23, critic_mix (any split)                 after 'Answer:'.")
    ``rg:<task>``                     text        :data:`INSTRUCTION_TEXT` (no "as a number":
                                                  reasoning-gym answers are often words)
    ``styles`` (any split)            text        :data:`INSTRUCTION_STYLES` (writing prompts,
                                                  no answer; scorer ``style``)
    ``file:`` / a data file path /    math        :data:`INSTRUCTION_MATH`
    ``hf:``
    ``guess`` (any split)             number      none (``""``: the game explains itself)
    anything else                     math        :data:`INSTRUCTION_MATH`
    ================================  ==========  ============================================

    Only the spec is read (no file is opened, reasoning-gym is not imported), so this never
    fails on a spec that :func:`load_dataset` would reject; that error comes from loading.

    Args:
        spec: A data set spec (see the module docstring), e.g. ``"mawps:singleop:train"``,
            ``"rg:spell_backward?size=100"``, ``"file:/data/x.jsonl"``.

    Returns:
        The :class:`SourceFormat`.

    Raises:
        TypeError: If ``spec`` is not a str.
    """
    if not isinstance(spec, str):
        raise TypeError(f"dataset spec must be a str, got {type(spec).__name__}")
    base = spec.strip().partition("?")[0]
    if base.startswith("rg:"):
        return SourceFormat("text", INSTRUCTION_TEXT, "reasoning-gym")
    if base.split(":", 1)[0] == "styles":
        return SourceFormat("text", INSTRUCTION_STYLES, "style")
    if base.split(":", 1)[0] == "guess":  # the environment explains the game: no instruction
        return SourceFormat("number", "", "math")
    if base.split(":", 1)[0] in _NUMBER_SOURCES:
        return SourceFormat("number", INSTRUCTION_NUMBER, "math")
    return SourceFormat("math", INSTRUCTION_MATH, "math")


def default_instruction(spec: str) -> str:
    """``source_format(spec).instruction``: the instruction used when ``data.instruction`` is not
    set (see :func:`source_format`).

    Raises:
        TypeError: If ``spec`` is not a str.
    """
    return source_format(spec).instruction


# --------------------------------------------------------------------------------------------
# Answer formatting


def format_number(value: int | float | Decimal) -> str:
    """Format a numeric answer as the shortest exact decimal string, without a trailing ``.0``.

    Examples: ``43.0 -> "43"``, ``2.5 -> "2.5"``, ``-1.0 -> "-1"``, ``1e-07 -> "0.0000001"``.

    Args:
        value: An int, float or Decimal (bool is rejected).

    Returns:
        The decimal string (never in exponent notation).

    Raises:
        TypeError: If ``value`` is not an int, float or Decimal (or is a bool).
        ValueError: If ``value`` is NaN or infinite.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
        raise TypeError(
            f"format_number: expected int, float or Decimal, got {type(value).__name__}"
        )
    if isinstance(value, int):
        return str(value)
    dec = Decimal(repr(value)) if isinstance(value, float) else value
    if not dec.is_finite():
        raise ValueError(f"format_number: value must be finite, got {value!r}")
    if dec == dec.to_integral_value():
        return str(int(dec))
    return format(dec.normalize(), "f")


def parse_gsm8k_answer(text: str) -> str:
    """Extract the final answer of a GSM8K ``answer`` field: the text after ``####``, commas removed.

    Example: ``"... so 1,000 in total.\\n#### 1,000" -> "1000"``.

    Args:
        text: The GSM8K ``answer`` string (worked solution, then ``#### <number>``).

    Returns:
        The final answer, stripped, without thousands separators.

    Raises:
        ValueError: If ``text`` has no ``####`` marker or nothing after it.
    """
    if "####" not in text:
        raise ValueError("GSM8K answer has no '####' marker")
    final = text.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise ValueError("GSM8K answer is empty after '####'")
    return final


def _answer_text(value: Any, field_name: str) -> str:
    """Answer value -> string; raises _RowError naming ``field_name`` if unusable."""
    if isinstance(value, str):
        text = value.strip()
        if not text:
            raise _RowError(f"field {field_name!r}: answer is an empty string")
        return text
    if isinstance(value, int | float | Decimal) and not isinstance(value, bool):
        try:
            return format_number(value)
        except ValueError as exc:
            raise _RowError(f"field {field_name!r}: {exc}") from None
    raise _RowError(
        f"field {field_name!r}: answer must be a string or a number, got {type(value).__name__}"
    )


def _question_text(value: Any, field_name: str) -> str:
    """Question value -> stripped string; raises _RowError naming ``field_name`` if unusable."""
    if not isinstance(value, str):
        raise _RowError(
            f"field {field_name!r}: question must be a string, got {type(value).__name__}"
        )
    text = value.strip()
    if not text:
        raise _RowError(f"field {field_name!r}: question is an empty string")
    return text


def _get(row: dict[str, Any], name: str) -> Any:
    """``row[name]``; raises _RowError naming the field if it is missing or null."""
    if name not in row or row[name] is None:
        keys = ", ".join(sorted(map(str, row))) or "none"
        raise _RowError(f"field {name!r} is missing (fields present: {keys})")
    return row[name]


def _pick(row: dict[str, Any], explicit: str | None, candidates: tuple[str, ...], kind: str) -> str:
    """Name of the field to use for ``kind`` (question / answer) in ``row``."""
    if explicit is not None:
        _get(row, explicit)
        return explicit
    for name in candidates:
        if row.get(name) is not None:
            return name
    null = [name for name in candidates if name in row]
    if null:  # e.g. an hf: dataset, whose every row has every column: the field is there, empty
        raise _RowError(f"field {null[0]!r}: the {kind} is null (empty); fill it in or drop the row")
    keys = ", ".join(sorted(map(str, row))) or "none"
    raise _RowError(
        f"no {kind} field: none of {', '.join(candidates)} is present (fields present: {keys}); "
        f"name it with ?{kind}=<field>"
    )


# --------------------------------------------------------------------------------------------
# Row readers: yield (row index 0-based, 1-based location number, row dict or _RowError)


def _read_rows(path: Path) -> tuple[str, Iterator[tuple[int, int, dict[str, Any] | _RowError]]]:
    """Open ``path`` and return (location word, row iterator). Raises DatasetError if unreadable."""
    if not path.is_file():
        raise DatasetError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return "row", _parquet_rows(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: cannot read as UTF-8 text: {exc}") from None
    if suffix == ".json" and text.lstrip().startswith("["):
        return "item", _json_array_rows(path, text)
    return "line", _jsonl_rows(text)


def _jsonl_rows(text: str) -> Iterator[tuple[int, int, dict[str, Any] | _RowError]]:
    for index, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            yield index, index + 1, _RowError(f"invalid JSON: {exc.msg} (column {exc.colno})")
            continue
        if not isinstance(row, dict):
            yield index, index + 1, _RowError(f"row is a JSON {type(row).__name__}, not an object")
            continue
        yield index, index + 1, row


def _json_array_rows(
    path: Path, text: str
) -> Iterator[tuple[int, int, dict[str, Any] | _RowError]]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path} line {exc.lineno}: invalid JSON: {exc.msg}") from None
    for index, row in enumerate(items):
        if not isinstance(row, dict):
            yield index, index + 1, _RowError(f"item is a JSON {type(row).__name__}, not an object")
            continue
        yield index, index + 1, row


def _parquet_rows(path: Path) -> Iterator[tuple[int, int, dict[str, Any] | _RowError]]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types (ArrowInvalid, OSError, ...)
        raise DatasetError(f"{path}: cannot read as Parquet: {exc}") from None
    for index, row in enumerate(rows):
        yield index, index + 1, row


# --------------------------------------------------------------------------------------------
# Vendored sets


RowMapper = Callable[[dict[str, Any]], tuple[str, str, dict[str, Any]]]


def _map_gsm8k(row: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    question = _question_text(_get(row, "question"), "question")
    solution = _get(row, "answer")
    if not isinstance(solution, str):
        raise _RowError(f"field 'answer': must be a string, got {type(solution).__name__}")
    try:
        answer = parse_gsm8k_answer(solution)
    except ValueError as exc:
        raise _RowError(f"field 'answer': {exc}") from None
    return question, answer, {"solution": solution}


def _map_mawps(row: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    return (
        _question_text(_get(row, "input"), "input"),
        _answer_text(_get(row, "target"), "target"),
        {},
    )


def _map_svamp(row: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    body = _question_text(_get(row, "Body"), "Body")
    if not body.endswith((".", "?", "!")):  # 1 in 3 bodies lacks it (Qwen2.5-Math eval adds it too)
        body += "."
    question = _question_text(_get(row, "Question"), "Question")
    extra = {k: v for k, v in row.items() if k not in ("Body", "Question", "Answer")}
    return body + " " + question, _answer_text(_get(row, "Answer"), "Answer"), extra


def _map_aime24(row: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    answer = _answer_text(_get(row, "answer"), "answer")
    if answer.isdigit():  # AIME answers are integers 0..999 written with leading zeros ("025")
        answer = str(int(answer))
    extra = {k: v for k, v in row.items() if k not in ("problem", "answer", "question")}
    return _question_text(_get(row, "problem"), "problem"), answer, extra


def _map_amc23(row: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    extra = {k: v for k, v in row.items() if k not in ("problem", "answer", "question")}
    return (
        _question_text(_get(row, "question"), "question"),
        _answer_text(_get(row, "answer"), "answer"),
        extra,
    )


def _map_critic_mix(row: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """A row of ``critic_mix``: a one-step sum (``question`` / ``answer``) or a MAWPS multiarith
    row (``input`` / ``target``, as :func:`_map_mawps`)."""
    if "input" in row:
        return _map_mawps(row)
    return _map_amc23(row)


def _map_styles(row: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """A writing prompt of ``styles/prompts.jsonl``: question = ``prompt``, answer = ``""`` (the
    reward is the style judge's verdict, :mod:`conveyor.rewards.styles`, not a reference)."""
    return _question_text(_get(row, "prompt"), "prompt"), "", {}


@dataclass(frozen=True)
class _Builtin:
    """A vendored set: its files (relative to DATA_DIR, with a subset label) and row mapper."""

    files: tuple[tuple[str, str], ...]
    mapper: RowMapper
    splittable: bool = True
    dedupe: bool = False


_BUILTINS: dict[str, _Builtin] = {
    "gsm8k:train": _Builtin((("", "gsm8k/train.jsonl"),), _map_gsm8k, splittable=False),
    "gsm8k:test": _Builtin((("", "gsm8k/test.jsonl"),), _map_gsm8k, splittable=False),
    **{
        f"mawps:{name}": _Builtin((("", f"mawps/{name}.jsonl"),), _map_mawps)
        for name in _MAWPS_SUBSETS
    },
    "mawps:all": _Builtin(
        tuple((name, f"mawps/{name}.jsonl") for name in _MAWPS_SUBSETS), _map_mawps, dedupe=True
    ),
    "svamp": _Builtin((("", "svamp/test.jsonl"),), _map_svamp),
    "aime24": _Builtin((("", "aime24/test.jsonl"),), _map_aime24),
    "amc23": _Builtin((("", "amc23/test.jsonl"),), _map_amc23),
    "styles": _Builtin((("", "styles/prompts.jsonl"),), _map_styles),
    "critic_mix": _Builtin(
        (("sums", "critic_mix/easy_sums.jsonl"), ("multiarith", "critic_mix/multiarith.jsonl")),
        _map_critic_mix,
    ),
}


def list_datasets(include_rg: bool = False) -> list[str]:
    """Names of the vendored data sets, sorted (each also accepts ``:train`` / ``:heldout``
    except gsm8k, which has its own ``gsm8k:train`` / ``gsm8k:test``).

    Args:
        include_rg: Also list ``rg:<task>`` for every registered reasoning-gym task (imports
            reasoning_gym, about 1 s).

    Returns:
        Spec strings accepted by :func:`load_dataset`. ``file:<path>`` specs are not listed.
    """
    names = sorted(_BUILTINS)
    if include_rg:
        names += [f"rg:{task}" for task in _rg_tasks()]
    return names


# --------------------------------------------------------------------------------------------
# Splitting


@dataclass
class _Item:
    """One candidate row before the split: its sample and the key that groups duplicates."""

    key: str
    sample: Sample


def _norm_question(text: str) -> str:
    return " ".join(text.split())


def _split(items: list[_Item], part: str | None, split_seed: int, fraction: float) -> list[_Item]:
    """Return all items (part None) or the train / held-out part, in rank order (see module doc)."""
    if part is None:
        return items
    groups: dict[str, list[_Item]] = {}
    for item in items:
        groups.setdefault(item.key, []).append(item)

    def rank(key: str) -> bytes:
        return hashlib.sha256(f"{split_seed}\0{key}".encode()).digest()

    order = sorted(groups, key=rank)
    n_heldout = round(fraction * len(order))
    chosen = order[:n_heldout] if part == "heldout" else order[n_heldout:]
    return [item for key in chosen for item in groups[key]]


# --------------------------------------------------------------------------------------------
# Spec parsing helpers


def _parse_value(text: str) -> bool | int | float | str:
    """Query value -> bool / int / float / str (first that fits)."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def _parse_query(spec: str, query: str) -> dict[str, str]:
    """``a=1&b=x`` -> {"a": "1", "b": "x"} (percent-decoded, ``+`` kept). Raises DatasetError."""
    options: dict[str, str] = {}
    if not query:
        return options
    for pair in query.split("&"):
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        key = unquote(key).strip()
        if not sep or not key:
            raise DatasetError(f"dataset spec {spec!r}: option {pair!r} is not key=value")
        if key in options:
            raise DatasetError(f"dataset spec {spec!r}: option {key!r} given twice")
        options[key] = unquote(value)
    return options


def _split_part(base: str) -> tuple[str, str | None]:
    """``name:train`` -> (name, "train"); ``name`` -> (name, None)."""
    head, sep, tail = base.rpartition(":")
    if sep and tail in _SPLITS:
        return head, tail
    return base, None


def _unknown_spec(spec: str) -> DatasetError:
    valid = list_datasets()
    close = difflib.get_close_matches(spec.split("?", 1)[0], valid, n=2)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    return DatasetError(
        f"unknown dataset spec {spec!r}.{hint} Valid specs: {', '.join(valid)} "
        f"(each but gsm8k also with :train or :heldout), rg:<reasoning-gym task>[?size=N&seed=S], "
        f"file:<path.jsonl|.json|.parquet>[?question=F&answer=F], "
        f"hf:<dataset directory>[:split][?question=F&answer=F], guess[:train|:heldout][?size=N&high=H&seed=S]."
    )


# --------------------------------------------------------------------------------------------
# Loaders


def _load_rows(
    path: Path,
    display: str,
    to_sample: Callable[[int, dict[str, Any]], _Item],
    skip_malformed: bool,
    skipped: list[tuple[int, str]],
) -> list[_Item]:
    """Read ``path`` and map each row; malformed rows raise DatasetError or go to ``skipped``."""
    where, rows = _read_rows(path)
    return _map_rows(where, rows, display, to_sample, skip_malformed, skipped)


def _map_rows(
    where: str,
    rows: Iterator[tuple[int, int, dict[str, Any] | _RowError]],
    display: str,
    to_sample: Callable[[int, dict[str, Any]], _Item],
    skip_malformed: bool,
    skipped: list[tuple[int, str]],
) -> list[_Item]:
    """Map each ``(index, number, row)``; malformed rows raise DatasetError naming ``display``,
    ``where`` (line / item / row) and ``number``, or go to ``skipped``."""
    items: list[_Item] = []
    for index, number, row in rows:
        try:
            if isinstance(row, _RowError):
                raise row
            items.append(to_sample(index, row))
        except _RowError as exc:
            if not skip_malformed:
                raise DatasetError(f"{display} {where} {number}: {exc}") from None
            skipped.append((number, str(exc)))
    return items


def _load_builtin(
    spec: str, base: str, skip_malformed: bool, skipped: list[tuple[int, str]]
) -> tuple[list[_Item], str | None]:
    name, part = (base, None) if base in _BUILTINS else _split_part(base)
    if name not in _BUILTINS or (part is not None and not _BUILTINS[name].splittable):
        if name in _BUILTINS:
            raise DatasetError(
                f"dataset spec {spec!r}: {name} has its own split; use gsm8k:train or gsm8k:test"
            )
        raise _unknown_spec(spec)
    builtin = _BUILTINS[name]
    items: list[_Item] = []
    for subset, rel in builtin.files:
        prefix = f"{base}/{subset}" if subset else base

        def to_sample(
            index: int, row: dict[str, Any], prefix: str = prefix, rel: str = rel
        ) -> _Item:
            question, answer, extra = builtin.mapper(row)
            meta = {"source": rel, "row": index, "fields": extra}
            sample = Sample(f"{prefix}/{index}", question, answer, spec, meta)
            return _Item(_norm_question(question), sample)

        items += _load_rows(DATA_DIR / rel, str(DATA_DIR / rel), to_sample, skip_malformed, skipped)
    if builtin.dedupe:
        items = _dedupe(items)
    return items, part


def _dedupe(items: list[_Item]) -> list[_Item]:
    """Keep the first of identical (whitespace-normalised) questions; drop a question entirely
    if its copies disagree on the answer (the label is then unreliable)."""
    answers: dict[str, set[str]] = {}
    for item in items:
        answers.setdefault(item.key, set()).add(item.sample.answer)
    seen: set[str] = set()
    kept: list[_Item] = []
    for item in items:
        if item.key in seen or len(answers[item.key]) > 1:
            continue
        seen.add(item.key)
        kept.append(item)
    return kept


def _user_options(spec: str, query: str, kind: str) -> tuple[str | None, str | None, str | None]:
    """The ``?question=F&answer=F&split=train|heldout`` options of a ``file:`` / ``hf:`` spec:
    ``(question field, answer field, seeded part)``, each None if not given. Raises
    DatasetError for an unknown option or split value."""
    options = _parse_query(spec, query)
    unknown = sorted(set(options) - set(_FILE_OPTIONS))
    if unknown:
        raise DatasetError(
            f"dataset spec {spec!r}: unknown option(s) {', '.join(unknown)}; "
            f"{kind} specs accept {', '.join(_FILE_OPTIONS)}"
        )
    part = options.get("split")
    if part is not None and part not in _SPLITS:
        raise DatasetError(f"dataset spec {spec!r}: option split={part!r}; use train or heldout")
    return options.get("question"), options.get("answer"), part


def _user_items(
    spec: str,
    source: str,
    what: str,
    where: str,
    rows: Iterator[tuple[int, int, dict[str, Any] | _RowError]],
    fields: tuple[str | None, str | None],
    skip_malformed: bool,
    skipped: list[tuple[int, str]],
) -> list[_Item]:
    """Map the rows of a user data source (``file:`` or ``hf:``) to samples: the question /
    answer field mapping, ``metadata = {"source", "row", "fields"}``, ids ``<spec>/<row>``.

    Args:
        spec: The spec as given.
        source: The file or dataset (for ``metadata["source"]`` and errors).
        what: ``"data file"`` or ``"hf dataset"`` (for the error of a source without rows).
        where: ``"line"`` / ``"item"`` / ``"row"``: what the 1-based numbers in errors count.
        rows: ``(0-based index, 1-based number, row dict or _RowError)``.
        fields: The ``?question=`` / ``?answer=`` field names (None: the default names).
        skip_malformed: Skip malformed rows into ``skipped`` instead of raising.
        skipped: Receives ``(number, reason)`` of skipped rows.

    Returns:
        The items, in source order.

    Raises:
        DatasetError: a malformed row (unless ``skip_malformed``), naming the source, the row
            number and the field (with the fields present); no usable row at all.
    """
    q_field, a_field = fields
    prefix = spec.split("?", 1)[0]

    def to_sample(index: int, row: dict[str, Any]) -> _Item:
        q_name = _pick(row, q_field, _QUESTION_FIELDS, "question")
        a_name = _pick(row, a_field, _ANSWER_FIELDS, "answer")
        question = _question_text(row[q_name], q_name)
        answer = _answer_text(row[a_name], a_name)
        extra = {k: v for k, v in row.items() if k not in (q_name, a_name)}
        meta = {"source": source, "row": index, "fields": extra}
        return _Item(
            _norm_question(question), Sample(f"{prefix}/{index}", question, answer, spec, meta)
        )

    items = _map_rows(where, rows, source, to_sample, skip_malformed, skipped)
    if not items:  # an empty source would otherwise fail later, far from its name
        why = (f"all {len(skipped)} rows are malformed (skipped)" if skipped
               else "it has no rows (empty file)" if what == "data file" else "it has no rows")
        raise DatasetError(f"{what} {source}: {why}")
    return items


def _load_file(
    spec: str,
    path_text: str,
    query: str,
    skip_malformed: bool,
    skipped: list[tuple[int, str]],
) -> tuple[list[_Item], str | None]:
    q_field, a_field, part = _user_options(spec, query, "file")
    if not path_text:
        raise DatasetError(f"dataset spec {spec!r}: empty file path")
    path = Path(path_text).expanduser()
    if path.suffix.lower() not in _FILE_SUFFIXES:
        raise DatasetError(
            f"dataset spec {spec!r}: file must end in {', '.join(_FILE_SUFFIXES)}, got {path.name!r}"
        )
    where, rows = _read_rows(path)
    items = _user_items(spec, str(path), "data file", where, rows, (q_field, a_field),
                        skip_malformed, skipped)
    return items, part


@contextlib.contextmanager
def _hf_offline() -> Iterator[Any]:
    """Import ``datasets`` and keep it (and huggingface_hub) offline for the block:
    ``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1`` in the environment and in ``datasets.config``
    (read at import), progress bars off; everything restored afterwards. Yields the module.
    Raises DatasetError if ``datasets`` is not installed."""
    names = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    saved_env = {k: os.environ.get(k) for k in names}
    os.environ.update({k: "1" for k in names})
    try:
        try:
            import datasets
        except ImportError as exc:
            raise DatasetError(
                f"hf: specs need the datasets library, which is not installed: "
                f"pip install 'datasets>=2.19' ({exc})"
            ) from None
        saved_cfg = {k: getattr(datasets.config, k) for k in names if hasattr(datasets.config, k)}
        for k in saved_cfg:
            setattr(datasets.config, k, True)
        bars_were_off = datasets.utils.are_progress_bars_disabled()
        datasets.disable_progress_bars()
        try:
            yield datasets
        finally:
            for k, v in saved_cfg.items():
                setattr(datasets.config, k, v)
            if not bars_were_off:
                datasets.enable_progress_bars()
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _hf_target(spec: str, text: str) -> tuple[Path, str | None]:
    """``<directory>[:<split>]`` -> (directory, split or None). A path that exists as given keeps
    its colons; otherwise a last ``:name`` without ``/`` is the split. Raises DatasetError if the
    directory does not exist locally (nothing is downloaded) or is a file."""
    if not text:
        raise DatasetError(f"dataset spec {spec!r}: empty dataset path")
    path, split = Path(text).expanduser(), None
    head, sep, tail = text.rpartition(":")
    if not path.exists() and sep and head and tail and "/" not in tail:
        path, split = Path(head).expanduser(), tail
    if not path.exists():
        raise DatasetError(
            f"dataset spec {spec!r}: {path} does not exist locally. hf: reads datasets on this "
            f"machine only; the Hugging Face Hub is never contacted (HF_DATASETS_OFFLINE=1). "
            f"Save the dataset to a directory first, e.g. {_HF_SAVE_HINT}"
        )
    if not path.is_dir():
        raise DatasetError(
            f"dataset spec {spec!r}: {path} is a file; hf: takes a directory (written by "
            f"save_to_disk, or a dataset repository of data files); for one data file use "
            f"file:{path}"
        )
    return path, split


def _hf_saved_empty(path: Path) -> bool:
    """Whether the ``save_to_disk`` directory ``path`` holds no data file at all (a Dataset, or
    every split of a DatasetDict, saved with 0 rows), as its ``state.json`` files say."""
    states = [path / "state.json"] if (path / "state.json").is_file() else sorted(path.glob("*/state.json"))
    try:
        return bool(states) and all(not json.loads(p.read_text()).get("_data_files") for p in states)
    except (OSError, ValueError, AttributeError):
        return False


def _load_hf(
    spec: str,
    path_text: str,
    query: str,
    skip_malformed: bool,
    skipped: list[tuple[int, str]],
) -> tuple[list[_Item], str | None]:
    """Rows of a Hugging Face dataset on disk, through the ``file:`` mapping (:func:`_user_items`)."""
    q_field, a_field, part = _user_options(spec, query, "hf")
    path, split = _hf_target(spec, path_text)
    with _hf_offline() as datasets:
        saved = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
        try:
            obj = datasets.load_from_disk(str(path)) if saved else datasets.load_dataset(str(path))
        except Exception as exc:  # datasets raises many types (FileNotFoundError, ValueError, ...)
            if saved and _hf_saved_empty(path):  # datasets cannot load a split saved with no rows
                raise DatasetError(f"hf dataset {path}: it has no rows (saved with 0 rows; "
                                   "datasets cannot even open it)") from None
            raise DatasetError(
                f"dataset spec {spec!r}: datasets cannot read {path} "
                f"({type(exc).__name__}: {exc}); hf: takes a directory written by "
                f"Dataset.save_to_disk / DatasetDict.save_to_disk, or a dataset repository of "
                f"data files (.jsonl, .json, .csv, .parquet, ...)"
            ) from None
        if isinstance(obj, datasets.DatasetDict):
            names = list(obj)
            if split is None and len(names) == 1:
                split = names[0]
            elif split is None:
                raise DatasetError(
                    f"dataset spec {spec!r}: {path} has the splits {', '.join(names)}; name one, "
                    f"e.g. hf:{path}:{names[0]}"
                )
            if split not in obj:
                raise DatasetError(
                    f"dataset spec {spec!r}: {path} has no split {split!r}; its splits: "
                    f"{', '.join(names) or 'none'}"
                )
            dataset = obj[split]
        else:
            dataset = obj
            own = None if dataset.split is None else str(dataset.split)
            if split is not None and split != own:
                raise DatasetError(
                    f"dataset spec {spec!r}: {path} holds a single Dataset (split "
                    f"{own or 'unnamed'}), which has no split {split!r}; its splits: "
                    f"{own or 'none (drop the :' + split + ')'}"
                )
        records = dataset.to_list()
    source = f"{path}:{split}" if split is not None else str(path)
    rows = ((index, index + 1, row) for index, row in enumerate(records))
    items = _user_items(spec, source, "hf dataset", "row", rows, (q_field, a_field),
                        skip_malformed, skipped)
    return items, part


def _rg_tasks() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _load_rg(
    spec: str,
    base: str,
    query: str,
    rg_size: int | None,
    rg_seed: int | None,
    rg_config: dict[str, Any] | None,
) -> list[_Item]:
    import dataclasses

    from reasoning_gym.factory import DATASETS, create_dataset

    task, part = _split_part(base[len("rg:") :])
    if task not in DATASETS:
        close = difflib.get_close_matches(task, list(DATASETS), n=3)
        names = sorted(DATASETS)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise DatasetError(
            f"dataset spec {spec!r}: unknown reasoning-gym task {task!r}.{hint} "
            f"{len(names)} tasks exist, e.g. {', '.join(names[:8])} "
            f"(list_datasets(include_rg=True) lists them all)"
        )
    options: dict[str, Any] = {k: _parse_value(v) for k, v in _parse_query(spec, query).items()}
    for key, value in (("size", rg_size), ("seed", rg_seed), *(rg_config or {}).items()):
        if value is None and key in ("size", "seed"):
            continue
        if key in options and options[key] != value:
            raise DatasetError(
                f"dataset spec {spec!r}: option {key!r} is {options[key]!r} in the spec but "
                f"{value!r} as a keyword argument"
            )
        options[key] = value
    size = options.pop("size", RG_DEFAULT_SIZE)
    seed = options.pop("seed", RG_DEFAULT_SEED)
    for key, value in (("size", size), ("seed", seed)):
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < (1 if key == "size" else 0)
        ):
            raise DatasetError(
                f"dataset spec {spec!r}: option {key!r} must be an integer >= "
                f"{1 if key == 'size' else 0}, got {value!r}"
            )
    config_fields = {f.name for f in dataclasses.fields(DATASETS[task][1])} - {"size", "seed"}
    unknown = sorted(set(options) - config_fields)
    if unknown:
        raise DatasetError(
            f"dataset spec {spec!r}: unknown option(s) {', '.join(unknown)} for reasoning-gym "
            f"task {task!r}; valid: size, seed, {', '.join(sorted(config_fields))}"
        )
    if part == "heldout":
        seed += RG_HELDOUT_SEED_OFFSET
    try:
        dataset = create_dataset(task, size=size, seed=seed, **options)
        entries = [dataset[i] for i in range(size)]
    except (AssertionError, TypeError, ValueError) as exc:
        raise DatasetError(
            f"dataset spec {spec!r}: reasoning-gym rejected the config of {task!r}: {exc}"
        ) from None
    prefix = spec.split("?", 1)[0]
    items = []
    for index, entry in enumerate(entries):
        answer = entry.get("answer")
        meta = {"rg_task": task, "rg_seed": seed, "rg_entry": entry, "row": index}
        sample = Sample(
            f"{prefix}/{index}",
            str(entry["question"]),
            "" if answer is None else str(answer),
            spec,
            meta,
        )
        items.append(_Item(_norm_question(sample.question), sample))
    return items


GUESS_DEFAULT_SIZE: int = 200
"""Default number of guess-the-number games of a ``guess`` spec."""


def _load_guess(spec: str, base: str, query: str) -> list[_Item]:
    """``guess[:train|:heldout][?size=N&high=H&seed=S]`` (module docstring)."""
    from conveyor.envs.guess import GUESS_DEFAULT_HIGH, guess_samples

    name, part = _split_part(base)
    if name != "guess":
        raise _unknown_spec(spec)
    options: dict[str, Any] = {k: _parse_value(v) for k, v in _parse_query(spec, query).items()}
    unknown = sorted(set(options) - {"size", "high", "seed"})
    if unknown:
        raise DatasetError(f"dataset spec {spec!r}: unknown option(s) {', '.join(unknown)}; valid: size, high, seed")
    size = options.get("size", GUESS_DEFAULT_SIZE)
    high = options.get("high", GUESS_DEFAULT_HIGH)
    seed = options.get("seed", 0)
    for key, value, low in (("size", size, 1), ("high", high, 1), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise DatasetError(f"dataset spec {spec!r}: option {key!r} must be an integer >= {low}, got {value!r}")
    if part == "heldout":
        seed += RG_HELDOUT_SEED_OFFSET
    prefix = spec.split("?", 1)[0]
    return [_Item(f"{prefix}/{i}", Sample(f"{prefix}/{i}", s.question, s.answer, spec, {"high": high, "row": i}))
            for i, s in enumerate(guess_samples(size, high=high, seed=seed))]


# --------------------------------------------------------------------------------------------
# Public entry points


def load_dataset_report(
    spec: str,
    *,
    split_seed: int = 0,
    limit: int | None = None,
    skip_malformed: bool = False,
    heldout_fraction: float = HELDOUT_FRACTION,
    rg_size: int | None = None,
    rg_seed: int | None = None,
    rg_config: dict[str, Any] | None = None,
) -> DatasetLoad:
    """Load the data set named by ``spec`` and report the malformed rows skipped.

    See the module docstring for the spec grammar, splits, ids and field mapping.

    Args:
        spec: Data set spec, e.g. ``"gsm8k:test"``, ``"mawps:singleop:heldout"``,
            ``"rg:basic_arithmetic?size=200&seed=1"``, ``"file:/data/x.jsonl?answer=solution"``,
            ``"hf:/data/math500:test?split=heldout"``.
        split_seed: Seed of the train / held-out split (vendored, ``file:`` and ``hf:`` sets).
        limit: Keep only the first ``limit`` samples after the split (None: all).
        skip_malformed: Skip malformed rows (recorded in ``skipped``) instead of raising.
        heldout_fraction: Share of distinct questions held out, in (0, 1).
        rg_size: reasoning-gym ``size`` (rows); same as ``?size=``.
        rg_seed: reasoning-gym generator ``seed``; same as ``?seed=``.
        rg_config: Extra reasoning-gym config fields (e.g. ``{"max_terms": 3}``).

    Returns:
        A :class:`DatasetLoad` with the samples and the skipped ``(line, reason)`` list.

    Raises:
        DatasetError: Unknown spec (the message lists valid specs), bad option, missing file,
            malformed row (file, 1-based line and field named) unless ``skip_malformed``;
            ``hf:``: a directory that does not exist locally (nothing is downloaded), that
            ``datasets`` cannot read, a missing split (the message lists the splits), a
            missing field (the message lists the fields), ``datasets`` not installed.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise DatasetError(f"dataset spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise DatasetError(f"limit must be None or an integer >= 0, got {limit!r}")
    if isinstance(split_seed, bool) or not isinstance(split_seed, int):
        raise DatasetError(f"split_seed must be an integer, got {split_seed!r}")
    if not (isinstance(heldout_fraction, int | float) and 0.0 < heldout_fraction < 1.0):
        raise DatasetError(f"heldout_fraction must be in (0, 1), got {heldout_fraction!r}")
    base, _, query = spec.partition("?")
    is_rg = base.startswith("rg:")
    if not is_rg and (rg_size is not None or rg_seed is not None or rg_config):
        raise DatasetError(f"dataset spec {spec!r}: rg_size / rg_seed / rg_config need an rg: spec")

    skipped: list[tuple[int, str]] = []
    if is_rg:
        items, part = _load_rg(spec, base, query, rg_size, rg_seed, rg_config), None
    elif base.split(":", 1)[0] == "guess":  # its :heldout is its own seed, not a split
        items, part = _load_guess(spec, base, query), None
    elif base.startswith("file:"):
        items, part = _load_file(spec, base[len("file:") :], query, skip_malformed, skipped)
    elif base.startswith("hf:"):
        items, part = _load_hf(spec, base[len("hf:") :], query, skip_malformed, skipped)
    elif base.lower().endswith(_FILE_SUFFIXES):
        items, part = _load_file(spec, base, query, skip_malformed, skipped)
    else:
        if query:
            raise DatasetError(
                f"dataset spec {spec!r}: vendored sets take no ?options (use :train / :heldout)"
            )
        items, part = _load_builtin(spec, base, skip_malformed, skipped)

    items = _split(items, part, split_seed, heldout_fraction)
    samples = [item.sample for item in items]
    if limit is not None:
        samples = samples[:limit]
    return DatasetLoad(spec=spec, samples=samples, skipped=skipped)


def load_dataset(
    spec: str,
    *,
    split_seed: int = 0,
    limit: int | None = None,
    skip_malformed: bool = False,
    heldout_fraction: float = HELDOUT_FRACTION,
    rg_size: int | None = None,
    rg_seed: int | None = None,
    rg_config: dict[str, Any] | None = None,
) -> list[Sample]:
    """Load the data set named by ``spec`` as a list of samples.

    Same arguments and errors as :func:`load_dataset_report`, which also returns the malformed
    rows skipped under ``skip_malformed=True``.

    Raises:
        DatasetError: See :func:`load_dataset_report`.
    """
    return load_dataset_report(
        spec,
        split_seed=split_seed,
        limit=limit,
        skip_malformed=skip_malformed,
        heldout_fraction=heldout_fraction,
        rg_size=rg_size,
        rg_seed=rg_seed,
        rg_config=rg_config,
    ).samples
