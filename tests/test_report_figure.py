"""report.png as a user reads it (issue 44, section 4): every drawn line is in a legend, running
means say so, the version axis has integer ticks, legends sit below the panels (off the data), and
a panel that means nothing for the run (per-block gradient norms of a head critic) is left out."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from conveyor.runlog import plot_report  # noqa: E402


def _run(tmp_path, critic_kinds=()):
    rows = []
    for step in range(1, 8):
        r = {"step": step, "reward/mean": 0.1 * step, "rollout/accuracy": 0.05 * step, "staleness/mean": 1.0,
             "staleness/max": 2.0, "throughput/generated_tokens_per_s": 40.0 + step, "train/tokens_per_s": 50.0,
             "busy/trainer": 0.9, "busy/engine": 0.7, "response/length_mean": 30.0 + step}
        if critic_kinds:
            r.update({"critic/value_loss": 0.1, "critic/explained_variance": 0.2, "value/first_value_corr": 0.1 * step,
                      "value/first_explained_variance": 0.05 * step, "value/prompt_corr": float("nan")})
            for b in range(5):  # a critic that learns: later steps calibrated (value = return)
                r.update({f"value/calib{b}_value": 0.2 * b, f"value/calib{b}_return": 0.2 * b * step / 7,
                          f"value/calib{b}_count": 3.0})
            r.update({f"critic/grad_norm_{k}": 1.0 for k in critic_kinds})
        rows.append(r)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return tmp_path


@pytest.fixture
def figures(monkeypatch):
    kept = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    yield kept
    for f in kept:
        real_close(f)


def _lines(ax):
    return [ln for ln in ax.get_lines() if len(ln.get_xdata()) > 2]  # curves, not alert markers


def test_every_curve_is_in_a_legend_below_its_panel_with_integer_version_ticks(tmp_path, figures):
    plot_report(_run(tmp_path))
    (fig,) = figures
    axes = [a for a in fig.axes if a.get_visible()]
    for ax in axes:
        if ax.get_legend() is None:
            continue
        legend_labels = {t.get_text() for t in ax.get_legend().get_texts()}
        twins = [o for o in fig.axes if o is not ax and o.bbox.bounds == ax.bbox.bounds]
        for line in _lines(ax) + [ln for t in twins for ln in _lines(t)]:
            assert line.get_label() in legend_labels, (ax.get_title(), line.get_label())
        assert ax.get_legend()._loc != 0  # placed, not "best" over the data
        if ax.get_title().startswith("calibration"):
            continue  # its x axis holds values, not versions
        ticks = ax.get_xticks()
        assert all(float(t).is_integer() for t in ticks), ticks
    labels = {t.get_text() for t in fig.axes[0].get_legend().get_texts()}
    assert {"reward, per batch", "reward, running mean of 5"} <= labels
    busy = next(a for a in fig.axes if a.get_title().startswith("busy"))
    assert "response length (tokens, right axis)" in {t.get_text() for t in busy.get_legend().get_texts()}


@pytest.mark.parametrize("kinds,drawn", [(("other",), False), (("attention", "mlp", "other"), True)])
def test_the_per_block_gradient_panel_only_for_a_critic_with_blocks(tmp_path, figures, kinds, drawn):
    plot_report(_run(tmp_path, critic_kinds=kinds))
    (fig,) = figures
    titles = [a.get_title() for a in fig.axes if a.axison]
    assert any(t.startswith("critic (") for t in titles)
    assert any(t.startswith("critic gradient norm") for t in titles) == drawn


def test_a_critic_run_has_a_calibration_panel_and_the_values_quality(tmp_path, figures):
    """Issue 45: first-token values binned against returns (first and second half of the steps,
    pooled by bin, count-weighted), with the diagonal; the per-step correlations (a NaN step left out)."""
    plot_report(_run(tmp_path, critic_kinds=("attention", "mlp", "other")))
    (fig,) = figures
    cal = next(a for a in fig.axes if a.get_title().startswith("calibration"))
    lines = {ln.get_label(): ln for ln in cal.get_lines()}
    second = lines["second half of the steps (60 responses)"]  # steps 4-7, 5 bins x 3 each
    assert list(second.get_xdata()) == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8])
    # bin b's return 0.2 b x step / 7 averaged over steps 4..7 (equal counts): 0.2 b x 5.5 / 7
    assert list(second.get_ydata()) == pytest.approx([0.2 * b * 5.5 / 7 for b in range(5)])
    assert "first half of the steps (45 responses)" in lines and "calibrated (value = return)" in lines
    curve = next(a for a in fig.axes if a.get_title().startswith("values on each batch"))
    labels = {ln.get_label() for ln in curve.get_lines()}
    assert "corr(first-token value, return), running mean of 5" in labels
    assert not any(lb.startswith("corr(first-token value, prompt") for lb in labels)  # all NaN: not drawn
