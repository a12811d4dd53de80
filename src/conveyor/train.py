"""The main job: asynchronous RL training, assembled (issue 12, section 1).

:func:`run_training` finds where the run starts (new, resumed, finished), loads the data, model
and trainer, opens the run directory's logs, builds the rollout side
(:func:`conveyor.runtime.inline.build_rollout`: engine, rewards, controller, publisher in this
process; with ``runtime.name=ray`` :func:`conveyor.runtime.ray.build_ray_rollout`: the same in a
Ray actor, behind proxies of the same ports), runs the
step protocol (:func:`conveyor.runtime.inline.train_loop` over :func:`conveyor.runtime.step.run_step`)
and finishes (evaluation, export, summary). Generation and training overlap; the staleness bound
eta (MISSION.md section 1) limits how far rollouts run ahead; eta = 0 is synchronous training
through the same code path. Components share no mutable objects: the engine has its own copy of
the weights and receives :class:`~conveyor.sync.WeightUpdate` messages.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from rich.markup import escape

from conveyor.checkpoint import (
    CHECKPOINTS,
    export_policy,
    find_resume_checkpoint,
    latest_checkpoint,
    save_checkpoint,
)
from conveyor.config import ConfigError, TrainConfig, load_config, resolve_reference_scoring
from conveyor.data import load_dataset
from conveyor.eval import reward_note, unknown_note
from conveyor.hardware import resolve_bf16
from conveyor.models import load_model, load_model_config, load_tokenizer
from conveyor.rewards import check_reward_signature, load_reward_fn
from conveyor.rewards.guard import probe_reward_fn
from conveyor.rundir import (
    FIXED_FOR_HELDOUT,
    FIXED_ON_RESUME,
    RunContext,
    TrainResult,
    announce,
    check_new_run_dir,
    check_resume_compatible,
    finished_result,
    preflight_samples,
    prepare_resume,
    recorded_bf16,
    restart_eval_before,
    unsaved_final_versions,
)
from conveyor.runlog import MetricsLogger, next_segment, plot_report, require_wandb, segment_summary
from conveyor.runtime.inline import (
    LoopResult,
    RolloutSide,
    build_rollout,
    engine_device,
    eval_policy,
    heldout_eval,
    train_loop,
)
from conveyor.runtime.trainer_group import TrainerGroup
from conveyor.runtime_files import atomic_write_json, check_run_dir, make_run_dir
from conveyor.shutdown import StopNow
from conveyor.trainer.trainer import Trainer, build_trainer

log = logging.getLogger(__name__)

__all__ = ["CHECKPOINTS", "TrainResult", "load_run_config", "run_training", "save_checkpoint"]


# ---------------------------------------------------------------------- checkpoints
# (conveyor.checkpoint: atomic, verified writes; the old private name stays for callers)
_latest_checkpoint = latest_checkpoint


# ---------------------------------------------------------------------- the run
def resolve_threads(cfg: TrainConfig) -> tuple[int, int]:
    """Intra-op threads for (engine, trainer).

    Defaults ("auto"): the engine gets 1 thread (decode steps are small matrix products that
    gain little from a second thread on CPU; measured 89.6 vs 77.3 tokens/s on SmolLM2, see
    docs/results/engine.md) and the trainer the remaining cores, at least 1. Two OpenMP pools
    spinning on the same cores slow each other down by 10x or more, hence no oversubscription;
    the CLI also sets ``OMP_WAIT_POLICY=PASSIVE``.
    """
    cores = os.cpu_count() or 1
    engine = cfg.rollout.engine_threads or 1
    if cfg.asynchronous.eta == 0:
        # synchronous: the engine idles while the trainer works, so the trainer takes every core
        trainer = cfg.trainer.num_threads or cores
    else:
        trainer = cfg.trainer.num_threads or max(1, cores - engine * cfg.rollout.num_engines)
    return engine, trainer


def _make_run_dir(cfg: TrainConfig) -> Path:
    """Create the run directory: ``run.dir``, or ``runs/<timestamp>-<pid>`` (unique even for
    runs started in the same second). Refuses a directory that already holds a run."""
    if cfg.run.dir:
        p = Path(cfg.run.dir)
    else:
        p = Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    check_new_run_dir(p)  # checked before the model load too (_start_point); a process may have started since
    return make_run_dir(p)  # RunFileError (clear message) when it cannot be created


def run_training(cfg: TrainConfig, *, resume_dir: str | Path | None = None, console=None) -> TrainResult:
    """Run (or resume) an asynchronous RL training job; see the module docstring.

    The run directory is locked for the whole run (``run.lock``; a second process is refused).
    The first Ctrl-C / SIGTERM in the training loop stops it after the current step with a
    checkpoint; a second one stops at once (:class:`~conveyor.shutdown.StopNow`, whose
    ``report`` says what was saved), with threads and worker processes shut down either way.

    Args:
        cfg: The resolved configuration (ignored except for overrides when resuming: the run's
            saved config is loaded and the given overrides already merged by the caller).
        resume_dir: A run directory with checkpoints to continue from, exactly: same version
            numbers, data cursor and buffered trajectories; no trajectory is trained twice, and
            the log rows written after the checkpoint are superseded (:mod:`conveyor.runlog`).
            A run that already finished is left untouched.
        console: Optional ``rich.console.Console`` for the progress display.

    Returns:
        A :class:`TrainResult` (wall-clock and busy fractions over all process segments).

    Raises:
        FileExistsError / FileNotFoundError: run directory conflicts.
        conveyor.runtime_files.RunFileError: run directory in use, not creatable, disk full.
        conveyor.checkpoint.CheckpointError: no intact checkpoint to resume from.
        conveyor.data.DatasetError: unusable data (e.g. every prompt longer than the context).
        conveyor.shutdown.StopNow: a second Ctrl-C / SIGTERM.
        conveyor.trainer.trainer.NonFiniteLossError: too many non-finite steps in a row (a
            checkpoint is written first).
    """
    from rich.console import Console

    console = console or Console()
    ctx = RunContext(console)
    ctx.interrupts.install()
    try:
        return _run_training(cfg, resume_dir, console, ctx)
    except StopNow as e:
        e.report = ctx.stop_report()
        if ctx.logger is not None:
            with contextlib.suppress(Exception):
                ctx.logger.event("stopped_now", phase=ctx.phase, report=e.report)
        raise
    finally:
        ctx.close()


@dataclass
class _Start:
    """Where a run starts: its directory (None: a new one, made after loading), the checkpoint
    to continue from, and whether a run killed before its first checkpoint starts again."""

    run_dir: Path | None = None
    ckpt: Path | None = None
    restart_in_place: bool = False


def _start_point(cfg: TrainConfig, resume_dir, console, ctx: RunContext) -> _Start | TrainResult:
    """The resume target (locked) or a fresh start; a finished run's :class:`TrainResult`."""
    if resume_dir is None:
        if cfg.run.dir:  # a bad or taken run.dir fails now, not after loading the model
            check_run_dir(cfg.run.dir)
            check_new_run_dir(Path(cfg.run.dir))  # a run in it already, or a process using it
        return _Start()
    run_dir = Path(resume_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"--resume {run_dir}: no such run directory")
    ctx.lock(run_dir)  # before reading a checkpoint another process may be writing
    if (run_dir / "config.json").is_file():  # a change the run cannot take is refused, finished or not
        check_resume_compatible(run_dir, cfg)
    finished = finished_result(run_dir, cfg, console)
    if finished is not None:
        return finished

    def warn(m: str) -> None:
        console.print(f"[bold yellow]warning:[/] {escape(m)}", emoji=False)

    ckpt = find_resume_checkpoint(run_dir, warn=warn)
    again = unsaved_final_versions(run_dir, ckpt)
    if again is not None:  # a finished run trained longer from an older checkpoint: said, nothing lost
        warn(again)
    restart = False
    if ckpt is None:
        if not (run_dir / "config.json").is_file():
            raise FileNotFoundError(f"--resume {run_dir}: no finished checkpoint under {run_dir / CHECKPOINTS}")
        ended = _ended_without_checkpoint(run_dir)
        if ended is not None:  # finished, nothing kept to continue from: refused, its logs left as they are
            raise FileNotFoundError(f"--resume {run_dir}: {ended}")
        # stopped before its first checkpoint (e.g. killed in the evaluation before training):
        # nothing to continue from, so the run starts again, in its own directory
        warn(f"{run_dir} has no checkpoint yet (the process stopped before its first one): "
             "starting the run again from version 0 in the same directory")
        restart = True
    return _Start(run_dir, ckpt, restart)


