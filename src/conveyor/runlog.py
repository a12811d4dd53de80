"""Run directory outputs: metrics as JSONL and TensorBoard events, events log, report PNG.

Each step appears once in every log, across crashes and resumes (MISSION.md section 1: the
audit trail shows that no trajectory is trained twice). A resume from the checkpoint at version
``V`` calls :func:`supersede_after`, which moves the rows a crashed process wrote after ``V``
(steps ``> V`` of ``metrics.jsonl``, ``trained.jsonl``, ``samples.jsonl``, and half-written
lines) to ``<name>.superseded.jsonl`` siblings and rewrites the logs atomically; ``events.jsonl``
keeps the crash history, with the events after ``V`` marked ``"superseded"``; TensorBoard is
reopened with ``purge_step = V + 1`` (TensorBoard then discards the older events at steps
``>= V + 1``). Every metrics row carries its process ``segment`` (0 for the first process, +1 per
resume) so :func:`segment_summary` can report the wall-clock of all segments.

Weights & Biases (``log.wandb=true``, issue 15 section 3) is one more destination of the same
fan-out: :class:`MetricsLogger` sends every metrics row, critic warm-up row, ``scalars`` value and
event to the W&B run it opened (config: the resolved run config), and the final ``report.png``
(:meth:`MetricsLogger.report`). The W&B run id lives in ``RUN/wandb_run_id``, so a resumed run
continues the same W&B run; a W&B failure is one warning (and a ``wandb_failed`` event), never the
end of training.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import string
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.runtime_files import atomic_write, atomic_write_text

if TYPE_CHECKING:
    from conveyor.config import LogConfig

log = logging.getLogger(__name__)

STEP_LOGS = ("metrics.jsonl", "trained.jsonl", "samples.jsonl", "critic_warmup.jsonl")
CRITIC_WARMUP = "critic_warmup.jsonl"
EVENTS = "events.jsonl"
WANDB_RUN_ID = "wandb_run_id"
"""Run-directory file holding the W&B run id (a resume continues that W&B run)."""
WANDB_STEP = "wandb_step"
"""Run-directory file holding the next W&B history index (``_step``), so a resumed process
continues W&B's own step counter instead of restarting it at 0 (offline runs do)."""
WANDB_INSTALL_HINT = "pip install 'conveyor[wandb]'"


def require_wandb():
    """Import Weights & Biases (``log.wandb=true``).

    Returns:
        The ``wandb`` module.

    Raises:
        ImportError: wandb is not installed; the message names ``pip install 'conveyor[wandb]'``.
    """
    try:
        import wandb
    except ImportError as e:
        raise ImportError(f"log.wandb=true needs Weights & Biases, which is not installed: "
                          f"{WANDB_INSTALL_HINT} (or log.wandb=false)") from e
    return wandb


