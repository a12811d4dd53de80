"""Adaptation lag and old-style suppression of a preference-shift run (issue 13, section 5).

Reads ``RUN/metrics.jsonl`` (the per-step ``style/<name>_rate``: the share of the step's responses
judged in each style, whatever the target; ``style/target``) and ``RUN/config.json``
(``data.style_schedule``, ``data.style_every``: the switches at versions ``k * style_every``), and
prints for every switch:

- the **lag**: policy versions from the switch version ``V`` until the new style's rate exceeds
  ``--new-threshold`` (0.5): the first logged step ``s > V`` with ``rate > 0.5``, as ``s - V``;
- the **suppression**: versions from ``V`` until the old style's rate falls below
  ``--old-threshold`` (0.1), the same way (none when it was below already at ``V``: nothing to
  suppress, said so).

Both are searched up to the next switch; "not reached" when they never happen before it. The
metrics row of step ``s`` describes the batch trained at update ``s`` (responses sampled by
versions ``<= s - 1``, admitted with the target in force then), so even an instant learner shows a
lag of at least 1. ``--smooth N`` first takes a trailing mean over N rows (a 16-response batch is
a noisy rate). Without config.json the switches are read off ``style/target`` (a row whose
majority target changed marks a switch at its step minus 1).

``--out`` draws the per-style rate curves with the switches (matplotlib PNG; default
``RUN/preference_shift.png``). ``--heldout`` also judges the responses of the run's held-out
evaluations (``eval_before.json``, ``eval_step_N.json``, ``eval_after.json``: prompts without a
target) and prints each style's rate per evaluation (loads the judge: ``pip install
'conveyor[styles]'``).

Several run directories (e.g. SAO and the sliding-window baseline, same schedule) are analysed
one after the other and drawn as one figure, a panel per run on shared axes, plus a last panel of
each run's target-style rate (default ``--out``: ``preference_shift_compare.png`` beside the
first run; ``--json`` then holds a list, one entry per run). The last panel is ``style/target_rate``:
each batch's share judged in the target stamped on its own episode.

    python scripts/preference_shift.py RUN_DIR [RUN_DIR ...] [--out PNG] [--smooth N] [--heldout] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

STYLES = ("cute", "chuunibyou", "classical")  # conveyor.rewards.styles.STYLES (index = style/target)


@dataclass(frozen=True)
class Switch:
    """A change of target style at policy version ``version`` (from ``old`` to ``new``)."""

    version: int
    old: str
    new: str


@dataclass(frozen=True)
class Adaptation:
    """How the policy followed one switch.

    Attributes:
        switch: The switch.
        lag: Versions from the switch until the new style's rate exceeded the threshold, or None
            (not reached before the next switch / the end of the run).
        suppression: Versions from the switch until the old style's rate fell below its
            threshold, or None.
        last_step: The last step searched (the next switch's version, or the last logged step).
        old_rate_at_switch: The old style's rate at the last logged step ``<= V`` (smoothed as
            the series), None without one. Below the old threshold already, there was nothing
            to suppress: :attr:`suppression` is then None and the printout says so (fresh-user
            trial 4: "suppressed after 1 version" for a style that was never produced).
    """

    switch: Switch
    lag: int | None
    suppression: int | None
    last_step: int
    old_rate_at_switch: float | None = None

    def nothing_to_suppress(self, old_threshold: float) -> bool:
        """The old style's rate was already below ``old_threshold`` at the switch."""
        return self.old_rate_at_switch is not None and self.old_rate_at_switch < old_threshold