def _ended_without_checkpoint(run_dir: Path) -> str | None:
    """Why a run with no checkpoint cannot be resumed when its process ran to the end
    (``summary.json``, not interrupted; e.g. ``run.final_checkpoint=none``), else None."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("interrupted"):
        return None
    saved = load_config(run_dir / "config.json")
    return (f"the run finished at version {summary.get('steps')} without keeping a checkpoint "
            f"(run.final_checkpoint={saved.run.final_checkpoint}, run.checkpoint_every="
            f"{saved.run.checkpoint_every}), so there is nothing to continue from; start a new run "
            "(this one is left as it is)")


@dataclass
class _Job:
    """What a run trains with, loaded and restored."""

    trainer: Trainer
    tokenizer: object
    reward_fn: str  # reward.fn: what the reward workers load
    train_samples: list
    heldout: list
    n_too_long: int
    warnings: list[str]
    engine_threads: int
    state: dict | None = None  # the checkpoint's state.pt
    resumed: dict = field(default_factory=dict)  # prepare_resume's report


def _device_type(cfg: TrainConfig) -> str | None:
    """``cpu`` / ``cuda``: the kind of device the trainer will run on (``trainer.device`` resolved
    as the trainer resolves it); None where that fails (the trainer then reports why)."""
    from conveyor.devices import resolve

    if cfg.trainer.world_size > 1 and cfg.trainer.device == "auto":
        return "cpu"
    try:
        return resolve(cfg.trainer.device, "trainer.device").type
    except ValueError:
        return None


def _load_job(cfg: TrainConfig, start: _Start, console, ctx: RunContext) -> _Job:
    """Data, model, trainer (restored from ``start.ckpt``); everything that can fail on bad
    input, before the run directory is touched (a typo never leaves a stray directory). With
    ``trainer.world_size`` > 1 the other trainer processes start here (closed with ``ctx``)."""
    torch.manual_seed(cfg.run.seed)
    random.seed(cfg.run.seed)
    engine_threads, trainer_threads = resolve_threads(cfg)
    torch.set_num_threads(trainer_threads)
    # imported and its signature checked here (a typo fails before anything is written); the
    # reward workers load it by its import path, so any module-level callable works (a
    # lambda or a factory's closure too: nothing is pickled)
    check_reward_signature(load_reward_fn(cfg.reward.fn), cfg.reward.fn)
    reward_fn = cfg.reward.fn
    train_samples = load_dataset(cfg.data.train, split_seed=cfg.data.split_seed)
    if cfg.reward.check_at_start and train_samples:  # a reward that always fails: refused before the model loads
        probe_reward_fn(reward_fn, train_samples[0], timeout_s=cfg.reward.timeout_s, max_abs_score=cfg.reward.max_abs)
    heldout = load_dataset(cfg.data.heldout, split_seed=cfg.data.split_seed, limit=cfg.data.heldout_limit) if cfg.data.heldout else []
    trainer_actor = cfg.runtime.name == "ray" and cfg.runtime.trainer == "actor"
    if trainer_actor:  # the weights live in the trainer actor only (this process may lack the memory)
        tokenizer = load_tokenizer(cfg.model.name)
        policy: Any = SimpleNamespace(config=load_model_config(cfg.model.name, tokenizer))  # (preflight: its context)
    else:
        lm = load_model(cfg.model.name, seed=cfg.model.seed, init=cfg.model.init)
        tokenizer, policy = lm.tokenizer, lm.model
    train_samples, heldout, n_too_long, warnings = preflight_samples(cfg, train_samples, heldout, tokenizer, policy)
    # a resume keeps trainer.bf16=auto's first choice (a new measurement could flip the precision)
    bf16_choice = recorded_bf16(start.run_dir, _device_type(cfg)) if start.run_dir is not None else None
    group, precision_note = None, None
    if cfg.trainer.world_size > 1:  # FSDP2 data parallelism: every process at rank 0's precision
        bf16_choice, precision_note = resolve_bf16(cfg.trainer.bf16, "cpu", recorded=bf16_choice)
        # the trainer's threads shared among its processes (they compute in lockstep)
        trainer_threads = max(1, trainer_threads // cfg.trainer.world_size)
        torch.set_num_threads(trainer_threads)
        group = TrainerGroup.start(cfg, bf16=bf16_choice, threads=trainer_threads)
        ctx.stack.callback(group.close)
    if trainer_actor:  # the trainer in a Ray actor of its own
        from conveyor.runtime.ray_trainer import start_trainer_actor

        trainer = start_trainer_actor(cfg, bf16_choice=bf16_choice, threads=trainer_threads, ctx=ctx)
    else:
        trainer = build_trainer(cfg, policy, bf16_choice=bf16_choice, data_parallel=group.dp if group else None)
    if precision_note is not None:
        trainer.precision_note = precision_note
    if cfg.runtime.name == "inline":  # a device this process lacks fails before the run directory is made
        engine_device(cfg)
    job = _Job(trainer, tokenizer, reward_fn, train_samples, heldout, n_too_long, warnings, engine_threads)
    if start.ckpt is not None:
        # (on the host: a checkpoint written on a GPU resumes on a CPU, and the reverse)
        trainer.load_state_dict(torch.load(start.ckpt / "trainer.pt", map_location="cpu", weights_only=False))
        job.state = torch.load(start.ckpt / "state.pt", map_location="cpu", weights_only=False)
        torch.set_rng_state(job.state["rng"]["torch"])
        random.setstate(job.state["rng"]["python"])
        if trainer.version >= cfg.trainer.total_steps:  # killed after its last step: finish the run
            console.print(f"{start.run_dir} is already at version {trainer.version} >= "
                          f"trainer.total_steps={cfg.trainer.total_steps}: completing its "
                          "evaluation, export and summary; to train longer: conveyor train "
                          f"--resume {start.run_dir} trainer.total_steps=N")
    if start.ckpt is not None or start.restart_in_place:  # every row logged after it is superseded
        job.resumed = prepare_resume(start.run_dir, trainer.log_step)
    if start.restart_in_place:  # the same initial policy: its evaluation is reused if it measured it
        job.resumed["eval_before"] = restart_eval_before(start.run_dir, cfg)
    return job


def config_changes(saved: Path, new: dict) -> dict[str, dict]:
    """The settings a resume changes: dotted key -> ``{"old": ..., "new": ...}`` between the run's
    saved ``config.json`` (the versions trained so far) and ``new`` (a config's ``to_dict()``);
    recorded in the ``resume`` event, as config.json is rewritten with the new values (fresh-user
    finding: nothing kept what the first versions ran with). {} when ``saved`` is missing."""
    if not saved.is_file():
        return {}
    old = json.loads(saved.read_text())

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            if isinstance(v, dict) and v and k != "options":  # env.options / monitor.actions stay whole
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    a, b = flat(old), flat(new)
    return {k: {"old": a.get(k), "new": b.get(k)} for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _open_logs(cfg: TrainConfig, run_dir: Path, start: _Start, job: _Job, console, ctx: RunContext) -> MetricsLogger:
    """config.json, the metrics logger, train.log, and the run's opening events (proximal
    method, precision, critic, resume) and warnings."""
    trainer = job.trainer
    resuming = start.ckpt is not None or start.restart_in_place
    changed = config_changes(run_dir / "config.json", cfg.to_dict()) if resuming else {}
    atomic_write_json(run_dir / "config.json", cfg.to_dict())
    logger = MetricsLogger(run_dir, version=trainer.log_step, segment=next_segment(run_dir),
                           purge_step=trainer.log_step + 1 if resuming else None,
                           log_cfg=cfg.log, run_config=cfg.to_dict())  # log.wandb: W&B too
    ctx.logger = logger
    ctx.stack.callback(logger.close)
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("conveyor").addHandler(handler)
    ctx.stack.callback(logging.getLogger("conveyor").removeHandler, handler)
    logging.getLogger("conveyor").setLevel(logging.INFO)
    if trainer.objective.needs_proximal:
        logger.event("proximal", method=trainer.proximal.name, requested=cfg.proximal.method,
                     note=trainer.proximal_note, extra_bytes=trainer.proximal.extra_bytes())
    else:  # e.g. dis / ppo: the ratio's denominator is the behaviour policy, proximal.* is unused
        logger.event("proximal", method="none", requested=cfg.proximal.method,
                     note=f"loss.name={cfg.loss.name} uses no proximal policy", extra_bytes=0)
    logger.event("precision", bf16=trainer.bf16, requested=cfg.trainer.bf16,  # trainer.bf16=auto's choice:
                 note=trainer.precision_note,  # kept on resume (recorded_bf16) on the same kind of device
                 device_type=getattr(getattr(trainer, "device", None), "type", "cpu"))
    # where the models run (trainer.device, rollout.engine_device; the Ray runtime's actors resolve
    # the engine's in their own process)
    devices = {"trainer": str(getattr(trainer, "device", "actor")),
               "engine": str(engine_device(cfg)) if cfg.runtime.name == "inline" else "actor"}
    logger.event("devices", **devices, requested_trainer=cfg.trainer.device, requested_engine=cfg.rollout.engine_device)
    if "cuda" in "".join(devices.values()):  # (the CPU, the usual case, goes unsaid)
        console.print(f"devices: trainer {devices['trainer']}, engine {devices['engine']}")
    if trainer.lora is not None:  # trainable parameters, what the engine receives
        logger.event("lora", note=trainer.lora.note, trainable_parameters=trainer.lora.trainable, sync=cfg.lora.sync)
    if trainer.critic is not None:
        logger.event("critic", note=trainer.critic_note, warmup_done=trainer.critic_warmup_done,
                     warmup_steps=cfg.critic.warmup_steps)
    if start.restart_in_place:
        logger.event("restart", version=0, **job.resumed)
    if start.ckpt is not None:
        taken = list(getattr(trainer, "settings_taken", []))  # e.g. "policy lr 2e-05 -> 0.001"
        logger.event("resume", checkpoint=str(start.ckpt), version=trainer.version, **job.resumed, changed=changed,
                     optimizer_settings_taken=taken)
        console.print(f"[bold]resumed[/] {run_dir} at version {trainer.version} from {start.ckpt.name}")
        if changed:  # config.json now holds the new values: the event keeps what the versions before ran with
            console.print("  changed on resume: " + ", ".join(f"{k} {v['old']!r} -> {v['new']!r}"
                                                              for k, v in changed.items()), soft_wrap=True)
        if taken:  # the optimizer's loaded state held the checkpoint's values
            console.print("  the optimizers take them from now on: " + ", ".join(taken), soft_wrap=True)
        if any(k == "reward.fn" or k.startswith("reward.") for k in changed):
            console.print("  [yellow]note:[/] the trajectories buffered in the checkpoint were scored with the "
                          "reward settings before; they are trained as they were scored", soft_wrap=True)
        for line in job.resumed["cleaned"]:
            console.print(f"  removed {line}")
        for line in job.resumed.get("superseded_files", []):
            console.print(f"  moved {line} (an evaluation of the process before)")
        if job.resumed["superseded_rows"]:
            console.print(f"  rows logged after {start.ckpt.name} by the interrupted process are "
                          "superseded (moved to *.superseded.jsonl / marked in events.jsonl): "
                          f"{job.resumed['superseded_rows']}")
    announce(job.warnings, logger, console)
    return logger


def _run_training(cfg: TrainConfig, resume_dir: str | Path | None, console,
                  ctx: RunContext) -> TrainResult:
    """The body of :func:`run_training`: assembly of the components (everything to release is
    registered on ``ctx``); the step protocol is :mod:`conveyor.runtime`'s."""
    if cfg.runtime.name == "ray":  # before anything is loaded or written: a clear error
        from conveyor.runtime.ray import check_ray_address, require_ray

        if not require_ray().is_initialized():  # (an initialised Ray is used as it is)
            check_ray_address(cfg.runtime.address)
    if cfg.log.wandb:  # likewise: pip install 'conveyor[wandb]'
        require_wandb()
    start = _start_point(cfg, resume_dir, console, ctx)
    if isinstance(start, TrainResult):
        return start  # finished already: left untouched
    job = _load_job(cfg, start, console, ctx)
    trainer = job.trainer
    if start.run_dir is None:
        start.run_dir = _make_run_dir(cfg)
        ctx.lock(start.run_dir)
    run_dir = start.run_dir
    ctx.trainer, ctx.start_version = trainer, trainer.version
    logger = _open_logs(cfg, run_dir, start, job, console, ctx)
    if cfg.trainer.reference_scoring == "auto" and cfg.loss.kl_coef > 0:  # which mode auto chose, and why
        # (on Ray the runtime alone rules the scorer out; the trainer may be an actor's proxy there)
        log.info("%s", resolve_reference_scoring(cfg, "cpu" if cfg.runtime.name == "ray" else str(trainer.device))[1])
    if cfg.runtime.name == "ray":  # the rollout side in a Ray actor, the same ports (runtime/ray.py)
        from conveyor.runtime.ray import build_ray_rollout

        parts = build_ray_rollout(cfg, trainer, job.train_samples, engine_threads=job.engine_threads,
                                  logger=logger, ctx=ctx, n_too_long=job.n_too_long, state=job.state)
    else:
        parts = build_rollout(cfg, trainer, job.tokenizer, job.reward_fn, job.train_samples,
                              engine_threads=job.engine_threads, logger=logger, ctx=ctx,
                              n_too_long=job.n_too_long, state=job.state)
    progress = cfg.run.progress and console.is_terminal
    before = _eval_before(cfg, start, job, parts, logger, run_dir, console, ctx, progress)
    steering_state = ((job.state or {}).get("controller", {}).get("runtime", {}) or {}).get("steering")
    loop = train_loop(cfg, trainer, parts, logger, run_dir, console, ctx, tokenizer=job.tokenizer,
                      heldout=job.heldout, progress=progress, steering_state=steering_state)
    if loop.error is None:  # (a StopNow keeps the phase it interrupted for its report)
        ctx.phase = "the evaluation, export and summary after training"
    return _finish(cfg, job, parts, loop, logger, run_dir, console, ctx, before, progress)


