"""Property tests (hypothesis): random configuration overrides, config files and data rows never
give a traceback, only a valid result or a clear error naming the key / file / line.

Issue 10 section 6 (the chaos suite's input half): a user's typo must never surface as a
``KeyError`` / ``TypeError`` / ``AttributeError`` from deep inside the code.
"""

from __future__ import annotations

import json
import math
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.config import ConfigError, TrainConfig, load_config
from conveyor.data import load_dataset
from conveyor.data.registry import DatasetError

_SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _known_keys() -> list[str]:
    """Every dotted key of the config (``trainer.lr``, ``async.eta``, ...)."""
    out: list[str] = []

    def walk(prefix: str, d: dict) -> None:
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict):
                out.append(key)  # a section name itself is a (bad) key to override
                walk(key, v)
            else:
                out.append(key)

    walk("", TrainConfig().to_dict())
    return out


KNOWN = _known_keys()
_ident = st.text(alphabet=string.ascii_lowercase + "_.", min_size=0, max_size=12)
keys = st.one_of(
    st.sampled_from(KNOWN),
    _ident,
    st.builds(lambda k, s: f"{k}.{s}", st.sampled_from(KNOWN), _ident),
    st.text(max_size=10),
)
values = st.one_of(
    st.text(max_size=20),
    st.integers(-(10**30), 10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["null", "none", "true", "false", "[]", "{}", "[1, 2]", '{"a": 1}', "1e999",
                     "-1e999", "NaN", "Infinity", "-0", "0", "''", '"x"', "=", "==", "a=b"]),
)
overrides = st.lists(st.one_of(st.builds(lambda k, v: f"{k}={v}", keys, values), st.text(max_size=15)),
                     max_size=4)


def _finite_numbers(cfg: TrainConfig) -> None:
    """A valid config has no non-finite number anywhere (inf lr, nan eta, ...)."""

    def walk(path: str, v) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{path}.{k}" if path else k, x)
        elif isinstance(v, float):
            assert math.isfinite(v), f"config accepted a non-finite value at {path}: {v}"

    walk("", cfg.to_dict())


@_SETTINGS
@given(overrides)
def test_random_overrides_give_a_config_or_a_config_error(items):
    try:
        cfg = load_config(None, items)
    except ConfigError as e:
        msg = str(e)
        assert msg.strip(), "empty error message"
        # the message names something the user wrote: a key, an override or the item itself
        # the message names what the user wrote: the override (repr) or the key, or lists the keys
        named = [repr(item) for item in items] + [item.split("=", 1)[0].strip() for item in items]
        assert "invalid config" in msg or any(n and n in msg for n in named), msg
        return
    assert isinstance(cfg, TrainConfig)
    _finite_numbers(cfg)
    # what was accepted round-trips: the saved config.json loads back to the same config
    assert TrainConfig.model_validate(json.loads(json.dumps(cfg.to_dict()))) == cfg


@_SETTINGS
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1"))),
       st.sampled_from([".yaml", ".json", ".yml"]))
def test_random_config_files_give_a_config_or_an_error_naming_the_file(tmp_path_factory, text, suffix):
    p = Path(tmp_path_factory.mktemp("cfg")) / f"c{suffix}"
    p.write_text(text, encoding="utf-8", errors="surrogateescape")
    try:
        cfg = load_config(p)
    except ConfigError as e:
        assert str(p) in str(e) or "invalid config" in str(e)
        return
    assert isinstance(cfg, TrainConfig)
    _finite_numbers(cfg)


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(10**20), 10**20),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30))
json_values = st.recursive(json_scalars, lambda c: st.one_of(st.lists(c, max_size=3),
                                                             st.dictionaries(st.text(max_size=8), c, max_size=3)),
                           max_leaves=6)
rows = st.one_of(
    st.fixed_dictionaries({"question": json_values, "answer": json_values}),
    st.dictionaries(st.sampled_from(["question", "problem", "input", "answer", "target", "solution", "x"]),
                    json_values, max_size=4),
    json_values,
)


def _dump_line(row) -> str:
    return json.dumps(row, allow_nan=True)


@_SETTINGS
@given(st.lists(st.one_of(rows.map(_dump_line), st.text(max_size=40).filter(lambda s: "\n" not in s and "\r" not in s)),
                min_size=0, max_size=6))
def test_random_jsonl_rows_give_samples_or_a_dataset_error_naming_file_and_line(tmp_path_factory, lines):
    p = Path(tmp_path_factory.mktemp("data")) / "rows.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogateescape")
    try:
        samples = load_dataset(f"file:{p}")
    except DatasetError as e:
        assert str(p) in str(e), f"error does not name the file: {e}"
        return
    assert samples, "an empty data set must be an error naming the file, not an empty list"
    for s in samples:
        assert isinstance(s.question, str) and s.question.strip()
        assert isinstance(s.answer, str) and s.answer != ""


@_SETTINGS
@given(st.binary(max_size=120))
def test_random_bytes_as_data_file_give_a_dataset_error(tmp_path_factory, blob):
    for suffix in (".jsonl", ".json", ".parquet"):
        p = Path(tmp_path_factory.mktemp("data")) / f"rows{suffix}"
        p.write_bytes(blob)
        try:
            samples = load_dataset(f"file:{p}")
        except DatasetError as e:
            assert str(p) in str(e), f"error does not name the file: {e}"
            continue
        assert samples


@pytest.mark.parametrize("text", ["", "\n\n", "   \n"])
def test_empty_data_file_is_an_error_naming_the_file(tmp_path, text):
    p = tmp_path / "empty.jsonl"
    p.write_text(text)
    with pytest.raises(DatasetError, match="empty.jsonl"):
        load_dataset(f"file:{p}")