def read_jsonl(path: Path) -> list[dict]:
    """The JSON rows of a ``.jsonl`` file (blank lines skipped; [] when the file is missing)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def schedule_switches(schedule: list[str], every: int, last_version: int) -> list[Switch]:
    """The switches of ``data.style_schedule`` / ``data.style_every`` up to ``last_version``: at
    version ``k * every`` for ``k = 1 .. len(schedule) - 1`` (entries equal to the previous one
    are no switch). Raises ValueError for ``every < 1``."""
    if every < 1:
        raise ValueError(f"data.style_every must be >= 1, got {every}")
    return [Switch(k * every, schedule[k - 1], schedule[k]) for k in range(1, len(schedule))
            if k * every <= last_version and schedule[k] != schedule[k - 1]]


def switches_from_metrics(rows: list[dict]) -> list[Switch]:
    """Switches read off ``style/target`` (index into :data:`STYLES`): a row whose target differs
    from the previous row's marks a switch at its step minus 1."""
    out, prev = [], None
    for r in sorted(rows, key=lambda r: r["step"]):
        t = r.get("style/target")
        if t is None:
            continue
        t = int(t)
        if prev is not None and t != prev:
            out.append(Switch(int(r["step"]) - 1, STYLES[prev], STYLES[t]))
        prev = t
    return out


def rate_series(rows: list[dict], style: str, smooth: int = 1) -> list[tuple[int, float]]:
    """``(step, style/<style>_rate)`` of every row that has it, in step order, each value the
    mean of the last ``smooth`` rows' rates (trailing window, >= 1)."""
    if smooth < 1:
        raise ValueError(f"--smooth must be >= 1, got {smooth}")
    key = f"style/{style}_rate"
    pts = sorted((int(r["step"]), float(r[key])) for r in rows if r.get(key) is not None)
    out = []
    for i, (s, _) in enumerate(pts):
        window = [v for _, v in pts[max(0, i - smooth + 1): i + 1]]
        out.append((s, sum(window) / len(window)))
    return out


def adaptation(rows: list[dict], switch: Switch, until: int | None = None, *, new_threshold: float = 0.5,
               old_threshold: float = 0.1, smooth: int = 1) -> Adaptation:
    """The lag and suppression of one switch (see the module docstring).

    Args:
        rows: metrics.jsonl rows.
        switch: The switch.
        until: The last step to search (the next switch's version); None: to the end.
        new_threshold: The new style's rate must exceed this (strictly).
        old_threshold: The old style's rate must fall below this (strictly).
        smooth: Trailing mean over this many rows first.
    """
    new = rate_series(rows, switch.new, smooth)
    old = rate_series(rows, switch.old, smooth)
    last = max((s for s, _ in new), default=switch.version) if until is None else until

    def first(series, ok) -> int | None:
        return next((s - switch.version for s, v in series if switch.version < s <= last and ok(v)), None)

    at_switch = next((v for s, v in reversed(old) if s <= switch.version), None)
    held = at_switch is None or at_switch >= old_threshold  # else there was nothing to suppress
    return Adaptation(switch, first(new, lambda v: v > new_threshold),
                      first(old, lambda v: v < old_threshold) if held else None, last, at_switch)


def analyse(run: Path, *, new_threshold: float = 0.5, old_threshold: float = 0.1,
            smooth: int = 1) -> tuple[list[dict], list[Adaptation], str]:
    """Rows, per-switch adaptations and a one-line description of the schedule of run ``run``.

    Raises:
        SystemExit: ``run`` is not a directory, has no ``metrics.jsonl``, or no ``style/*`` metrics
            in it.
    """
    if not run.is_dir():
        raise SystemExit(f"{run}: no such run directory")
    if not (run / "metrics.jsonl").is_file():
        raise SystemExit(f"{run}: no metrics.jsonl (not a run directory, or the run has not logged a step yet)")
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if any(f"style/{s}_rate" in r for s in STYLES)]
    if not rows:
        raise SystemExit(f"{run / 'metrics.jsonl'}: no style/<name>_rate metrics: not a preference-shift run "
                         "(data.style_schedule) or no step logged yet")
    last = max(int(r["step"]) for r in rows)
    cfg_path = run / "config.json"
    data = json.loads(cfg_path.read_text()).get("data", {}) if cfg_path.is_file() else {}
    if data.get("style_schedule"):
        sched, every = data["style_schedule"], int(data["style_every"])
        switches = schedule_switches(sched, every, last)
        what = f"schedule {' -> '.join(sched)}, every {every} versions (config.json); steps logged: {last}"
    else:
        switches = switches_from_metrics(rows)
        what = f"switches read off style/target (no config.json schedule); steps logged: {last}"
    out = []
    for i, sw in enumerate(switches):
        until = switches[i + 1].version if i + 1 < len(switches) else None
        out.append(adaptation(rows, sw, until, new_threshold=new_threshold, old_threshold=old_threshold,
                              smooth=smooth))
    return rows, out, what


