"""The chaos suite's audit (benchmarks/chaos.py) catches each defect it claims to rule out: a
step logged twice, a trajectory group trained twice, a sample handed out and never accounted
for, a broken staleness bound, a final version short of total_steps. Each test breaks a real
run's logs on purpose and asserts the audit reports it (a clean run: no problem)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_chaos():
    spec = importlib.util.spec_from_file_location("chaos", ROOT / "benchmarks" / "chaos.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


chaos = _load_chaos()


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("audit") / "run"
    rc, out = chaos._run(["train", *chaos.COMMON, "trainer.total_steps=3", f"run.dir={run}",
                          "run.eval_before=false", "run.eval_after=false"])
    assert rc == 0, out[-2000:]
    return run


@pytest.fixture
def run(clean_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(clean_run, dst)
    return dst


def _rows(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def _write(p: Path, rows: list[dict]) -> None:
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_clean_run_passes(run):
    assert chaos.audit(run, final=True) == []


def test_step_logged_twice_is_caught(run):
    rows = _rows(run / "metrics.jsonl")
    _write(run / "metrics.jsonl", rows + [rows[-1]])
    assert any("metrics.jsonl" in p for p in chaos.audit(run, final=False))


def test_group_trained_twice_is_caught(run):
    rows = _rows(run / "trained.jsonl")
    rows[1]["groups"].append(rows[0]["groups"][0])
    _write(run / "trained.jsonl", rows)
    problems = chaos.audit(run, final=True)
    assert any("trained twice" in p for p in problems), problems


def test_lost_sample_is_caught(run):
    rows = _rows(run / "trained.jsonl")
    rows[0]["groups"].pop()  # a group handed out, trained by nobody, recorded nowhere
    _write(run / "trained.jsonl", rows)
    problems = chaos.audit(run, final=True)
    assert any("never trained or accounted" in p for p in problems), problems


def test_broken_staleness_bound_is_caught(run):
    rows = _rows(run / "metrics.jsonl")
    rows[0]["staleness/max"] = 5  # eta = 1 in chaos.COMMON
    _write(run / "metrics.jsonl", rows)
    assert any("staleness bound" in p for p in chaos.audit(run, final=False))


def test_short_final_version_is_caught(run):
    cfg = json.loads((run / "config.json").read_text())
    cfg["trainer"]["total_steps"] = 4
    (run / "config.json").write_text(json.dumps(cfg))
    assert any("final version" in p for p in chaos.audit(run, final=True))