def eval_decoding(cfg: TrainConfig) -> str:
    """How the held-out evaluations decode, for the console: ``greedy`` or ``4 samples at T = 0.6``."""
    if cfg.run.eval_temperature == 0 and cfg.run.eval_samples == 1:
        return "greedy"
    n = cfg.run.eval_samples
    return f"{n} sample{'s' if n > 1 else ''} at T = {cfg.run.eval_temperature:g}"


def _eval_before(cfg, start: _Start, job: _Job, parts: RolloutSide, logger, run_dir: Path, console,
                 ctx: RunContext, progress: bool) -> float | None:
    """Held-out pass@1 before training: evaluated on a fresh run, read back on a resume (and on a
    run started again in place whose first process measured it: :func:`restart_eval_before`)."""
    reused = start.restart_in_place and (run_dir / "eval_before.json").is_file()
    if reused:
        console.print(f"held-out evaluation before training: reusing {run_dir / 'eval_before.json'} (the same "
                      "initial policy)")
    if job.heldout and cfg.run.eval_before and start.ckpt is None and not reused:
        ctx.phase = "the held-out evaluation before training"
        console.print(f"held-out evaluation before training ({len(job.heldout)} problems of {cfg.data.heldout}, "
                      f"{eval_decoding(cfg)})")
        res = heldout_eval(parts.engine, job.tokenizer, cfg, job.heldout, "before", logger, run_dir, progress,
                           parts.reward_service, evaluate_fn=parts.evaluate, version=job.trainer.version,
                           policy=eval_policy(cfg, job.trainer))
        console.print(f"  pass@1 before: [bold]{res.pass_at_1:.3f}[/]  format rate {res.format_rate:.3f}  "
                      f"({res.wall_seconds + res.check_seconds:.0f} s)" + reward_note(res) + unknown_note(res))
        return res.pass_at_1
    if (start.ckpt is not None or reused) and (run_dir / "eval_before.json").is_file():
        return json.loads((run_dir / "eval_before.json").read_text())["pass_at_1"]
    return None