def plot(rows: list[dict], switches: list[Switch], out: Path, title: str, smooth: int = 1) -> None:
    """Per-style rate curves against the step, switches as dashed vertical lines, to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for style in STYLES:
        pts = rate_series(rows, style, smooth)
        if pts:
            ax.plot([s for s, _ in pts], [v for _, v in pts], label=style, lw=1.5)
    for sw in switches:
        ax.axvline(sw.version, color="grey", ls="--", lw=1)
        ax.text(sw.version, 1.02, f"-> {sw.new}", fontsize=8, ha="left", va="bottom")
    ax.axhline(0.5, color="grey", ls=":", lw=0.8)
    ax.axhline(0.1, color="grey", ls=":", lw=0.8)
    ax.set_ylim(-0.02, 1.1)
    ax.set_xlabel("step (policy version after the update)")
    ax.set_ylabel("share judged in style" + (f" (mean of {smooth} steps)" if smooth > 1 else ""))
    ax.set_title(title, fontsize=9)
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_compare(runs: list[tuple[str, list[dict], list[Switch]]], out: Path, smooth: int = 1) -> None:
    """One panel per run (per-style rates, switches dashed) and a last panel with each run's
    ``style/target_rate`` (the share of each batch judged in the target stamped on its own
    episode), shared step axis, to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs) + 1, 1, figsize=(9, 2.6 * (len(runs) + 1)), sharex=True)
    for ax, (name, rows, switches) in zip(axes, runs, strict=False):
        for style in STYLES:
            pts = rate_series(rows, style, smooth)
            if pts:
                ax.plot([p for p, _ in pts], [v for _, v in pts], label=style, lw=1.5)
        ax.set_title(name, fontsize=9)
        for sw in switches:
            ax.axvline(sw.version, color="grey", ls="--", lw=1)
    last = axes[-1]
    for name, rows, _ in runs:
        pts = rate_series(rows, "target", smooth)
        last.plot([p for p, _ in pts], [v for _, v in pts], label=name, lw=1.5)
    last.set_title("rate of the target style (style/target_rate)", fontsize=9)
    for sw in runs[0][2]:
        last.axvline(sw.version, color="grey", ls="--", lw=1)
    for ax in axes:
        ax.axhline(0.5, color="grey", ls=":", lw=0.8)
        ax.axhline(0.1, color="grey", ls=":", lw=0.8)
        ax.set_ylim(-0.02, 1.05)
        ax.legend(loc="upper left", fontsize=7)
        ax.set_ylabel("share" + (f" (mean of {smooth})" if smooth > 1 else ""), fontsize=8)
    last.set_xlabel("step (policy version after the update)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def heldout_rates(run: Path) -> list[tuple[str, dict[str, float], int]]:
    """``(file name, {style: share judged in it}, responses)`` for each held-out evaluation of the
    run (``eval_before.json``, ``eval_step_N.json`` by N, ``eval_after.json``), judged now with
    :func:`conveyor.rewards.styles.style_rates` (on topic for each record's prompt, looked up in
    the evaluation's data set; without the on-topic check when one is not found)."""
    from conveyor.rewards.styles import style_rates

    def order(p: Path) -> tuple[int, int]:
        stem = p.stem
        if stem == "eval_before":
            return (0, 0)
        if stem.startswith("eval_step_") and stem[len("eval_step_"):].isdigit():
            return (1, int(stem[len("eval_step_"):]))
        return (2, 0)

    out = []
    for p in sorted(run.glob("eval_*.json"), key=order):
        ev = json.loads(p.read_text())
        records = ev.get("records", [])
        questions = _questions(ev.get("dataset", ""))
        texts = [t for r in records for t in r.get("responses", [])]
        prompts = [questions.get(r["id"]) for r in records for _ in r.get("responses", [])]
        out.append((p.name, style_rates(texts, prompts if None not in prompts else None), len(texts)))
    return out


def _questions(spec: str) -> dict[str, str]:
    """``sample id -> question`` of data set ``spec`` (for the judge's on-topic check); {} when it
    does not load."""
    from conveyor.data import DatasetError, load_dataset

    try:
        return {s.id: s.question for s in load_dataset(spec)} if spec else {}
    except DatasetError:
        return {}


def _fmt(n: int | None, last: int) -> str:
    return (f"{n} version{'' if n == 1 else 's'}" if n is not None else f"not reached by step {last}")


def report(run: Path, a: argparse.Namespace, *, draw: bool) -> tuple[dict, list[dict], list[Switch]]:
    """Print one run's analysis (and draw its curves when ``draw``); return its JSON entry, its
    metrics rows and its switches."""
    rows, adaptations, what = analyse(run, new_threshold=a.new_threshold, old_threshold=a.old_threshold,
                                      smooth=a.smooth)
    print(f"{run}: {what}")
    if not adaptations:
        print("no switch within the logged steps")
    for ad in adaptations:
        sw = ad.switch
        if ad.nothing_to_suppress(a.old_threshold):
            old = (f"{sw.old} was below {a.old_threshold} already at the switch (rate {ad.old_rate_at_switch:.2f}): "
                   "nothing to suppress")
        else:
            old = f"{sw.old} suppressed after {_fmt(ad.suppression, ad.last_step)} (rate < {a.old_threshold})"
        print(f"switch at v{sw.version}: {sw.old} -> {sw.new}: lag {_fmt(ad.lag, ad.last_step)} "
              f"({sw.new} rate > {a.new_threshold}); {old}")
    switches = [ad.switch for ad in adaptations]
    if draw:
        out = a.out or run / "preference_shift.png"
        plot(rows, switches, out, f"{run.name}: {what}", a.smooth)
        print(f"curves: {out}")
    held = heldout_rates(run) if a.heldout else []
    for name, rates, n in held:
        print(f"held-out {name} ({n} responses): " + ", ".join(f"{s} {rates[s]:.2f}" for s in STYLES))
    entry = {"run": str(run), "schedule": what, "switches": [asdict(ad) for ad in adaptations],
             "heldout": [{"file": f, "rates": r, "responses": n} for f, r, n in held]}
    return entry, rows, switches


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, nargs="+", help="the run directory (metrics.jsonl, config.json); several: "
                    "compared in one figure")
    ap.add_argument("--out", type=Path, default=None, help="PNG of the curves (default RUN/preference_shift.png; "
                    "several runs: preference_shift_compare.png beside the first)")
    ap.add_argument("--smooth", type=int, default=1, help="trailing mean over N steps first (default 1: raw)")
    ap.add_argument("--new-threshold", type=float, default=0.5)
    ap.add_argument("--old-threshold", type=float, default=0.1)
    ap.add_argument("--heldout", action="store_true", help="also judge the held-out evaluations' responses")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    a = ap.parse_args(argv)
    if a.smooth < 1:  # a usage error, not a traceback (fresh-user trial 5)
        ap.error(f"--smooth must be >= 1 (a trailing mean over N steps), got {a.smooth}")
    single = len(a.run) == 1
    entries, drawn = [], []
    for run in a.run:
        entry, rows, switches = report(run, a, draw=single)
        entries.append(entry)
        drawn.append((run.name, rows, switches))
    if not single:
        out = a.out or a.run[0].parent / "preference_shift_compare.png"
        plot_compare(drawn, out, a.smooth)
        print(f"curves: {out}")
    if a.json:
        a.json.write_text(json.dumps(entries[0] if single else entries, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