def new_wandb_id() -> str:
    """A fresh W&B run id: 8 random characters from ``[a-z0-9]`` (the form W&B generates)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def wandb_run_id(run_dir: str | Path, new_id: Callable[[], str] = new_wandb_id) -> str:
    """The W&B run id of a run directory: the one in ``RUN/wandb_run_id``, else ``new_id()``,
    written there (atomically) first, so every later process of the run (``--resume``) logs to the
    same W&B run.

    Args:
        run_dir: The run directory.
        new_id: Makes a fresh id (default :func:`new_wandb_id`).

    Returns:
        The id.

    Raises:
        RunFileError: the id file cannot be written.
    """
    p = Path(run_dir) / WANDB_RUN_ID
    if p.is_file():
        run_id = p.read_text().strip()
        if run_id:
            return run_id
    run_id = new_id()
    atomic_write_text(p, run_id + "\n", what=str(p))
    return run_id


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


class MetricsLogger:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

    Args:
        run_dir: The run directory (created if missing).
        tensorboard: Write TensorBoard event files under ``run_dir/tb``.
        samples_per_step: Responses per step copied to ``samples.jsonl``.
        version: The policy version at start (events without an explicit ``version`` get the
            latest one seen: this, then each :meth:`log` step).
        segment: This process's segment number (0, then +1 per resume; :func:`next_segment`),
            written into every metrics row and event.
        purge_step: On a resume from version ``V``: ``V + 1``, so TensorBoard discards events a
            crashed process logged at steps ``>= V + 1`` (``SummaryWriter(purge_step=...)``).
        log_cfg: The config's ``log`` section (:class:`~conveyor.config.LogConfig`); with
            ``wandb=true`` every row, value and event also goes to a Weights & Biases run:
            project ``wandb_project``, name ``wandb_run_name`` (default: the run directory's
            name), mode ``wandb_mode`` (offline by default), files under ``wandb_dir`` (default:
            the run directory), id from :func:`wandb_run_id` with ``resume="allow"``. W&B's x
            axis is the row's ``step`` (``define_metric("*", step_metric="step")``; W&B's own
            ``_step`` only counts the entries, continued across resumes via ``RUN/wandb_step``),
            so critic warm-up rows (steps <= 0) and the steps a resume repeats are kept too.
        run_config: The resolved config (``TrainConfig.to_dict()``), W&B's run config.

    Raises:
        ImportError: ``log_cfg.wandb`` is true and wandb is not installed (the message names
            ``pip install 'conveyor[wandb]'``). Any failure of W&B itself (start included) is a
            warning: the run continues with JSONL and TensorBoard.
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, samples_per_step: int = 2, *,
                 version: int = 0, segment: int = 0, purge_step: int | None = None,
                 log_cfg: LogConfig | None = None, run_config: dict[str, Any] | None = None):
        self.samples_per_step = samples_per_step
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.version = version
        self.segment = segment
        self.path = self.run_dir / "metrics.jsonl"
        self._f = self.path.open("a")
        self._events = (self.run_dir / EVENTS).open("a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=purge_step)
            except Exception:  # tensorboard missing: JSONL still works
                self._tb = None
        self._wb = None  # the W&B run, while it works
        self._wb_lock = threading.Lock()  # W&B's log is not thread-safe; events come from threads
        self._wb_step = 0
        self._wb_errors = 0  # "error" events seen: the W&B run finishes with exit code 1
        if log_cfg is not None and log_cfg.wandb:
            try:
                self._start_wandb(log_cfg, run_config)
            except ImportError:  # wandb missing: close what is open, then say so
                self.close()
                raise

    def _start_wandb(self, cfg: LogConfig, run_config: dict[str, Any] | None) -> None:
        wandb = require_wandb()  # a missing package is an error, not a warning
        self._wandb = wandb
        try:
            run_id = wandb_run_id(self.run_dir)
            wb_dir = Path(cfg.wandb_dir).expanduser() if cfg.wandb_dir else self.run_dir
            wb_dir.mkdir(parents=True, exist_ok=True)
            run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name or self.run_dir.name,
                             id=run_id, resume="allow", dir=str(wb_dir), mode=cfg.wandb_mode,
                             config=run_config, allow_val_change=True,
                             settings=wandb.Settings(console="off"))  # train.log keeps the console
            run.define_metric("step")
            run.define_metric("*", step_metric="step")
            self._wb_step = max(int(getattr(run, "step", 0) or 0), _read_int(self.run_dir / WANDB_STEP))
        except Exception as e:
            self._wandb_failed("start", e)
            return
        self._wb = run

    def _wandb_log(self, data: dict[str, Any]) -> None:
        """One W&B history entry (``data`` holds ``step``, the x axis) at the next ``_step``."""
        with self._wb_lock:
            if self._wb is None:
                return
            try:
                self._wb.log(data, step=self._wb_step)
                self._wb_step += 1
                p = self.run_dir / WANDB_STEP  # tmp + rename: a kill never leaves half a number
                tmp = p.with_name(f".{WANDB_STEP}.{os.getpid()}.tmp")
                tmp.write_text(f"{self._wb_step}\n")
                os.replace(tmp, p)
            except Exception as e:
                self._wandb_failed("logging", e)

    def _wandb_failed(self, what: str, e: BaseException) -> None:
        """W&B is off for the rest of this process: one warning and one ``wandb_failed`` event."""
        self._wb = None
        log.warning("Weights & Biases %s failed (%s: %s); W&B is off for the rest of this process, "
                    "metrics.jsonl, events.jsonl and TensorBoard continue", what, type(e).__name__, e)
        row = {"time": time.time(), "event": "wandb_failed", "what": what, "error": repr(e),
               "version": self.version, "segment": self.segment}
        try:
            self._events.write(json.dumps(row, default=str) + "\n")
            self._events.flush()
        except (OSError, ValueError):  # closed already
            pass

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record ``metrics`` at ``step`` (policy version after the update): a row of
        ``metrics.jsonl``, TensorBoard scalars and (``log.wandb``) a W&B entry."""
        self.version = step
        row = {"step": step, "time": time.time(), "segment": self.segment,
               **{k: _clean(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        self.scalars(step, metrics)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Mirror the finite numbers of ``values`` to TensorBoard at ``step`` (flushed: a killed
        process keeps its curves; TensorBoard buffers up to 120 s) and every number of them (NaN
        and infinities included) to W&B as one entry at ``step``; the JSON record of them is the
        caller's (metrics.jsonl, a file, an event)."""
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wb is not None:
            nums = {k: v for k, v in values.items() if isinstance(v, (int, float)) and k != "step"}
            if nums:
                self._wandb_log({**nums, "step": step})

    def warmup(self, step: int, warmup_step: int, metrics: dict[str, float]) -> None:
        """Record critic warm-up step ``warmup_step`` (``critic.warmup_steps``; MISSION.md section
        3) in ``critic_warmup.jsonl`` at log ``step`` (``warmup_step - W``, <= 0; see
        ``Trainer.log_step``) and in TensorBoard as ``critic_warmup/*`` at the same step."""
        self.version = step
        row = {"step": step, "warmup_step": warmup_step, "time": time.time(), "segment": self.segment,
               **{k: _clean(v) for k, v in metrics.items()}}
        with (self.run_dir / CRITIC_WARMUP).open("a") as f:
            f.write(json.dumps(row) + "\n")
        # critic/value_loss -> critic_warmup/value_loss, reward/mean -> critic_warmup/reward_mean
        self.scalars(step, {f"critic_warmup/{k.removeprefix('critic/').replace('/', '_')}": v
                            for k, v in metrics.items()})

    def trained(self, step: int, batch, not_trained: list[dict] | None = None, phase: str | None = None) -> None:
        """Append to ``trained.jsonl`` which trajectory groups (and samples, versions) the update
        that produced policy version ``step`` consumed: an audit trail showing that no trajectory
        is trained twice, across resumes too. Each group also lists ``lengths`` ([prompt,
        response] tokens per trajectory), ``env_seconds`` (environment wait) and
        ``reward_seconds`` (reward scoring latency of the trajectory's group), the trace
        ``conveyor simulate`` calibrates from.

        Args:
            step: The policy version the update produced.
            batch: The trajectories it trained on.
            not_trained: Samples handed out since the previous row that will never be trained
                (:meth:`~conveyor.rollout.controller.RolloutController.take_not_trained`:
                dropped as stale, filtered, rejected, failed, prompt too long), listed under
                ``"not_trained"`` so every sample the data stream handed out is accounted for.
            phase: ``"critic_warmup"`` for a batch a critic warm-up step consumed (the critic
                trained on it, the policy did not); None for a policy update.
        """
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
            row = {"step": step, "groups": list(groups.values())}
            if phase is not None:
                row["phase"] = phase
            if not_trained:
                row["not_trained"] = not_trained
            f.write(json.dumps(row) + "\n")
        # a few responses per step, to read what the policy actually writes
        with (self.run_dir / "samples.jsonl").open("a") as f:
            for t in batch[: self.samples_per_step]:
                f.write(json.dumps({
                    "step": step, "sample": t.sample.id, "question": t.sample.question, "answer": t.sample.answer,
                    "response": t.text, "reward": t.reward, "correct": t.correct, "versions": sorted(set(t.versions)),
                }) + "\n")

    def event(self, kind: str, **fields) -> None:
        """Record a discrete event (checkpoint, resume, skipped step, eval, ...). Every event
        carries the policy ``version`` it happened at (default: the latest step logged), which is
        how a resume tells the events after its checkpoint apart (:func:`supersede_after`)."""
        fields.setdefault("version", self.version)
        fields.setdefault("segment", self.segment)
        row = {"time": time.time(), "event": kind, **fields}
        self._events.write(json.dumps(row, default=str) + "\n")
        self._events.flush()
        if kind == "error":
            self._wb_errors += 1
        if self._wb is not None:  # W&B: an entry "event/<kind>" = the other fields as JSON text
            version = fields["version"]
            rest = {k: v for k, v in fields.items() if k not in ("version", "segment")}
            self._wandb_log({f"event/{kind}": json.dumps(rest, default=str),
                             "step": version if isinstance(version, (int, float)) else self.version})

    def report(self, image: str | Path | None, summary: dict[str, Any] | None = None) -> None:
        """Send the run's final ``report.png`` and summary to the trackers that keep them (W&B:
        the image as ``report`` at the latest step, the summary's values other than lists into
        the run summary); JSONL and TensorBoard have them in the run directory already.

        Args:
            image: The report PNG (:func:`plot_report`), or None if it could not be drawn.
            summary: ``summary.json``'s content, or None.
        """
        if self._wb is None:
            return
        if image is not None and Path(image).is_file():
            try:
                entry = {"report": self._wandb.Image(str(image)), "step": self.version}
            except Exception as e:
                with self._wb_lock:
                    self._wandb_failed("image", e)
                return
            self._wandb_log(entry)
        if summary:
            with self._wb_lock:
                if self._wb is not None:
                    try:
                        self._wb.summary.update({k: v for k, v in summary.items()
                                                 if not isinstance(v, list)})
                    except Exception as e:
                        self._wandb_failed("summary", e)

    def close(self) -> None:
        """Flush and close the files and finish the W&B run, with exit code 1 if an ``error``
        event was logged (idempotent)."""
        self._f.close()
        self._events.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        with self._wb_lock:
            run, self._wb = self._wb, None
            if run is not None:
                try:
                    run.finish(exit_code=1 if self._wb_errors else 0)
                except Exception as e:
                    log.warning("Weights & Biases finish failed (%s: %s)", type(e).__name__, e)


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def superseded_path(path: str | Path) -> Path:
    """``metrics.jsonl`` -> ``metrics.superseded.jsonl`` (where :func:`supersede_after` keeps
    the rows it takes out of a log)."""
    p = Path(path)
    return p.with_name(p.name.removesuffix(".jsonl") + ".superseded.jsonl")


def _parse_lines(text: str) -> list[tuple[str, dict | None]]:
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by a kill during its write
            row = None
        out.append((line, row if isinstance(row, dict) else None))
    return out


def supersede_after(run_dir: str | Path, version: int) -> dict[str, int]:
    """Make every run-directory log agree with a resume from the checkpoint at ``version``.

    Called by the resuming process (holding the run directory's lock) before it writes anything:

    - ``metrics.jsonl``, ``trained.jsonl``, ``samples.jsonl``: rows with ``step > version`` and
      unparseable (half-written) lines are appended to the ``.superseded.jsonl`` sibling (each
      row gains ``"superseded": {"resume_from_version": version, "time": ...}``; a half-written
      line is kept as ``{"unparseable": <text>}``), then the log is rewritten atomically with the
      remaining rows. The sibling is written and ``fsync``-ed first, so a crash in between can
      duplicate a row there but never lose one.
    - ``events.jsonl``: nothing is removed (it is the crash history); events with a ``version``
      above ``version`` get the ``"superseded"`` field, half-written lines become
      ``{"event": "unparseable", "raw": <text>, "superseded": ...}``.

    Args:
        run_dir: The run directory.
        version: The checkpoint's policy version ``V``.

    Returns:
        ``{file name: rows superseded}`` for every log that exists.

    Raises:
        RunFileError: a rewrite failed (e.g. a full disk); the logs are then unchanged.
    """
    run_dir = Path(run_dir)
    mark = {"resume_from_version": version, "time": time.time()}
    counts: dict[str, int] = {}
    for name in STEP_LOGS:
        p = run_dir / name
        if not p.is_file():
            continue
        kept, moved = [], []
        for line, row in _parse_lines(p.read_text()):
            if row is None:
                moved.append({"unparseable": line, "superseded": mark})
            elif isinstance(row.get("step"), int) and row["step"] > version:
                moved.append({**row, "superseded": mark})
            else:
                kept.append(line)
        counts[name] = len(moved)
        if moved:
            with superseded_path(p).open("a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in moved))
                f.flush()
                os.fsync(f.fileno())
            atomic_write_text(p, "".join(line + "\n" for line in kept), what=f"{p}")
    if (run_dir / EVENTS).is_file():
        counts[EVENTS] = supersede_events(
            run_dir, lambda row: isinstance(row.get("version"), int) and row["version"] > version, mark)
    return counts


def supersede_events(run_dir: str | Path, match: Callable[[dict], bool], mark: dict) -> int:
    """Mark the events of ``events.jsonl`` that ``match`` as superseded (nothing is removed: it
    is the run's history); half-written lines become ``{"event": "unparseable", "raw": <text>,
    "superseded": mark}``. Events already superseded are left as they are.

    Args:
        run_dir: The run directory (a missing ``events.jsonl`` gives 0).
        match: ``event row -> bool``: the events to supersede.
        mark: The ``"superseded"`` field's value (why, when).

    Returns:
        How many rows were marked.

    Raises:
        RunFileError: the rewrite failed (e.g. a full disk); the file is then unchanged.
    """
    p = Path(run_dir) / EVENTS
    if not p.is_file():
        return 0
    rows, n = [], 0
    for line, row in _parse_lines(p.read_text()):
        if row is None:
            row = {"event": "unparseable", "raw": line, "superseded": mark}
            n += 1
        elif not row.get("superseded") and match(row):
            row = {**row, "superseded": mark}
            n += 1
        rows.append(row)
    if n:
        atomic_write_text(p, "".join(json.dumps(r) + "\n" for r in rows), what=f"{p}")
    return n


def read_jsonl(path: str | Path, *, by_step: bool = False,
               include_superseded: bool = False) -> list[dict]:
    """The rows of a run-directory JSONL log, tolerant of crash damage.

    Args:
        path: e.g. ``RUN/metrics.jsonl``; a missing file gives ``[]``.
        by_step: One row per ``step``, sorted by step, the later row winning (a run directory
            written before :func:`supersede_after` existed can hold a step twice).
        include_superseded: Also read the ``.superseded.jsonl`` sibling (rows in it keep their
            ``"superseded"`` field) and keep superseded events.

    Returns:
        The parsed rows; half-written lines and (unless asked for) superseded rows are left out.
    """
    p = Path(path)
    paths = [p, superseded_path(p)] if include_superseded else [p]
    rows = []
    for q in paths:
        if q.is_file():
            rows += [r for _, r in _parse_lines(q.read_text())
                     if r is not None and "unparseable" not in r]
    if not include_superseded:
        rows = [r for r in rows if not r.get("superseded")]
    if by_step:
        last: dict[int, dict] = {}
        for r in rows:
            if isinstance(r.get("step"), int):
                last[r["step"]] = r
        rows = [last[k] for k in sorted(last)]
    return rows


def read_metrics(path: str | Path) -> list[dict]:
    """Rows of a ``metrics.jsonl`` file, one per step (a later row for the same step wins)."""
    return read_jsonl(path, by_step=True)


def next_segment(run_dir: str | Path) -> int:
    """The segment number of a process starting on ``run_dir``: one more than any segment in
    its metrics rows, critic warm-up rows or events (superseded ones included), 0 for a fresh
    run directory."""
    run_dir = Path(run_dir)
    rows = [r for name in ("metrics.jsonl", CRITIC_WARMUP, EVENTS)
            for r in read_jsonl(run_dir / name, include_superseded=True)]
    return 1 + max((int(r.get("segment", 0)) for r in rows), default=-1)


def segment_summary(run_dir: str | Path, current: dict) -> dict:
    """Wall-clock and busy time of every process segment of a run.

    Earlier segments are read from the metrics and critic warm-up rows (kept and superseded)
    they wrote: a
    segment's ``wall_seconds`` is its last row's ``time/elapsed_s`` (its training loop up to its
    last logged step; a crashed process's time after that step is not known), its busy seconds
    the busy fractions times that. ``current`` (this process, measured exactly) replaces the
    rows of its segment.

    Args:
        run_dir: The run directory.
        current: ``{"segment", "wall_seconds", "trainer_busy_seconds", "engine_busy_seconds",
            "cpu_busy_seconds", "start_version", "end_version"}`` of this process
            (``cpu_busy_seconds``: ``busy/cpu`` x wall seconds, None where not measured).

    Returns:
        ``{"wall_seconds": total s, "trainer_busy": fraction, "engine_busy": fraction,
        "cpu_busy": fraction of the cores (None if a segment did not measure it: rows from before
        ``busy/cpu``), "segments": [per-segment dicts, oldest first]}``; per segment: ``segment``,
        ``wall_seconds``, ``trainer_busy_seconds``, ``engine_busy_seconds``, ``cpu_busy_seconds``, ``steps`` (rows
        kept), ``superseded_steps`` (rows a resume superseded), ``first_step``, ``last_step``,
        ``start_version`` / ``end_version`` (the policy version the process started from and the
        last one it reached; for an earlier process, read from its rows: the version before its
        first logged step and its last logged step, superseded rows included, 0 during a critic
        warm-up).
    """
    rows = [r for name in ("metrics.jsonl", CRITIC_WARMUP)  # critic warm-up steps count too
            for r in read_jsonl(Path(run_dir) / name, include_superseded=True)]
    segs: dict[int, dict] = {}
    for r in rows:
        k = int(r.get("segment", 0))
        s = segs.setdefault(k, {"segment": k, "wall_seconds": 0.0, "trainer_busy_seconds": 0.0,
                                "engine_busy_seconds": 0.0, "cpu_busy_seconds": None, "steps": 0, "superseded_steps": 0,
                                "first_step": r["step"], "last_step": r["step"]})
        s["superseded_steps" if r.get("superseded") else "steps"] += 1
        s["first_step"] = min(s["first_step"], r["step"])
        s["last_step"] = max(s["last_step"], r["step"])
        el = float(r.get("time/elapsed_s") or 0.0)
        if el >= s["wall_seconds"]:
            s["wall_seconds"] = el
            s["trainer_busy_seconds"] = float(r.get("busy/trainer") or 0.0) * el
            s["engine_busy_seconds"] = float(r.get("busy/engine") or 0.0) * el
            s["cpu_busy_seconds"] = None if r.get("busy/cpu") is None else float(r["busy/cpu"]) * el
    for s in segs.values():  # steps are versions (v + 1 after an update from v; <= 0 in a warm-up)
        s["start_version"] = max(0, s["first_step"] - 1)
        s["end_version"] = max(0, s["last_step"])
    cur = segs.setdefault(current["segment"],
                          {"segment": current["segment"], "steps": 0, "superseded_steps": 0})
    cur.update(current)
    out = [segs[k] for k in sorted(segs)]
    wall = sum(s["wall_seconds"] for s in out)
    cpu = [s.get("cpu_busy_seconds") for s in out]
    return {
        "wall_seconds": wall,
        "trainer_busy": sum(s["trainer_busy_seconds"] for s in out) / max(wall, 1e-9),
        "engine_busy": sum(s["engine_busy_seconds"] for s in out) / max(wall, 1e-9),
        "cpu_busy": None if None in cpu else sum(cpu) / max(wall, 1e-9),
        "segments": out,
    }


class ConsoleFormatter(logging.Formatter):
    """Console log lines: ``LEVEL logger: first line of the message``. Tracebacks and the rest of
    multi-line messages stay in ``train.log`` (the run's file handler formats the same record in
    full); the console line says so."""

    def format(self, record: logging.LogRecord) -> str:
        """One line per record (see the class docstring)."""
        lines = record.getMessage().splitlines() or [""]
        more = len(lines) > 1 or record.exc_info is not None or record.stack_info is not None
        tail = " (details in train.log)" if more else ""
        return f"{record.levelname} {record.name}: {lines[0]}{tail}"


class ConsoleFilter(logging.Filter):
    """Keeps repeated failures off the console: individual reward failures
    (``conveyor.rewards`` warnings) and records logged with ``extra={"console": False}``. The
    training loop prints a one-line count instead (:class:`FailureCounter`); each failure, with
    its traceback, is in ``train.log``."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False for reward-service records below ERROR and for ``console=False`` records."""
        if getattr(record, "console", True) is False:
            return False
        return not (record.name.startswith("conveyor.rewards") and record.levelno < logging.ERROR)


def console_log_handler(stream=None) -> logging.Handler:
    """A ``StreamHandler`` (stderr by default) with :class:`ConsoleFilter` and
    :class:`ConsoleFormatter`, for the ``conveyor`` command line."""
    h = logging.StreamHandler(stream)
    h.addFilter(ConsoleFilter())
    h.setFormatter(ConsoleFormatter())
    return h


class FailureCounter:
    """Turns cumulative failure counters into at most one console line every ``interval_s``.

    Args:
        interval_s: Seconds between two lines at least (s).
        clock: Time source (s), for tests.
        baseline: Counts already reported (a resumed run's, restored from its checkpoint: the
            new process reports only what grows from there; fresh-user finding: it printed the
            process before's failures as new).
    """

    def __init__(self, interval_s: float = 10.0, clock=time.monotonic, baseline: dict[str, int] | None = None):
        self.interval_s = interval_s
        self._clock = clock
        self._reported: dict[str, int] = dict(baseline or {})
        self._last = -math.inf

    def update(self, counts: dict[str, int]) -> str | None:
        """``counts``: cumulative ``{what: n}`` (e.g. ``{"reward failures": 12}``). Returns a line
        naming what grew since the last line, or None (nothing new, or too soon)."""
        new = {k: v - self._reported.get(k, 0) for k, v in counts.items()
               if v > self._reported.get(k, 0)}
        now = self._clock()
        if not new or now - self._last < self.interval_s:
            return None
        self._last = now
        self._reported.update({k: counts[k] for k in new})
        parts = [f"{n} {k}" for k, n in new.items()]
        totals = ", ".join(f"{counts[k]} {k} in total" for k in new)
        return "+" + ", +".join(parts) + f" ({totals}; details in train.log)"


def _legend(ax, *extra_axes, **kw) -> None:
    """A legend for every line of ``ax`` (and of twin axes ``extra_axes``), below the panel, off
    the data; none when there are no curves yet (e.g. no step finished)."""
    handles, labels = ax.get_legend_handles_labels()
    for other in extra_axes:
        h, la = other.get_legend_handles_labels()
        handles, labels = handles + h, labels + la
    if handles:
        kw.setdefault("loc", "upper center")
        kw.setdefault("bbox_to_anchor", (0.5, -0.16))
        ax.legend(handles, labels, ncol=kw.pop("ncol", 2), fontsize=8, frameon=False, **kw)


def _integer_versions(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _calibration_points(rows: list[dict]) -> tuple[list[float], list[float], list[float]]:
    """The ``value/calib{b}_*`` bins of ``rows`` (each step's 5 equal-count bins of first-token
    values, :meth:`conveyor.trainer.trainer.Trainer._value_metrics`) pooled by bin index,
    weighted by count: ``(mean value, mean return, responses)`` per bin."""
    xs, ys, ns = [], [], []
    for b in range(5):
        pts = [(r[f"value/calib{b}_value"], r[f"value/calib{b}_return"], r[f"value/calib{b}_count"]) for r in rows
               if r.get(f"value/calib{b}_count")]
        n = sum(c for _, _, c in pts)
        if n:
            xs.append(sum(v * c for v, _, c in pts) / n)
            ys.append(sum(g * c for _, g, c in pts) / n)
            ns.append(n)
    return xs, ys, ns


def _value_panels(ax_cal, ax_curve, rows: list[dict], series) -> None:
    """The critic's predictions against outcomes (issue 45): a calibration panel (first-token
    value, binned, against the observed return; the first half of the steps and the second) and
    the values' held-out quality per step (each batch scored before the critic trained on it)."""
    half = len(rows) // 2
    drawn = False
    for part, label, color in ((rows[:half], "first half of the steps", "tab:gray"),
                               (rows[half:], "second half of the steps", "tab:blue")):
        xs, ys, ns = _calibration_points(part)
        if xs:
            ax_cal.plot(xs, ys, marker="o", color=color, label=f"{label} ({int(sum(ns))} responses)")
            drawn = True
    if drawn:
        lo = min(0.0, *ax_cal.get_xlim(), *ax_cal.get_ylim())
        hi = max(1.0, *ax_cal.get_xlim(), *ax_cal.get_ylim())
        ax_cal.plot([lo, hi], [lo, hi], color="black", lw=0.8, ls=":", label="calibrated (value = return)")
        ax_cal.set_title("calibration: first-token value vs return (5 bins a step)")
        ax_cal.set_xlabel("value at the first response token")
        ax_cal.set_ylabel("mean return")
        _legend(ax_cal)
    else:
        ax_cal.axis("off")
    drawn = False
    for key, label in (("value/first_value_corr", "corr(first-token value, return)"),
                       ("value/first_explained_variance", "explained variance, first token"),
                       ("value/prompt_corr", "corr(first-token value, prompt success rate)")):
        xs, ys = series(key, rows)
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y == y]  # (NaN: undefined that step)
        if pts:
            ax_curve.plot([x for x, _ in pts], smooth_values([y for _, y in pts]), label=f"{label}, running mean of 5")
            drawn = True
    if drawn:
        ax_curve.axhline(0.0, color="gray", lw=0.8)
        ax_curve.set_title("values on each batch before the critic trained on it")
        ax_curve.set_xlabel("step")
        _legend(ax_curve)
    else:
        ax_curve.axis("off")


def smooth_values(ys: list[float], w: int = 5) -> list[float]:
    """Running mean of the last ``w`` values (fewer at the start)."""
    out, acc = [], []
    for y in ys:
        acc.append(y)
        acc = acc[-w:]
        out.append(sum(acc) / len(acc))
    return out


def plot_report(run_dir: str | Path, out: str | Path | None = None, title: str = "") -> Path:
    """Draw reward / accuracy / staleness / throughput curves of a run into ``report.png``
    (written atomically); with a critic also its value loss, explained variance, the correlation
    of response length with summed advantage and the gradient norms per block kind (warm-up
    included), a calibration panel (first-token value against the return) and the values' quality
    on each batch before the critic trained on it; the run monitor's alerts as marked versions and an
    adaptive eta as a step line.

    Returns:
        The PNG path.

    Raises:
        FileNotFoundError: ``run_dir`` is not a directory or has no ``metrics.jsonl``.
        RunFileError: the PNG cannot be written (e.g. a full disk).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    if not (run_dir / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not a conveyor run directory, or no "
                                "step finished yet)")
    rows = read_metrics(run_dir / "metrics.jsonl")
    warm = read_jsonl(run_dir / CRITIC_WARMUP, by_step=True)
    critic = bool(warm) or any("critic/value_loss" in r for r in rows)
    out = Path(out) if out else run_dir / "report.png"
    fig, axes = plt.subplots(4 if critic else 2, 2, figsize=(11, 16.5 if critic else 8.5))

    def series(key, of=rows):
        xs = [r["step"] for r in of if r.get(key) is not None]
        ys = [r[key] for r in of if r.get(key) is not None]
        return xs, ys

    smooth = smooth_values

    ax = axes[0][0]
    for key, label, color in (("reward/mean", "reward", "tab:blue"), ("rollout/accuracy", "accuracy (sampled)", "tab:red")):
        xs, ys = series(key)
        if ys:
            ax.plot(xs, ys, alpha=0.3, color=color, label=f"{label}, per batch")
            ax.plot(xs, smooth(ys), color=color, label=f"{label}, running mean of 5")
    ax.set_title("reward and accuracy of training batches")
    ax.set_xlabel("policy version")
    # the run monitor's alerts (issue 13): a dashed line at the version each fired, labelled
    events = [e for e in read_jsonl(run_dir / "events.jsonl") if not e.get("superseded")]
    for e in (e for e in events if e.get("event") == "alert"):
        v = e.get("version", e.get("step"))
        if v is not None:
            ax.axvline(v, color="tab:red", lw=0.8, ls="--", alpha=0.6)
            ax.text(v, 1.0, f" {e.get('rule', 'alert')}", transform=ax.get_xaxis_transform(), rotation=90,
                    va="top", ha="left", fontsize=7, color="tab:red")
    _legend(ax)
    ax = axes[0][1]
    etas = [(e.get("version", 0), e["new_eta"]) for e in events if e.get("event") == "eta_change" and "new_eta" in e]
    if etas:  # async.adaptive / monitor actions: eta over the run, as steps
        xs_e = [v for v, _ in etas] + ([rows[-1]["step"]] if rows else [])
        ax.step(xs_e, [n for _, n in etas] + ([etas[-1][1]] if rows else []), where="post", color="gray", ls=":",
                label="eta")
    for key in ("staleness/mean", "staleness/max"):
        xs, ys = series(key)
        if ys:
            ax.plot(xs, ys, label=key)
    xs, ys = series("staleness/multi_version_share")
    if ys:
        ax.plot(xs, ys, label="multi-version share")
    xs, ys = series("rollout/dropped_stale_share")
    if ys:  # cumulative share of accepted trajectories the buffer dropped as stale (wasted generation)
        ax.plot(xs, ys, color="red", ls="--", label=f"dropped-stale share ({ys[-1]:.1%})")
    ax.set_title("staleness (versions, from oldest token)")
    ax.set_xlabel("policy version")
    _legend(ax)
    ax = axes[1][0]
    for key in ("throughput/generated_tokens_per_s", "train/tokens_per_s"):
        xs, ys = series(key)
        if ys:
            ax.plot(xs, ys, label=key)
    ax.set_title("throughput (tokens/s)")
    ax.set_xlabel("policy version")
    _legend(ax)
    ax = axes[1][1]
    for key in ("busy/trainer", "busy/engine"):
        xs, ys = series(key)
        if ys:
            ax.plot(xs, ys, label=key)
    xs, ys = series("response/length_mean")
    twins = []
    if ys:
        ax2 = ax.twinx()
        ax2.plot(xs, ys, color="gray", alpha=0.6, label="response length (tokens, right axis)")
        ax2.set_ylabel("tokens")
        twins.append(ax2)
    ax.set_ylim(0, 1.05)
    ax.set_title("busy fractions (cumulative) / response length")
    ax.set_xlabel("policy version")
    _legend(ax, *twins)
    if critic:  # the value model (loss.advantage=gae): warm-up steps sit at steps <= 0
        both = warm + rows
        ax = axes[2][0]
        for key, label in (("critic/value_loss", "value loss (before the K updates)"),
                           ("critic/explained_variance", "explained variance")):
            xs, ys = series(key, both)
            if ys:
                ax.plot(xs, ys, label=label)
        xs, ys = series("advantage/length_corr")  # > 0: longer responses pushed up more (trainer/credit.py)
        if ys:
            ax.plot(xs, smooth(ys), ls="--", label="corr(length, summed advantage)")
        ax.axvline(0.5, color="gray", lw=0.8, ls=":")
        ax.set_title("critic (steps <= 0: warm-up)")
        ax.set_xlabel("step")
        _legend(ax)
        ax = axes[2][1]
        kinds = [k for k in ("attention", "mlp", "other") if series(f"critic/grad_norm_{k}", both)[1]]
        if kinds == ["other"] or not kinds:  # a head critic has no blocks: the panel would mean nothing
            ax.axis("off")
        else:
            for kind in kinds:
                xs, ys = series(f"critic/grad_norm_{kind}", both)
                ax.plot(xs, ys, label=kind)
            ax.set_title("critic gradient norm per block kind (before clipping)")
            ax.set_xlabel("step")
            _legend(ax)
        _value_panels(axes[3][0], axes[3][1], both, series)
    for row in axes:
        for a in row:
            if not (critic and a is axes[3][0]):  # (the calibration panel's axes are values)
                _integer_versions(a)
    fig.suptitle(title or str(run_dir))
    fig.tight_layout()
    try:
        atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=100, format="png"), what=str(out))
    finally:
        plt.close(fig)
    return out
