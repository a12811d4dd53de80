"""Run directory outputs: metrics as JSONL and TensorBoard events, events log, report PNG."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


class MetricsLogger:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

    Args:
        run_dir: The run directory (created if missing).
        tensorboard: Write TensorBoard event files under ``run_dir/tb``.
        samples_per_step: Responses per step copied to ``samples.jsonl``.
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, samples_per_step: int = 2):
        self.samples_per_step = samples_per_step
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._f = self.path.open("a")
        self._events = (self.run_dir / "events.jsonl").open("a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tb"))
            except Exception:  # tensorboard missing: JSONL still works
                self._tb = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record ``metrics`` at ``step`` (policy version after the update)."""
        row = {"step": step, "time": time.time(), **{k: _clean(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def trained(self, step: int, batch) -> None:
        """Append to ``trained.jsonl`` which trajectory groups (and samples, versions) the update
        that produced policy version ``step`` consumed: an audit trail showing that no trajectory
        is trained twice, across resumes too. Each group also lists ``lengths`` ([prompt,
        response] tokens per trajectory), ``env_seconds`` (environment wait) and
        ``reward_seconds`` (reward scoring latency of the trajectory's group), the trace
        ``conveyor simulate`` calibrates from."""
        groups: dict[str, dict] = {}
        for t in batch:
            g = groups.setdefault(t.group_id, {"group": t.group_id, "sample": t.sample.id, "oldest_version": t.oldest_version,
                                               "lengths": [], "env_seconds": []})
            g["oldest_version"] = min(g["oldest_version"], t.oldest_version)
            # [prompt tokens, response tokens] and environment wait (s): the simulator's calibration trace
            g["lengths"].append([len(t.prompt_ids), len(t.response_ids)])
            g["env_seconds"].append(float(t.metadata.get("env_seconds", 0.0)))
            g.setdefault("reward_seconds", []).append(float(t.metadata.get("reward_seconds", 0.0)))
        with (self.run_dir / "trained.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "groups": list(groups.values())}) + "\n")
        # a few responses per step, to read what the policy actually writes
        with (self.run_dir / "samples.jsonl").open("a") as f:
            for t in batch[: self.samples_per_step]:
                f.write(json.dumps({
                    "step": step, "sample": t.sample.id, "question": t.sample.question, "answer": t.sample.answer,
                    "response": t.text, "reward": t.reward, "correct": t.correct, "versions": sorted(set(t.versions)),
                }) + "\n")

    def event(self, kind: str, **fields) -> None:
        """Record a discrete event (checkpoint, resume, skipped step, eval, ...)."""
        self._events.write(json.dumps({"time": time.time(), "event": kind, **fields}) + "\n")
        self._events.flush()

    def close(self) -> None:
        """Flush and close the files."""
        self._f.close()
        self._events.close()
        if self._tb is not None:
            self._tb.close()


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def read_metrics(path: str | Path) -> list[dict]:
    """Rows of a ``metrics.jsonl`` file (later rows for the same step, e.g. after a resume, win)."""
    rows: dict[int, dict] = {}
    p = Path(path)
    if not p.is_file():
        return []
    for line in p.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows[r["step"]] = r
    return [rows[k] for k in sorted(rows)]


def plot_report(run_dir: str | Path, out: str | Path | None = None, title: str = "") -> Path:
    """Draw reward / accuracy / staleness / throughput curves of a run into ``report.png``.

    Returns:
        The PNG path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    out = Path(out) if out else run_dir / "report.png"
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))

    def series(key):
        xs = [r["step"] for r in rows if r.get(key) is not None]
        ys = [r[key] for r in rows if r.get(key) is not None]
        return xs, ys

    def smooth(ys, w=5):
        out_, acc = [], []
        for y in ys:
            acc.append(y)
            acc = acc[-w:]
            out_.append(sum(acc) / len(acc))
        return out_

    ax = axes[0][0]
    for key, label in (("reward/mean", "reward"), ("rollout/accuracy", "accuracy (sampled)")):
        xs, ys = series(key)
        if ys:
            ax.plot(xs, ys, alpha=0.3)
            ax.plot(xs, smooth(ys), label=label)
    ax.set_title("reward and accuracy of training batches")
    ax.set_xlabel("policy version")
    ax.legend()
    ax = axes[0][1]
    for key in ("staleness/mean", "staleness/max"):
        xs, ys = series(key)
        if ys:
            ax.plot(xs, ys, label=key)
    xs, ys = series("staleness/multi_version_share")
    if ys:
        ax.plot(xs, ys, label="multi-version share")
    ax.set_title("staleness (versions, from oldest token)")
    ax.set_xlabel("policy version")
    ax.legend()
    ax = axes[1][0]
    for key in ("throughput/generated_tokens_per_s", "train/tokens_per_s"):
        xs, ys = series(key)
        if ys:
            ax.plot(xs, ys, label=key)
    ax.set_title("throughput (tokens/s)")
    ax.set_xlabel("policy version")
    ax.legend()
    ax = axes[1][1]
    for key in ("busy/trainer", "busy/engine"):
        xs, ys = series(key)
        if ys:
            ax.plot(xs, ys, label=key)
    xs, ys = series("response/length_mean")
    if ys:
        ax2 = ax.twinx()
        ax2.plot(xs, ys, color="gray", alpha=0.6, label="response length")
        ax2.set_ylabel("tokens")
    ax.set_ylim(0, 1.05)
    ax.set_title("busy fractions (cumulative) / response length")
    ax.set_xlabel("policy version")
    ax.legend(loc="lower left")
    fig.suptitle(title or str(run_dir))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
