"""``scripts/compare_runs.py --table``: the main job's before / after rows (docs/results/main_job.md)."""

from __future__ import annotations

import json
from pathlib import Path

from tests._scripts import load_script


def _module():
    return load_script("scripts/compare_runs.py")


def _run(tmp_path: Path, name: str, last: dict, **summary) -> Path:
    run = tmp_path / name
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({
        "steps": 2, "wall_seconds": 1500.0, "heldout_before": 0.2, "heldout_after": 0.45,
        "trainer_busy": 0.5, "engine_busy": 0.875, **summary}))
    (run / "config.json").write_text(json.dumps({"rollout": {"group_size": 8}}))
    (run / "engine_stats.json").write_text(json.dumps({"generated_tokens": 30000, "dtype": "bfloat16"}))
    rows = [{"step": 1, "staleness/mean": 1.0, "rollout/dropped_stale": 0.0, "rollout/episodes_accepted": 4,
             "throughput/generated_tokens_per_s": 10.0, "time/step_wall_s": 500.0},
            {"step": 2, "staleness/mean": 2.0, "throughput/generated_tokens_per_s": 25.0, "time/step_wall_s": 1000.0,
             **last}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_table_row_reports_wall_clock_accuracy_busy_drops_staleness_and_tokens_per_second(tmp_path):
    mod = _module()
    row = mod.table_row(_run(tmp_path, "a", {"rollout/dropped_stale": 8.0, "rollout/dropped_stale_share": 0.05,
                                             "rollout/episodes_accepted": 20}), "after")
    assert row == ("| after | 2 | 1,500 s | 0.200 -> 0.450 | 0.50 / 0.88 / - | 5.0% (8) | 1.50 | 20.0 | bfloat16 |")
    # tokens/s: (10 x 500 + 25 x 1000) / 1500 = 20.0 (the engine's 30,000 include evaluations)
    # a run from before the share metric: dropped over accepted trajectories (20 groups of 8)
    old = mod.table_row(_run(tmp_path, "b", {"rollout/dropped_stale": 16.0, "rollout/episodes_accepted": 20}), "b")
    assert "| 10.0% (16) |" in old
    # the cores' busy share: summary.json's cpu_busy where the run wrote it; for a one-process run
    # whose summary predates the key, its last row's busy/cpu (it covers the loop)
    assert "| 0.50 / 0.88 / 0.93 |" in mod.table_row(
        _run(tmp_path, "c", {"rollout/dropped_stale_share": 0.0}, cpu_busy=0.925), "c")
    assert "| 0.50 / 0.88 / 0.61 |" in mod.table_row(
        _run(tmp_path, "d", {"rollout/dropped_stale_share": 0.0, "busy/cpu": 0.61}), "d")
    assert mod.TABLE_HEADER.count("\n") == 1 and mod.TABLE_HEADER.split("\n")[0].count("|") == row.count("|")


def test_a_resumed_runs_wall_clock_adds_up_its_processes_and_bad_runs_are_named(tmp_path, monkeypatch, capsys):
    """Fresh-user trial 5: a resumed run's curve went back in time at each resume (its
    ``time/elapsed_s`` restarts in each process ``segment``); a mistyped run was an empty curve
    (plot) or a traceback (``--table``)."""
    import sys

    import pytest

    mod = _module()
    rows = [{"step": 1, "time/elapsed_s": 0.7, "segment": 0}, {"step": 2, "time/elapsed_s": 0.9, "segment": 0},
            {"step": 3, "time/elapsed_s": 0.6, "segment": 1}, {"step": 4, "time/elapsed_s": 1.4, "segment": 1},
            {"step": 5, "time/elapsed_s": 0.5, "segment": 2}]
    assert mod.run_elapsed(rows) == pytest.approx([0.7, 0.9, 1.5, 2.3, 2.8])  # offsets 0, 0.9, 0.9 + 1.4
    assert mod.run_elapsed([{"step": 1, "time/elapsed_s": 3.0}]) == [3.0]  # runs from before segments
    run = _run(tmp_path, "a", {})
    for args, needle in ([[str(tmp_path / "nope"), str(run)], "nope: no such run directory"],
                         [[str(tmp_path)], "no metrics.jsonl"],
                         [[str(tmp_path / "nope"), "--table"], "nope: no such run directory"]):
        monkeypatch.setattr(sys, "argv", ["compare_runs.py", *args])
        with pytest.raises(SystemExit, match=needle):
            mod.main()
    assert "| run |" not in capsys.readouterr().out  # nothing printed before the error
    (run / "summary.json").unlink()
    monkeypatch.setattr(sys, "argv", ["compare_runs.py", str(run), "--table"])
    with pytest.raises(SystemExit, match="no summary.json"):
        mod.main()