def _finish(cfg: TrainConfig, job: _Job, parts: RolloutSide, loop: LoopResult, logger: MetricsLogger,
            run_dir: Path, console, ctx: RunContext, before: float | None, progress: bool) -> TrainResult:
    """After the loop: engine statistics, the error (re-raised), the held-out evaluation after
    training, export, ``summary.json`` and the report plot."""
    trainer, engine, controller = job.trainer, parts.engine, parts.controller
    try:  # the engine's counters and decode profile: `conveyor simulate RUN_DIR` calibrates from them
        atomic_write_json(run_dir / "engine_stats.json", engine.stats(), indent=1)
    except OSError:
        log.exception("could not write engine_stats.json")
    if loop.error is not None:
        engine.stop()
        parts.reward_service.close()
        if not isinstance(loop.error, StopNow):  # (a second Ctrl-C is reported by run_training)
            logger.event("error", error=repr(loop.error), version=trainer.version)
        raise loop.error  # the logs are closed by ctx
    after = None
    if job.heldout and cfg.run.eval_after and not loop.interrupted:
        console.print(f"held-out evaluation after training (version {engine.version}, {eval_decoding(cfg)})")
        res = heldout_eval(engine, job.tokenizer, cfg, job.heldout, "after", logger, run_dir, progress,
                           parts.reward_service, evaluate_fn=parts.evaluate, version=trainer.version,
                           policy=eval_policy(cfg, trainer))
        after = res.pass_at_1
        console.print(f"  pass@1 after: [bold]{after:.3f}[/]  format rate {res.format_rate:.3f}" + reward_note(res)
                      + unknown_note(res))
    engine.stop()
    parts.reward_service.close()
    if cfg.run.export and trainer.version > 0:
        export_dir = run_dir / "export"
        # with LoRA: the merged plain model, and the peft adapter in export/adapter/
        export_policy(trainer.inference_policy(), job.tokenizer, export_dir, cfg.run.export_dtype)  # float32 | bfloat16
        if trainer.lora is not None:
            from conveyor.trainer.lora import ADAPTER_DIR

            trainer.save_adapter(export_dir / ADAPTER_DIR)  # collective with data parallelism
        # tool, instruction, data set and eval settings: `conveyor eval --model RUN/export`
        # reproduces the held-out figure by default (issue 10, section 5b)
        from conveyor.eval import write_export_settings

        write_export_settings(export_dir, cfg, policy_version=trainer.version, heldout_pass_at_1=after,
                              interrupted=loop.interrupted or trainer.version < cfg.trainer.total_steps)
        logger.event("export", path=str(export_dir), version=trainer.version)
    seg = segment_summary(run_dir, {  # wall-clock over every process segment of the run
        "segment": logger.segment, "wall_seconds": loop.wall_s, "trainer_busy_seconds": loop.trainer_busy_s,
        "engine_busy_seconds": loop.engine_busy_s,
        "cpu_busy_seconds": None if loop.cpu_busy is None else loop.cpu_busy * loop.wall_s,
        "start_version": ctx.start_version,
        "end_version": trainer.version})
    needs_proximal = trainer.objective.needs_proximal
    summary = {
        "run_dir": str(run_dir), "steps": trainer.version, "heldout_before": before, "heldout_after": after,
        "wall_seconds": seg["wall_seconds"], "interrupted": loop.interrupted, "stop_reason": loop.stop_reason,
        "trainer_busy": seg["trainer_busy"], "engine_busy": seg["engine_busy"], "cpu_busy": seg["cpu_busy"],
        "segments": seg["segments"], "controller": controller.counters(),
        # the bound in force at the end (the adaptive controller / monitor may have moved it) and the configured one
        "eta": loop.eta, "eta_configured": cfg.asynchronous.eta, "eta_adaptive": cfg.asynchronous.adaptive,
        # the cost ledger of the proximal strategy (MISSION.md section 2)
        "proximal": {
            "method": trainer.proximal.name if needs_proximal else "none",
            "requested": cfg.proximal.method,
            "note": trainer.proximal_note if needs_proximal else f"loss.name={cfg.loss.name} uses no proximal policy",
            "extra_bytes": trainer.proximal.extra_bytes() if needs_proximal else 0,
            "mean_proximal_s": loop.mean_proximal_s,
            "mean_train_step_s": loop.mean_train_step_s,
        },
    }
    atomic_write_json(run_dir / "summary.json", summary)
    st = controller.stats
    if st.trajectories_accepted and st.reward_failures > 0.5 * st.trajectories_accepted:
        console.print(f"[bold yellow]warning:[/] {st.reward_failures} of {st.trajectories_accepted} rewards failed "
                      f"(reward.fn={cfg.reward.fn}); see {run_dir / 'train.log'}")
    report = None
    try:
        report = plot_report(run_dir, title=f"{cfg.model.name} on {cfg.data.train}, eta={cfg.asynchronous.eta}")
    except Exception:
        log.exception("report plot failed")
    logger.report(report, summary)  # log.wandb: the report image and the summary to W&B
    return TrainResult(run_dir, trainer.version, before, after, summary["wall_seconds"],
                       loop.interrupted, summary["trainer_busy"], summary["engine_busy"], loop.stop_reason,
                       ctx.interrupts.first_signum if loop.stop_reason == "signal" else None,
                       cpu_busy=summary["cpu_busy"])


