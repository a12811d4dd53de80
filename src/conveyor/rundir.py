"""The run-directory protocol of a training process: what happens around the training loop.

:func:`conveyor.train.run_training` drives these steps (issue 10, sections 2 and 5):

- start-up checks before the run directory is touched (:func:`preflight_samples`,
  :func:`check_resume_compatible`), so bad input leaves nothing behind, and before the model is
  loaded where they need no model (:func:`check_new_run_dir`: a ``run.dir`` that already holds a
  run or is in use fails in a second, not after the load);
- one process per run directory (:class:`RunContext` holds the
  :class:`~conveyor.runtime_files.RunLock` and everything else to release);
- a resume that does nothing for a finished run (:func:`finished_result`), and otherwise first
  repairs what a crash left (:func:`prepare_resume`: stale checkpoint writes, log rows after the
  checkpoint);
- the checkpoint when the loop ends (:func:`final_checkpoint`) and the failure counts on the
  console (:func:`report_failures`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from conveyor.checkpoint import (
    checkpoint_version,
    clean_stale_checkpoint_dirs,
    latest_checkpoint,
    save_checkpoint,
)
from conveyor.config import TrainConfig, load_config
from conveyor.eval import export_policy_version
from conveyor.preflight import (
    check_prompt_lengths,
    config_warnings,
    require_answers,
    require_samples,
)
from conveyor.prompts import resolve_instruction
from conveyor.runlog import (
    EVENTS,
    FailureCounter,
    MetricsLogger,
    read_jsonl,
    supersede_after,
    supersede_events,
)
from conveyor.runtime_files import LOCK_FILE, RunLock
from conveyor.shutdown import Interrupts

if TYPE_CHECKING:
    from conveyor.trainer.trainer import Trainer

log = logging.getLogger("conveyor.train")  # the runtime's logger: same name in train.log


@dataclass
class TrainResult:
    """What a finished (or interrupted) run reports.

    Attributes:
        run_dir: The run directory. steps: policy version reached.
        heldout_before / heldout_after: greedy held-out pass@1 (None when not evaluated).
        wall_seconds: Training-loop wall-clock (s). interrupted: stopped early, by Ctrl-C /
            SIGTERM or a monitor rule's ``stop`` action.
        trainer_busy / engine_busy: Busy fractions of the training-loop wall-clock.
        cpu_busy: The share of the machine's cores the process kept busy in the loop (0..1;
            None where not measured: a run from before the metric).
        stop_reason: ``"signal"``, ``"monitor rule R"``, or None (not stopped early).
        signal: The number of the signal that stopped it (``signal.SIGINT`` / ``SIGTERM``;
            ``conveyor train`` exits with ``128 + signal``, the shell's convention), else None.
    """

    run_dir: Path
    steps: int
    heldout_before: float | None
    heldout_after: float | None
    wall_seconds: float
    interrupted: bool
    trainer_busy: float
    engine_busy: float
    stop_reason: str | None = None
    signal: int | None = None
    cpu_busy: float | None = None


# keys a resumed run must keep (the checkpoint was made with them)
FIXED_ON_RESUME = (
    ("model", "name"),
    ("model", "init"),  # the initial policy: the KL reference, a restart's reused eval_before.json
    ("run", "dir"),
    ("rollout", "group_size"),
    ("trainer", "batch_size"),
    ("loss", "advantage"),  # whether the checkpoint holds a critic
    ("critic", "backbone"),
    ("critic", "freeze_attention"),  # which parameters the critic's optimizer holds
    ("critic", "warmup_steps"),  # the warm-up's log steps (Trainer.log_step) depend on it
    ("critic", "num_critics"),  # how many critics the checkpoint holds
    ("critic", "lora_rank"),  # whether and which adapters the critic's checkpoint holds
    ("critic", "lora_alpha"),
    ("lora", "enabled"),  # whether the checkpoint holds a LoRA adapter or the whole policy
    ("lora", "rank"),  # the adapter's shapes
    ("lora", "alpha"),  # its scale: the same adapter is another policy under another alpha
    ("lora", "target_modules"),
)
# keys that decide which problems the held-out evaluation asks and how: fixed once
# eval_before.json exists, or "before" and "after" would measure different things
FIXED_FOR_HELDOUT = (
    ("data", "heldout"),
    ("data", "heldout_limit"),
    ("data", "split_seed"),
    ("data", "instruction"),
    ("run", "eval_max_new_tokens"),
    ("run", "eval_samples"),
    ("run", "eval_temperature"),
    ("rollout", "tool"),
    ("rollout", "max_tool_calls"),
    ("env", "name"),  # an environment's episodes are what the held-out evaluation runs
    ("env", "max_turns"),
    ("env", "max_episode_tokens"),
    ("env", "tool_format"),
    ("env", "options"),
)


def check_resume_compatible(run_dir: Path, cfg: TrainConfig) -> None:
    """Refuse overrides a resume cannot honour.

    Raises:
        ValueError: a key of ``FIXED_ON_RESUME`` changed, or a key of ``FIXED_FOR_HELDOUT``
            changed while ``eval_before.json`` exists (the message names the key, both values
            and why).
    """
    saved = load_config(run_dir / "config.json")
    # a LoRA checkpoint holds the adapter only: the base weights are model.name's (seeded for tiny
    # and for model.init=random)
    fixed = FIXED_ON_RESUME + ((("model", "seed"),) if saved.lora.enabled else ())
    for section, key in fixed:
        old, new = getattr(getattr(saved, section), key), getattr(getattr(cfg, section), key)
        if old != new:
            raise ValueError(
                f"--resume {run_dir}: {section}.{key} cannot change on resume "
                f"(checkpoint has {old!r}, got {new!r})"
            )
    if not (run_dir / "eval_before.json").is_file():
        return
    for section, key in FIXED_FOR_HELDOUT:
        old, new = getattr(getattr(saved, section), key), getattr(getattr(cfg, section), key)
        if old != new:
            raise ValueError(
                f"--resume {run_dir}: {section}.{key} cannot change on resume (the run has "
                f"{old!r}, got {new!r}): eval_before.json was measured with {old!r}, so the "
                "held-out accuracy after training would not be comparable; keep it, or start a "
                "new run"
            )


# what a run writes into its directory before its logs (a process that stopped there left only these)
RUN_START_FILES = frozenset({LOCK_FILE, "config.json"})


def check_new_run_dir(run_dir: Path) -> None:
    """Refuse a directory that a new run cannot use, creating nothing: one that already holds a
    run (``metrics.jsonl`` or a checkpoint: resume it, or pick another ``run.dir``), that a
    running process holds (its ``run.lock``), or that is not a conveyor run directory and not
    empty (other files: the run's files would be mixed into them). An empty directory, or one
    holding only :data:`RUN_START_FILES`, is used. Called before the model is loaded, and again
    when the directory is made (a process may have started on it meanwhile).

    Raises:
        FileExistsError: the directory holds a run (the message gives the resume command), or
            other files (the message names a few).
        conveyor.runtime_files.RunDirInUseError: a running process holds its lock (the message
            names its PID).
    """
    if (run_dir / "metrics.jsonl").exists() or latest_checkpoint(run_dir) is not None:
        raise FileExistsError(
            f"run directory {run_dir} already holds a run: use `conveyor train --resume {run_dir}` "
            "or another run.dir"
        )
    if (run_dir / LOCK_FILE).is_file():  # probe the lock (only an existing lock file: nothing is created)
        RunLock(run_dir).acquire().release()
    other = sorted(p.name for p in run_dir.iterdir() if p.name not in RUN_START_FILES) if run_dir.is_dir() else []
    if other:
        shown = ", ".join(other[:5]) + (f" and {len(other) - 5} more" if len(other) > 5 else "")
        raise FileExistsError(
            f"run.dir={run_dir} is not empty and is not a conveyor run directory (it holds {shown}; no "
            "metrics.jsonl or checkpoints/): a run would write its files among them; choose a new or empty "
            "directory"
        )


# ---------------------------------------------------------------------- run-directory protocol
class RunContext:
    """What one run holds and must give back however it ends: the run directory's lock, the
    engine / controller threads, reward worker processes, open logs (released in reverse order
    by :meth:`close`); the signal policy (:class:`~conveyor.shutdown.Interrupts`); and what a
    :class:`~conveyor.shutdown.StopNow` report needs."""

    def __init__(self, console):
        self.console = console
        self.interrupts = Interrupts(say=console.print)
        self.stack = contextlib.ExitStack()
        self.run_dir: Path | None = None
        self.logger: MetricsLogger | None = None
        self.trainer: Trainer | None = None
        self.start_version = 0
        self.phase = "start-up"

    def lock(self, run_dir: Path) -> None:
        """Take ``run_dir``'s lock for the rest of the run (RunDirInUseError if held)."""
        lock = RunLock(run_dir).acquire()
        self.stack.callback(lock.release)
        self.run_dir = run_dir

    def close(self) -> None:
        """Release everything (reverse order of acquisition), then restore the signal handlers."""
        try:
            self.stack.close()
        finally:
            self.interrupts.restore()

    def stop_report(self) -> str:
        """What a second Ctrl-C left behind, in one sentence: the newest checkpoint, the steps
        not saved, how to continue."""
        if self.run_dir is None:
            return "stopped now, before the run directory was created: nothing was written"
        ckpt = latest_checkpoint(self.run_dir)
        version = self.trainer.version if self.trainer is not None else None
        if ckpt is None:
            return (
                f"stopped now (during {self.phase}): no checkpoint was written in {self.run_dir}; "
                f"start it again from version 0 in the same directory with: conveyor train --resume {self.run_dir}"
            )
        lost = ""
        if version is not None and checkpoint_version(ckpt) < version:
            lost = (
                f"; versions {checkpoint_version(ckpt) + 1}-{version} were trained but not saved "
                "and will be trained again"
            )
        return (
            f"stopped now (during {self.phase}): the newest checkpoint is {ckpt.name}{lost}; "
            f"continue with: conveyor train --resume {self.run_dir}"
        )


def finished_result(run_dir: Path, cfg: TrainConfig, console) -> TrainResult | None:
    """A :class:`TrainResult` read from ``summary.json`` when the run already finished (not
    interrupted, at ``>= trainer.total_steps``): a resume then has nothing to do and must not
    re-run the evaluation or the export. None otherwise."""
    p = run_dir / "summary.json"
    try:
        s = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if (
        s.get("interrupted")
        or not isinstance(s.get("steps"), int)
        or s["steps"] < cfg.trainer.total_steps
    ):
        return None
    again = unsaved_final_versions(run_dir, latest_checkpoint(run_dir))
    # fresh-user trial 5: an override below the run's steps read as if it were the run's setting
    why = (f"trainer.total_steps={cfg.trainer.total_steps}" if cfg.trainer.total_steps == s["steps"]
           else f"trainer.total_steps={cfg.trainer.total_steps} is not beyond it")
    console.print(
        f"{run_dir} finished at version {s['steps']} ({why}): nothing to do, nothing changed. To train longer: "
        f"conveyor train --resume {run_dir} trainer.total_steps=N (N > {s['steps']})"
        + (f"; note: {again}" if again else ""), soft_wrap=True
    )
    return TrainResult(
        run_dir,
        s["steps"],
        s.get("heldout_before"),
        s.get("heldout_after"),
        float(s.get("wall_seconds", 0.0)),
        False,
        float(s.get("trainer_busy", 0.0)),
        float(s.get("engine_busy", 0.0)),
        cpu_busy=s.get("cpu_busy"),
    )


def prepare_resume(run_dir: Path, version: int) -> dict:
    """Before a resumed process writes anything: remove what interrupted checkpoint writes left,
    supersede the log rows written after the checkpoint (:func:`conveyor.runlog.supersede_after`),
    move an ``eval_after.json`` of an earlier process aside (to ``eval_after.json.superseded[.N]``,
    which no ``eval_*.json`` glob matches; its ``eval`` event marked superseded: it measured a
    policy the resumed run trains past, and ``conveyor inspect`` must not take it for this
    run's) and drop the stale ``summary.json``
    (rewritten at the end). Returns what was done (for the ``resume`` event)."""
    cleaned = clean_stale_checkpoint_dirs(run_dir)
    superseded = {k: v for k, v in supersede_after(run_dir, version).items() if v}
    moved = []
    after = run_dir / "eval_after.json"
    if after.is_file():
        dest = _superseded_name(after)
        supersede_events(run_dir, lambda row: row.get("event") == "eval" and row.get("label") == "after",
                         {"resume_from_version": version, "moved_to": dest.name, "time": time.time()})
        after.rename(dest)
        moved.append(f"eval_after.json -> {dest.name}")
    export = run_dir / "export"
    exported = export_policy_version(export)
    if exported is not None and exported > version:  # a policy the resume trains again: never overwritten
        dest = _superseded_name(export)
        export.rename(dest)
        moved.append(f"export (policy version {exported}) -> {dest.name}")
    (run_dir / "summary.json").unlink(missing_ok=True)
    return {"cleaned": cleaned, "superseded_rows": superseded, "superseded_files": moved}


def _superseded_name(path: Path) -> Path:
    """Where :func:`prepare_resume` moves ``path`` aside: ``<name>.superseded``, else the first
    free ``<name>.superseded.N`` (N >= 2)."""
    dest, n = path.with_name(f"{path.name}.superseded"), 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}.superseded.{n}")
    return dest


def unsaved_final_versions(run_dir: Path, ckpt: Path | None) -> str | None:
    """For a finished run whose newest checkpoint ``ckpt`` is older than its last version
    (``run.final_checkpoint=none`` with a periodic checkpoint): what a resume from it trains
    again, as a sentence; None otherwise (fresh-user trial 4, finding 3: the resume re-trained
    the last versions without a word and its export replaced the finished one)."""
    if ckpt is None:
        return None
    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(s, dict) or s.get("interrupted") or not isinstance(s.get("steps"), int):
        return None
    have = checkpoint_version(ckpt)
    if have >= s["steps"]:
        return None
    what = f"version {s['steps']} is" if have + 1 == s["steps"] else f"versions {have + 1}-{s['steps']} are"
    exported = export_policy_version(run_dir / "export")
    kept = f"its export (policy version {exported}) is moved to export.superseded" if exported is not None else ""
    return (f"the run finished at version {s['steps']} but kept no checkpoint of it (run.final_checkpoint=none): "
            f"a resume continues from {ckpt.name}, so {what} trained again, on new rollouts"
            + (f"; {kept}" if kept else ""))


def restart_eval_before(run_dir: Path, cfg: TrainConfig) -> str:
    """What a run started again in place (``--resume`` of a run with no checkpoint yet) does with
    the ``eval_before.json`` of its first process. It starts from the same initial policy, so the
    evaluation is kept and reused when it measured that policy: the file reads back and
    ``model.seed`` is the run's (``model.name`` and, while the file exists, the held-out settings
    cannot change: :func:`check_resume_compatible`). Otherwise the file is removed (the evaluation
    runs again) and its ``eval`` events in ``events.jsonl`` are marked superseded, so the log holds
    one valid "before" evaluation either way.

    Returns:
        ``"reused"``, ``"removed"`` (with the reason after a colon) or ``"none"`` (no file).

    Raises:
        RunFileError: ``events.jsonl`` could not be rewritten.
    """
    p = run_dir / "eval_before.json"
    if not p.is_file():
        return "none"
    saved_seed = load_config(run_dir / "config.json").model.seed
    try:
        ok = isinstance(json.loads(p.read_text()).get("pass_at_1"), int | float)
    except (OSError, ValueError, AttributeError):
        ok = False
    if ok and saved_seed == cfg.model.seed:
        return "reused"
    why = "unreadable" if not ok else f"model.seed changed ({saved_seed} -> {cfg.model.seed}): another initial policy"
    supersede_events(run_dir, lambda row: row.get("event") == "eval" and row.get("label") == "before",
                     {"restart": True, "reason": f"eval_before.json {why}; measured again", "time": time.time()})
    p.unlink()
    return f"removed: {why}"


def recorded_bf16(run_dir: Path, device_type: str | None = None) -> bool | None:
    """The choice ``trainer.bf16=auto`` made for this run: the ``bf16`` of the first ``precision``
    event in ``events.jsonl`` that auto decided (``requested == "auto"``; events written before
    that field: a note starting ``trainer.bf16=auto``). A resume keeps it rather than measuring
    again (:func:`conveyor.hardware.resolve_bf16`). With ``device_type`` (``cpu`` / ``cuda``) only
    a choice made on that kind of device counts (a run moved between a GPU and a CPU chooses again,
    once per kind; events without ``device_type`` were CPU runs). None: no such event."""
    for row in read_jsonl(run_dir / EVENTS):
        if row.get("event") != "precision" or not isinstance(row.get("bf16"), bool):
            continue
        if device_type is not None and row.get("device_type", "cpu") != device_type:
            continue
        if row.get("requested", "auto" if str(row.get("note", "")).startswith("trainer.bf16=auto") else None) == "auto":
            return row["bf16"]
    return None


def preflight_samples(cfg: TrainConfig, train_samples, heldout, tokenizer, policy):
    """Prompt-length checks of the training and held-out sets against the model's context
    (:func:`conveyor.preflight.check_prompt_lengths`), the environment's start-up check
    (:func:`conveyor.envs.registry.check_env`: import, options, the sandbox) and the config
    warnings. With an environment the response budget checked is ``env.max_episode_tokens``.

    Returns:
        ``(train samples kept, held-out samples kept, prompts dropped, warnings)``.

    Raises:
        DatasetError: no training sample left (the message names the data set and why).
        ConfigError: an environment that cannot run here (the message names the ``env.*`` key).
    """
    notes: list[str] = []
    if cfg.env.name != "none":
        from conveyor.config import ConfigError
        from conveyor.envs.registry import check_env

        try:
            notes = check_env(cfg.env, tokenizer)
        except (ValueError, TypeError) as e:
            raise ConfigError(str(e)) from e
    budget, budget_key = ((cfg.env.max_episode_tokens, "env.max_episode_tokens") if cfg.env.name != "none"
                          else (cfg.rollout.max_new_tokens, "rollout.max_new_tokens"))
    context = getattr(policy.config, "max_position_embeddings", None)
    train_samples, rep = check_prompt_lengths(
        train_samples,
        tokenizer,
        resolve_instruction(cfg.data.instruction, cfg.data.train),
        context,
        budget,
    )
    require_samples(train_samples, cfg.data.train, rep)
    require_answers(train_samples, cfg.data.train, cfg.reward.fn)
    warnings = rep.messages(
        f"data.train={cfg.data.train}", budget_key
    ) + config_warnings(cfg)
    for note in notes:
        log.info(note)
    if cfg.data.heldout and not heldout:
        warnings.append(f"data.heldout={cfg.data.heldout} has no samples: no held-out evaluation")
    if heldout:
        heldout, hrep = check_prompt_lengths(
            heldout,
            tokenizer,
            resolve_instruction(cfg.data.instruction, cfg.data.heldout),
            context,
            cfg.run.eval_max_new_tokens,
        )
        warnings += hrep.messages(f"data.heldout={cfg.data.heldout}", "run.eval_max_new_tokens")
    return train_samples, heldout, len(rep.too_long), warnings


def announce(warnings: list[str], logger: MetricsLogger, console) -> None:
    """Each warning on the console, in train.log and as a ``warning`` event."""
    for w in warnings:
        console.print(f"[bold yellow]warning:[/] {escape(w)}", emoji=False)
        log.warning(w, extra={"console": False})
        logger.event("warning", message=w)


def final_checkpoint(
    run_dir: Path,
    trainer: Trainer,
    controller,
    logger: MetricsLogger,
    cfg: TrainConfig,
    error: BaseException | None,
    interrupted: bool,
) -> None:
    """The checkpoint when the training loop ends: after an error or a Ctrl-C (nothing computed
    is lost), and at the normal end unless ``run.final_checkpoint=none``. Never after a step cut
    short by a second Ctrl-C (its state may be half-updated).

    Raises:
        RunFileError: the write failed at the normal end (e.g. a full disk): a clear error rather
            than a run that reports success without its checkpoint. After an error it is logged
            and the original error wins.
    """
    if isinstance(error, KeyboardInterrupt | SystemExit) or (
        trainer.version == 0 and trainer.critic_warmup_done == 0 and not interrupted
    ):
        return
    finished = error is None and not interrupted and trainer.version >= cfg.trainer.total_steps
    if finished and cfg.run.final_checkpoint == "none":
        logger.event("checkpoint_skipped", reason="run.final_checkpoint=none")
        return
    try:
        p = save_checkpoint(run_dir, trainer, controller, keep=cfg.run.keep_checkpoints)
        logger.event("checkpoint", path=str(p), version=trainer.log_step, final=True)
    except Exception as e:
        log.exception("final checkpoint failed")
        logger.event("checkpoint_failed", error=str(e))
        if error is None:
            raise


def failure_counts(stats) -> dict[str, int]:
    """The controller's cumulative failure counts as :func:`report_failures` shows them (and a
    resumed run's :class:`~conveyor.runlog.FailureCounter` starts from)."""
    return {"reward failures": stats.reward_failures, "failed episodes": stats.episodes_failed}


def report_failures(counter: FailureCounter, controller, console) -> None:
    """At most one console line every few seconds with the new reward failures / failed
    episodes (each one, with its traceback, is in train.log)."""
    line = counter.update(failure_counts(controller.stats))
    if line:
        console.print(f"[yellow]{line}[/]")
