"""``hf:`` data specs (issue 15 section 4): Hugging Face datasets saved on disk
(``save_to_disk``) or local dataset repositories, read through ``datasets`` with the ``file:``
field mapping and seeded splits, offline (nothing is downloaded), with errors that name the
missing field or split."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conveyor.data import DatasetError, load_dataset, load_dataset_report
from conveyor.data.registry import INSTRUCTION_MATH, source_format

datasets = pytest.importorskip("datasets")

ROWS = [{"question": f"What is {i} plus {i}?", "answer": 2 * i, "level": i % 3} for i in range(40)]


@pytest.fixture(autouse=True)
def _hf_cache(tmp_path, monkeypatch):
    """``load_dataset`` on a repository directory writes its Arrow cache here, not in ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A saved Dataset, a saved DatasetDict (train / test) with other field names, a dataset
    repository directory with a JSONL data file, and the same rows as a ``file:`` JSONL."""
    root = tmp_path_factory.mktemp("hf")
    datasets.disable_progress_bars()
    single = root / "single"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(single))
    other = [{"problem_text": r["question"], "sol": str(r["answer"])} for r in ROWS]
    dd = root / "dict"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list(other[:30]),
        "test": datasets.Dataset.from_list(other[30:]),
    }).save_to_disk(str(dd))
    repo = root / "repo"
    (repo / "data").mkdir(parents=True)
    jsonl = repo / "data" / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return {"single": single, "dict": dd, "repo": repo, "jsonl": jsonl}


def _pairs(samples):
    return [(s.question, s.answer) for s in samples]


def test_saved_dataset_goes_through_the_file_mapping(saved):
    samples = load_dataset(f"hf:{saved['single']}")
    as_file = load_dataset(f"file:{saved['jsonl']}")
    assert _pairs(samples) == _pairs(as_file) and len(samples) == 40
    assert samples[3].question == "What is 3 plus 3?" and samples[3].answer == "6"  # int -> "6"
    assert samples[3].id == f"hf:{saved['single']}/3" and samples[3].dataset == f"hf:{saved['single']}"
    assert samples[3].metadata == {"source": str(saved["single"]), "row": 3, "fields": {"level": 0}}
    assert source_format(f"hf:{saved['single']}").instruction == INSTRUCTION_MATH


def test_dataset_dict_splits_and_field_mapping(saved):
    d = saved["dict"]
    test = load_dataset(f"hf:{d}:test?question=problem_text&answer=sol")
    assert _pairs(test) == [(r["question"], str(r["answer"])) for r in ROWS[30:]]
    assert test[0].id == f"hf:{d}:test/0" and test[0].metadata["source"] == f"{d}:test"
    assert len(load_dataset(f"hf:{d}:train?question=problem_text&answer=sol")) == 30
    with pytest.raises(DatasetError, match=r"has the splits train, test; name one, e\.g\. hf:.*:train"):
        load_dataset(f"hf:{d}?question=problem_text&answer=sol")
    with pytest.raises(DatasetError, match=r"no split 'validation'; its splits: train, test"):
        load_dataset(f"hf:{d}:validation")
    # the default field names are absent: the error names them and the fields present
    with pytest.raises(DatasetError, match=r"row 1: no question field: none of question, problem, "
                                           r"input, prompt is present \(fields present: "
                                           r"problem_text, sol\)"):
        load_dataset(f"hf:{d}:train")
    with pytest.raises(DatasetError, match=r"row 1: field 'nope' is missing \(fields present: "
                                           r"problem_text, sol\)"):
        load_dataset(f"hf:{d}:train?question=problem_text&answer=nope")


def test_dataset_repository_directory(saved):
    repo = saved["repo"]
    plain = load_dataset(f"hf:{repo}")  # one split (train): no need to name it
    assert _pairs(plain) == _pairs(load_dataset(f"file:{saved['jsonl']}"))
    assert _pairs(load_dataset(f"hf:{repo}:train")) == _pairs(plain)
    with pytest.raises(DatasetError, match=r"no split 'test'; its splits: train"):
        load_dataset(f"hf:{repo}:test")


def test_seeded_split_is_the_file_split(saved):
    spec = f"hf:{saved['single']}"
    train = load_dataset(f"{spec}?split=train", split_seed=1)
    held = load_dataset(f"{spec}?split=heldout", split_seed=1)
    assert len(held) == 8 and len(train) == 32  # round(0.2 x 40 distinct questions)
    assert not {s.question for s in train} & {s.question for s in held}
    assert sorted(_pairs(train + held)) == sorted(_pairs(load_dataset(spec)))
    # same seed: same split (and order); another seed: another split
    assert _pairs(load_dataset(f"{spec}?split=heldout", split_seed=1)) == _pairs(held)
    assert {s.question for s in load_dataset(f"{spec}?split=heldout", split_seed=2)} != {
        s.question for s in held}
    # exactly the split a file: spec of the same rows gets
    assert _pairs(held) == _pairs(load_dataset(f"file:{saved['jsonl']}?split=heldout", split_seed=1))
    d = saved["dict"]
    a = load_dataset(f"hf:{d}:train?question=problem_text&answer=sol&split=heldout", split_seed=3)
    assert len(a) == 6 and a == load_dataset(
        f"hf:{d}:train?question=problem_text&answer=sol&split=heldout", split_seed=3)


def test_nothing_is_downloaded_and_errors_say_what_to_do(saved, tmp_path, monkeypatch):
    for spec in (f"hf:{tmp_path / 'absent'}", "hf:HuggingFaceH4/MATH-500",
                 "hf:HuggingFaceH4/MATH-500:test"):
        with pytest.raises(DatasetError, match=r"does not exist locally.*Hub is never contacted"
                                               r".*save_to_disk"):
            load_dataset(spec)
    with pytest.raises(DatasetError, match=r"is a file; hf: takes a directory.*use file:"):
        load_dataset(f"hf:{saved['jsonl']}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"datasets cannot read .*empty"):
        load_dataset(f"hf:{tmp_path / 'empty'}")
    with pytest.raises(DatasetError, match=r"holds a single Dataset \(split unnamed\), which has "
                                           r"no split 'train'"):
        load_dataset(f"hf:{saved['single']}:train")
    with pytest.raises(DatasetError, match=r"unknown option\(s\) qestion; hf specs accept"):
        load_dataset(f"hf:{saved['single']}?qestion=q")
    with pytest.raises(DatasetError, match=r"option split='test'; use train or heldout"):
        load_dataset(f"hf:{saved['single']}?split=test")

    # the loader runs offline, and puts the environment back afterwards
    seen = {}
    real = datasets.load_from_disk

    def spy(path, *a, **kw):
        seen.update(env=os.environ.get("HF_DATASETS_OFFLINE"), hub=os.environ.get("HF_HUB_OFFLINE"),
                    config=datasets.config.HF_DATASETS_OFFLINE)
        return real(path, *a, **kw)

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(datasets, "load_from_disk", spy)
    before = datasets.config.HF_DATASETS_OFFLINE
    assert len(load_dataset(f"hf:{saved['single']}")) == 40
    assert seen == {"env": "1", "hub": "1", "config": True}
    assert "HF_DATASETS_OFFLINE" not in os.environ and datasets.config.HF_DATASETS_OFFLINE == before


def test_malformed_rows_are_named_or_skipped(tmp_path):
    path = tmp_path / "bad"
    datasets.Dataset.from_list([{"question": "ok?", "answer": "1"}, {"question": "", "answer": "2"},
                                {"question": "x?", "answer": None}]).save_to_disk(str(path))
    with pytest.raises(DatasetError, match=r"row 2: field 'question': question is an empty string"):
        load_dataset(f"hf:{path}")
    report = load_dataset_report(f"hf:{path}", skip_malformed=True)
    assert _pairs(report.samples) == [("ok?", "1")] and [n for n, _ in report.skipped] == [2, 3]
    # fresh-user trial 3, finding 8: a null answer was reported as "no answer field ... (fields
    # present: answer, question)"; the column is there, its value is null
    assert report.skipped[1][1] == "field 'answer': the answer is null (empty); fill it in or drop the row"


def test_a_dataset_saved_with_no_rows_says_so(tmp_path):
    """Fresh-user trial 3, finding 9: a Dataset saved with 0 rows (which datasets itself cannot
    open: IndexError) was reported as not a dataset directory at all."""
    for name, obj in (("single", datasets.Dataset.from_dict({"question": [], "answer": []})),
                      ("dict", datasets.DatasetDict({"train": datasets.Dataset.from_dict({"question": []})}))):
        obj.save_to_disk(str(tmp_path / name))
        with pytest.raises(DatasetError, match=rf"hf dataset {tmp_path / name}: it has no rows \(saved with 0 rows"):
            load_dataset(f"hf:{tmp_path / name}")