def load_run_config(run_dir: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """The saved ``config.json`` of a run, with ``overrides`` applied (e.g. a larger
    ``trainer.total_steps`` to continue a finished run)."""
    p = Path(run_dir) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{run_dir} is not a conveyor run directory (no config.json)")
    try:
        return load_config(p, overrides)
    except ConfigError as e:
        # an override of a key the resume cannot change may fail validation against the saved
        # settings first (env.name=guess: "set rollout.tool=none", which is fixed too): say the cause
        fixed = {f"{a}.{b}" for a, b in FIXED_ON_RESUME}
        if (Path(run_dir) / "eval_before.json").is_file():
            fixed |= {f"{a}.{b}" for a, b in FIXED_FOR_HELDOUT}
        from conveyor.config import _parse_value

        try:
            saved = json.loads(p.read_text())
        except (OSError, ValueError):
            saved = {}

        def differs(item: str) -> bool:  # an override that keeps the saved value changes nothing
            key, _, raw = item.partition("=")
            node: object = saved
            for part in key.strip().split("."):
                if not isinstance(node, dict) or part not in node:
                    return True
                node = node[part]
            return node != _parse_value(raw)

        hit = [o.partition("=")[0].strip() for o in overrides or [] if differs(o)]
        hit = [k for k in hit if k in fixed or any(k.startswith(f + ".") for f in fixed)]
        if hit:
            raise ConfigError(f"{e}\n(--resume {run_dir}: {', '.join(hit)} cannot change on resume: the checkpoint "
                              "and the held-out evaluation before training were made with the saved value; start a "
                              "new run to change it)") from e
        raise
