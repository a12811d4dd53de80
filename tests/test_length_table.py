"""``scripts/length_table.py``: the length drift of agent runs by windows of updates (issue 45
section 4, docs/results/critics.md)."""

from __future__ import annotations

import json
import math

import pytest

from tests._scripts import load_script


def _module():
    return load_script("scripts/length_table.py")


def test_window_means_by_hand():
    wm = _module().window_means
    assert wm([1, 2, 3, 4, 5], 2) == [1.5, 3.5, 5.0]  # the last window is shorter
    assert wm([None, 2, math.nan, 4], 2) == [2.0, 4.0]  # missing values are left out
    assert wm([None, None, 1], 2) == [None, 1.0]
    assert wm([], 4) == []
    with pytest.raises(ValueError, match="width"):
        wm([1], 0)


def test_run_row_reads_metrics_and_the_heldout_result(tmp_path, capsys):
    mod = _module()
    run = tmp_path / "r"
    run.mkdir()
    rows = [{"step": s, "agent/turns_mean": t, "agent/tool_call_rate": c, "response/length_mean": n,
             "reward/mean": 0.0, "advantage/sum_unrewarded": u}
            for s, t, c, n, u in ((1, 3.0, 0.9, 400, -1.0), (2, 2.0, 0.7, 200, -3.0), (3, 1.0, 0.1, 50, 0.5))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert mod.run_row(run, "x", 2) == ("| x | 3 | 2.50 -> 1.00 | 0.80 -> 0.10 | 300 -> 50 | 0.000 -> 0.000 "
                                        "| -2.00 -> 0.50 | - |")
    (run / "eval_after.json").write_text(json.dumps({"pass_at_1": 0.1181}))
    mod.main([f"{run}=base", "--width", "3"])
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "| base | 3 | 2.00 | 0.57 | 217 | 0.000 | -1.17 | 0.118 |"
    assert out[0].count("|") == out[1].count("|") == out[2].count("|")  # header, rule and row line up
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        mod.run_row(tmp_path, "y", 2)
