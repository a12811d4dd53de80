"""Tests of the dataset registry (conveyor.data): vendored sets, splits, reasoning-gym, user files."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conveyor.data import (
    DATA_DIR,
    RG_HELDOUT_SEED_OFFSET,
    DatasetError,
    format_number,
    list_datasets,
    load_dataset,
    load_dataset_report,
    parse_gsm8k_answer,
)
from conveyor.data.registry import default_instruction

# --------------------------------------------------------------------------------------------
# Vendored sets

# (spec, rows, start of the first question, first answer), read off the files by hand.
VENDORED = [
    ("gsm8k:train", 7473, "Natalia sold clips to 48 of her friends in April", "72"),
    ("gsm8k:test", 1319, "Janet\u2019s ducks lay 16 eggs per day.", "18"),
    ("mawps:addsub", 395, "Joan found 70 seashells on the beach . she gave Sam", "43"),
    ("mawps:singleop", 562, "If there are 7 bottle caps in a box and Linda puts 7", "14"),
    ("mawps:singleeq", 508, "Joan found 70 seashells on the beach. she gave Sam", "43"),
    ("mawps:multiarith", 600, "For Halloween Debby and her sister combined the candy", "39"),
    (
        "svamp",
        1000,
        "There are 87 oranges and 290 bananas in Philip's collection. If the bananas are "
        "organized into 2 groups and oranges are organized into 93 groups. How big is each group",
        "145",
    ),
    ("aime24", 30, "Every morning Aya goes for a $9$-kilometer-long walk", "204"),
    ("amc23", 40, "Cities $A$ and $B$ are $45$ miles apart.", "27"),
]


@pytest.mark.parametrize(("spec", "rows", "question", "answer"), VENDORED)
def test_vendored_set_loads_real_file(spec: str, rows: int, question: str, answer: str) -> None:
    samples = load_dataset(spec)
    assert len(samples) == rows
    first = samples[0]
    assert first.question.startswith(question)
    assert first.answer == answer
    assert first.id == f"{spec}/0"
    assert first.dataset == spec
    assert len({s.id for s in samples}) == rows
    assert all(s.question and s.answer for s in samples)


def test_critic_mix_is_the_shipped_sums_and_multiarith_rows_verbatim() -> None:
    samples = load_dataset("critic_mix")
    sums = [s for s in samples if s.id.startswith("critic_mix/sums/")]
    multi = [s for s in samples if s.id.startswith("critic_mix/multiarith/")]
    assert (len(sums), len(multi), len(samples)) == (80, 80, 160)
    assert sums[0].question == "Jack has 2 cards. Jack gets 3 more cards. How many cards does Jack have now?"
    assert sums[0].answer == "5"
    # the multiarith rows are rows of mawps/multiarith.jsonl, question and answer unchanged
    full = {s.question: s.answer for s in load_dataset("mawps:multiarith")}
    assert all(full[s.question] == s.answer for s in multi)
    assert multi[0].question.startswith("A pet store had 13 siamese cats") and multi[0].answer == "8"
    # the benchmark's data file and the vendored sums are the same bytes (make_critic_mix.py)
    bench = DATA_DIR.parents[3] / "benchmarks" / "data" / "critic_easy_sums.jsonl"
    if bench.exists():  # a source checkout (not an installed wheel)
        assert bench.read_bytes() == (DATA_DIR / "critic_mix/easy_sums.jsonl").read_bytes()
    train, held = load_dataset("critic_mix:train"), load_dataset("critic_mix:heldout")
    assert (len(train), len(held)) == (126, 34)
    assert not {s.question for s in train} & {s.question for s in held}
    assert default_instruction("critic_mix:train") == default_instruction("mawps:singleop:train")


def test_mawps_row_count_includes_unterminated_last_line() -> None:
    raw = (DATA_DIR / "mawps/singleop.jsonl").read_bytes()
    assert not raw.endswith(b"\n")  # wc -l says 561; there are 562 rows
    last = load_dataset("mawps:singleop")[-1]
    assert last.id == "mawps:singleop/561"
    assert last.answer == "7.5"  # "target": 7.5 stays non-integral


def test_vendored_files_ship_with_licences() -> None:
    assert "OpenAI" in (DATA_DIR / "gsm8k/LICENSE").read_text()
    for folder in ("mawps", "svamp", "aime24", "amc23"):
        assert "MIT License" in (DATA_DIR / folder / "LICENSE.qwen25math-eval").read_text()


def test_answers_are_formatted_per_set() -> None:
    addsub = {s.id: s.answer for s in load_dataset("mawps:addsub")}
    assert "9.43" in addsub.values() and "0.6666666667" in addsub.values()
    assert not any(a.endswith(".0") for a in addsub.values())
    aime = [s.answer for s in load_dataset("aime24")]
    assert aime[7] == "25"  # published as "025"
    amc = [s.answer for s in load_dataset("amc23")]
    assert amc[15] == "-1"  # published as -1.0


def test_gsm8k_answer_parsing() -> None:
    assert parse_gsm8k_answer("Ten hundreds.\n#### 1,000") == "1000"
    assert parse_gsm8k_answer("#### -3") == "-3"
    with pytest.raises(ValueError, match="####"):
        parse_gsm8k_answer("no marker here")
    with pytest.raises(ValueError, match="empty"):
        parse_gsm8k_answer("text ####  ")
    # A real row with a thousands separator: the answer keeps the digits, drops the commas.
    train = load_dataset("gsm8k:train")
    with_comma = [s for s in train if "," in s.metadata["fields"]["solution"].rsplit("####")[1]]
    assert len(with_comma) > 20
    sample = with_comma[0]
    published = sample.metadata["fields"]["solution"].rsplit("####")[1].strip()
    assert sample.answer == published.replace(",", "") and "," not in sample.answer


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (43.0, "43"),
        (2.5, "2.5"),
        (-1.0, "-1"),
        (7, "7"),
        (0.6666666667, "0.6666666667"),
        (1e-07, "0.0000001"),
        (1e16, "10000000000000000"),
        (Decimal("1.50"), "1.5"),
    ],
)
def test_format_number(value: float, text: str) -> None:
    assert format_number(value) == text


def test_format_number_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="finite"):
        format_number(float("nan"))
    with pytest.raises(TypeError, match="bool"):
        format_number(True)


# --------------------------------------------------------------------------------------------
# Splits


def _rows(samples: list) -> set[int]:
    return {s.metadata["row"] for s in samples}


def test_split_is_deterministic_disjoint_and_covering() -> None:
    everything = load_dataset("mawps:singleop")
    train = load_dataset("mawps:singleop:train")
    heldout = load_dataset("mawps:singleop:heldout")
    assert [s.id for s in train] == [s.id for s in load_dataset("mawps:singleop:train")]
    assert _rows(train).isdisjoint(_rows(heldout))
    assert _rows(train) | _rows(heldout) == _rows(everything)
    assert len(train) + len(heldout) == len(everything) == 562
    distinct = {" ".join(s.question.split()) for s in everything}
    held_questions = {" ".join(s.question.split()) for s in heldout}
    assert len(held_questions) == round(0.2 * len(distinct))
    # singleop repeats 31 questions: no question may appear on both sides.
    assert held_questions.isdisjoint({" ".join(s.question.split()) for s in train})
    assert train[0].id == f"mawps:singleop:train/{train[0].metadata['row']}"
    assert train[0].dataset == "mawps:singleop:train"


def test_split_seed_and_fraction_change_the_split() -> None:
    seed0 = _rows(load_dataset("svamp:heldout", split_seed=0))
    seed1 = _rows(load_dataset("svamp:heldout", split_seed=1))
    assert len(seed0) == len(seed1) == 200
    assert seed0 != seed1
    assert len(load_dataset("svamp:heldout", heldout_fraction=0.5)) == 500
    with pytest.raises(DatasetError, match="heldout_fraction"):
        load_dataset("svamp:heldout", heldout_fraction=1.0)


def test_split_is_shuffled_and_limit_takes_its_head() -> None:
    train = load_dataset("svamp:train")
    assert [s.metadata["row"] for s in train[:20]] != sorted(s.metadata["row"] for s in train[:20])
    limited = load_dataset("svamp:train", limit=5)
    assert [s.id for s in limited] == [s.id for s in train[:5]]
    assert [s.id for s in load_dataset("svamp", limit=3)] == ["svamp/0", "svamp/1", "svamp/2"]
    assert load_dataset("svamp", limit=0) == []
    with pytest.raises(DatasetError, match="limit"):
        load_dataset("svamp", limit=-1)


def test_mawps_all_concatenates_and_dedupes() -> None:
    merged = load_dataset("mawps:all")
    keys = [" ".join(s.question.split()) for s in merged]
    assert len(keys) == len(set(keys)) == 1977  # 2065 rows, 1978 distinct, 1 conflicting
    assert not any("Mrs. Hilt baked pies last weekend" in s.question for s in merged)
    assert merged[0].id == "mawps:all/addsub/0"
    assert merged[-1].id.startswith("mawps:all/multiarith/")
    subsets = {s.id.split("/")[1] for s in merged}
    assert subsets == {"addsub", "singleop", "singleeq", "multiarith"}
    train, heldout = load_dataset("mawps:all:train"), load_dataset("mawps:all:heldout")
    assert len(train) + len(heldout) == 1977
    assert {s.id.split("/", 1)[1] for s in train}.isdisjoint(s.id.split("/", 1)[1] for s in heldout)


def test_gsm8k_has_no_extra_split() -> None:
    with pytest.raises(DatasetError, match="own split"):
        load_dataset("gsm8k:train:heldout")


def test_unknown_spec_lists_valid_specs() -> None:
    with pytest.raises(DatasetError) as info:
        load_dataset("gsm8k")
    message = str(info.value)
    assert "'gsm8k'" in message
    for spec in list_datasets():
        assert spec in message
    assert "rg:" in message and "file:" in message
    assert list_datasets() == sorted(list_datasets()) and "mawps:all" in list_datasets()


def test_vendored_sets_take_no_query() -> None:
    with pytest.raises(DatasetError, match="no \\?options"):
        load_dataset("mawps:singleop?seed=1")


# --------------------------------------------------------------------------------------------
# reasoning-gym


def test_rg_task_size_seed_determinism_and_metadata() -> None:
    reasoning_gym = pytest.importorskip("reasoning_gym")
    spec = "rg:basic_arithmetic?size=7&seed=3"
    samples = load_dataset(spec)
    assert len(samples) == 7
    assert samples == load_dataset(spec)  # dataclass equality: id, question, answer, dataset
    direct = reasoning_gym.create_dataset("basic_arithmetic", size=7, seed=3)
    assert [s.question for s in samples] == [direct[i]["question"] for i in range(7)]
    first = samples[0]
    assert first.id == "rg:basic_arithmetic/0" and first.dataset == spec
    assert first.metadata["rg_task"] == "basic_arithmetic"
    entry = first.metadata["rg_entry"]
    assert entry["question"] == first.question and str(entry["answer"]) == first.answer
    score = reasoning_gym.get_score_answer_fn("basic_arithmetic")
    assert score(first.answer, entry) == 1.0
    assert score("not a number", entry) < 1.0
    other_seed = load_dataset("rg:basic_arithmetic?size=7&seed=100")
    assert [s.question for s in other_seed] != [s.question for s in samples]


def test_rg_keyword_arguments_and_config() -> None:
    pytest.importorskip("reasoning_gym")
    by_query = load_dataset("rg:basic_arithmetic?size=4&seed=2&max_terms=2&allow_parentheses=false")
    by_kwargs = load_dataset(
        "rg:basic_arithmetic",
        rg_size=4,
        rg_seed=2,
        rg_config={"max_terms": 2, "allow_parentheses": False},
    )
    assert [s.question for s in by_query] == [s.question for s in by_kwargs]
    assert all(s.metadata["rg_entry"]["metadata"]["num_terms"] == 2 for s in by_query)
    with pytest.raises(DatasetError, match="'size'"):
        load_dataset("rg:basic_arithmetic?size=4", rg_size=5)
    with pytest.raises(DatasetError, match="bogus.*valid: size, seed"):
        load_dataset("rg:basic_arithmetic?bogus=1")
    with pytest.raises(DatasetError, match="min_terms must be positive"):
        load_dataset("rg:basic_arithmetic?size=2&min_terms=0")
    with pytest.raises(DatasetError, match="rg_size"):
        load_dataset("svamp", rg_size=3)


def test_rg_heldout_uses_a_distant_seed() -> None:
    pytest.importorskip("reasoning_gym")
    train = load_dataset("rg:basic_arithmetic:train?size=5&seed=4")
    heldout = load_dataset("rg:basic_arithmetic:heldout?size=5&seed=4")
    assert train[0].metadata["rg_seed"] == 4
    assert heldout[0].metadata["rg_seed"] == 4 + RG_HELDOUT_SEED_OFFSET
    assert {s.question for s in train}.isdisjoint(s.question for s in heldout)
    assert [s.question for s in train] == [
        s.question for s in load_dataset("rg:basic_arithmetic?size=5&seed=4")
    ]


def test_rg_unknown_task_lists_valid_names() -> None:
    pytest.importorskip("reasoning_gym")
    with pytest.raises(DatasetError) as info:
        load_dataset("rg:basic_arithmetc")
    message = str(info.value)
    assert "'basic_arithmetc'" in message and "Did you mean basic_arithmetic" in message
    assert "tasks exist, e.g." in message


# --------------------------------------------------------------------------------------------
# User files


def _write_jsonl(path: Path, rows: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_user_jsonl_with_custom_fields(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    _write_jsonl(path, [{"q": "1+1?", "sol": 2.0, "tag": "a"}, "", {"q": "Name?", "sol": "Ann"}])
    spec = f"file:{path}?question=q&answer=sol"
    samples = load_dataset(spec)
    assert [(s.question, s.answer) for s in samples] == [("1+1?", "2"), ("Name?", "Ann")]
    assert samples[0].id == f"file:{path}/0"
    assert samples[1].id == f"file:{path}/2"  # row = line - 1; the blank line 2 keeps its place
    assert samples[0].dataset == spec
    assert samples[0].metadata["fields"] == {"tag": "a"}
    with pytest.raises(DatasetError, match="unknown option.*qestion"):
        load_dataset(f"file:{path}?qestion=q")


def test_user_file_default_fields_and_bare_path(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    _write_jsonl(path, [{"problem": "P", "solution": "S"}, {"input": "I", "target": 3}])
    samples = load_dataset(str(path))
    assert [(s.question, s.answer) for s in samples] == [("P", "S"), ("I", "3")]
    array = tmp_path / "d.json"
    array.write_text(json.dumps([{"prompt": "x", "Answer": 1.5}]))
    assert [(s.question, s.answer) for s in load_dataset(f"file:{array}")] == [("x", "1.5")]


def test_user_file_split(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    _write_jsonl(path, [{"question": f"q{i}", "answer": i} for i in range(50)])
    train = load_dataset(f"{path}?split=train")
    heldout = load_dataset(f"{path}?split=heldout")
    assert len(heldout) == 10 and len(train) == 40
    assert _rows(train) | _rows(heldout) == set(range(50))
    with pytest.raises(DatasetError, match="split='test'"):
        load_dataset(f"{path}?split=test")


def test_parquet_file(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    table = pa.table({"problem": ["2*3?", "4-1?"], "answer": [6.0, 3.0], "level": [1, 2]})
    pq.write_table(table, path)
    samples = load_dataset(f"file:{path}")
    assert [(s.question, s.answer) for s in samples] == [("2*3?", "6"), ("4-1?", "3")]
    assert samples[1].metadata["fields"] == {"level": 2}
    custom = load_dataset(f"file:{path}?question=problem&answer=level")
    assert [s.answer for s in custom] == ["1", "2"]


def test_parquet_malformed_row_names_row(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["a", None], "answer": ["1", "2"]}), path)
    with pytest.raises(DatasetError, match=r"bad\.parquet row 2: field 'question': the question is null"):
        load_dataset(str(path))
    report = load_dataset_report(str(path), skip_malformed=True)
    assert [s.question for s in report.samples] == ["a"]
    assert [line for line, _ in report.skipped] == [2]


def test_malformed_jsonl_raises_with_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    _write_jsonl(
        path,
        [
            {"question": "ok", "answer": "1"},
            {"question": "no answer here"},
            "{not json",
            {"question": "list answer", "answer": [1, 2]},
            {"question": "ok too", "answer": 2},
        ],
    )
    with pytest.raises(DatasetError) as info:
        load_dataset(f"file:{path}?answer=answer")
    message = str(info.value)
    assert "broken.jsonl" in message and "line 2" in message and "'answer'" in message
    report = load_dataset_report(f"file:{path}?answer=answer", skip_malformed=True)
    assert [s.question for s in report.samples] == ["ok", "ok too"]
    assert [line for line, _ in report.skipped] == [2, 3, 4]
    reasons = dict(report.skipped)
    assert "missing" in reasons[2] and "invalid JSON" in reasons[3] and "list" in reasons[4]
    assert load_dataset(f"file:{path}?answer=answer", skip_malformed=True) == report.samples


@pytest.mark.parametrize(
    ("row", "fragment"),
    [
        ('["a", "b"]', "not an object"),
        ('{"question": "q", "answer": NaN}', "finite"),
        ('{"question": "q", "answer": true}', "bool"),
        ('{"question": "  ", "answer": "1"}', "empty"),
        ('{"question": 5, "answer": "1"}', "question must be a string"),
        ('{"text": "q", "answer": "1"}', "no question field"),
    ],
)
def test_malformed_row_kinds(tmp_path: Path, row: str, fragment: str) -> None:
    path = tmp_path / "rows.jsonl"
    _write_jsonl(path, [{"question": "fine", "answer": "1"}, row])
    with pytest.raises(DatasetError, match=r"rows\.jsonl line 2: .*" + fragment):
        load_dataset(f"file:{path}")


def test_missing_file_and_bad_suffix(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not found"):
        load_dataset(f"file:{tmp_path / 'absent.jsonl'}")
    with pytest.raises(DatasetError, match=r"\.csv"):
        load_dataset(f"file:{tmp_path / 'x.csv'}")
