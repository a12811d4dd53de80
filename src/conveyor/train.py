"""The inline runtime and the main job: asynchronous RL training in one process.

Threads: the engine's decode loop (:class:`~conveyor.rollout.engine.InferenceEngine`), the rollout
controller's asyncio loop (:class:`~conveyor.rollout.controller.RolloutController`), and the
trainer in the calling thread. Generation and training overlap; the staleness bound eta
(MISSION.md section 1) limits how far rollouts run ahead; eta = 0 is synchronous training through
the same code path. Components share no mutable objects: the engine has its own copy of the
weights and receives :class:`~conveyor.sync.WeightUpdate` messages.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import random
import time
from pathlib import Path

import torch
from rich.markup import escape

from conveyor.checkpoint import (
    CHECKPOINTS,
    export_policy,
    find_resume_checkpoint,
    latest_checkpoint,
    save_checkpoint,
)
from conveyor.config import TrainConfig, load_config
from conveyor.data import DatasetError, load_dataset
from conveyor.eval import evaluate
from conveyor.faults import fault_point
from conveyor.models import load_model
from conveyor.rewards import ANSWER_METRICS, RewardService, load_reward_fn
from conveyor.rollout.buffer import TrajectoryBuffer
from conveyor.rollout.controller import DataStream, RolloutController, wait_for_batch
from conveyor.rollout.engine import InferenceEngine, SamplingParams
from conveyor.rollout.staleness import StalenessManager
from conveyor.rollout.workflow import EnvLatencyWorkflow, SingleTurnMathWorkflow
from conveyor.rundir import (
    RunContext,
    TrainResult,
    announce,
    check_resume_compatible,
    final_checkpoint,
    finished_result,
    preflight_samples,
    prepare_resume,
    report_failures,
)
from conveyor.runlog import (
    FailureCounter,
    MetricsLogger,
    next_segment,
    plot_report,
    segment_summary,
)
from conveyor.runtime.publish import PendingTokens, buffered_pending, publisher_for, tracks_partials
from conveyor.runtime_files import (
    atomic_write,
    atomic_write_json,
    check_run_dir,
    make_run_dir,
)
from conveyor.shutdown import StopNow
from conveyor.trainer.trainer import NonFiniteLossError, Trainer

log = logging.getLogger(__name__)

__all__ = ["CHECKPOINTS", "TrainResult", "load_run_config", "run_training", "save_checkpoint"]


# ---------------------------------------------------------------------- checkpoints
# (conveyor.checkpoint: atomic, verified writes; the old private name stays for callers)
_latest_checkpoint = latest_checkpoint
_TrajView = PendingTokens  # the name before conveyor.runtime.publish


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
        trainer = cfg.trainer.num_threads or max(1, cores - engine)
    return engine, trainer


def _make_run_dir(cfg: TrainConfig) -> Path:
    """Create the run directory: ``run.dir``, or ``runs/<timestamp>-<pid>`` (unique even for
    runs started in the same second). Refuses a directory that already holds a run."""
    if cfg.run.dir:
        p = Path(cfg.run.dir)
    else:
        p = Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    if (p / "metrics.jsonl").exists() or _latest_checkpoint(p) is not None:
        raise FileExistsError(f"run directory {p} already holds a run: use `conveyor train --resume {p}` or another run.dir")
    return make_run_dir(p)  # RunFileError (clear message) when it cannot be created


def _heldout_eval(engine, tokenizer, cfg: TrainConfig, samples, label: str, logger: MetricsLogger, run_dir: Path, progress: bool,
                  reward_service: RewardService | None = None):
    res = evaluate(
        engine, tokenizer, samples, k=1, temperature=0.0, max_new_tokens=cfg.run.eval_max_new_tokens,
        instruction=cfg.data.instruction, dataset=cfg.data.heldout, model_name=cfg.model.name, progress=progress,
        tool=cfg.rollout.tool, max_tool_calls=cfg.rollout.max_tool_calls,
        reward_service=reward_service,  # answer checks in the run's reward workers (metrics only)
    )
    atomic_write(run_dir / f"eval_{label}.json", res.write_json)  # never a half-written file
    # version: the latest log step (the policy version; k - W during a critic warm-up of W steps)
    logger.event("eval", label=label, **{k: v for k, v in res.summary().items() if not isinstance(v, dict)})
    return res


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


def _critic_warmup(trainer: Trainer, cfg: TrainConfig, buffer: TrajectoryBuffer, batch_trajectories: int,
                   controller: RolloutController, logger: MetricsLogger, run_dir: Path, console, health,
                   stop, clock) -> float:
    """The critic warm-up (``critic.warmup_steps``; SAO's cold start, MISSION.md section 3):
    critic-only steps on batches of the frozen initial policy's rollouts, before any policy
    update. Each step is logged (``critic_warmup.jsonl``, TensorBoard ``critic_warmup/*``, the
    batch in ``trained.jsonl`` with ``phase: critic_warmup``) and checkpointed as
    ``warmup_<k>`` every ``run.checkpoint_every`` steps, so a resume continues mid-warm-up.

    Args:
        clock: ``clock(busy_s) -> {"time/elapsed_s", "busy/trainer", "busy/engine"}`` of the
            process so far (how a resumed run's summary adds up this segment's time).

    Returns:
        Seconds the trainer was busy.
    """
    total = cfg.critic.warmup_steps
    busy = 0.0
    console.print(f"critic warm-up: {total - trainer.critic_warmup_done} critic-only steps on rollouts of the "
                  f"initial policy ({trainer.critic_note})")
    while trainer.in_critic_warmup and not stop.is_set():
        batch = wait_for_batch(buffer, batch_trajectories, lambda: trainer.version, health_fn=health, stop=stop)
        if batch is None:
            break
        t0 = time.perf_counter()
        metrics = trainer.critic_warmup_step(batch)
        controller.set_warmup_batches(trainer.critic_warmup_done)
        busy += time.perf_counter() - t0
        k = trainer.critic_warmup_done
        metrics.update(clock(busy))
        logger.warmup(trainer.log_step, k, metrics)
        logger.trained(trainer.log_step, batch, not_trained=controller.take_not_trained(), phase="critic_warmup")
        vl = f"value loss {metrics.get('critic/value_loss', float('nan')):.4f}"
        if cfg.critic.updates_per_step > 1:  # the loss before the first and before the last update
            vl += f" -> {metrics.get('critic/value_loss_last', float('nan')):.4f}"
        console.print(f"critic warm-up {k}/{total}: {vl}, explained variance "
                      f"{metrics.get('critic/explained_variance', float('nan')):.3f}, reward "
                      f"{metrics['reward/mean']:.3f} ({metrics['time/critic_warmup_step_s']:.1f} s)")
        fault_point("step_end")  # chaos suite: a kill between steps
        if k % cfg.run.checkpoint_every == 0 and trainer.in_critic_warmup:
            p = save_checkpoint(run_dir, trainer, controller, keep=cfg.run.keep_checkpoints)
            logger.event("checkpoint", path=str(p), version=trainer.log_step)
    return busy


def _run_training(cfg: TrainConfig, resume_dir: str | Path | None, console,
                  ctx: RunContext) -> TrainResult:
    """The body of :func:`run_training`; everything to release is registered on ``ctx``."""
    ckpt = None
    restart_in_place = False
    if resume_dir is not None:
        run_dir = Path(resume_dir)
        if not run_dir.is_dir():
            raise FileNotFoundError(f"--resume {run_dir}: no such run directory")
        ctx.lock(run_dir)  # before reading a checkpoint another process may be writing
        finished = finished_result(run_dir, cfg, console)
        if finished is not None:
            return finished

        def warn(m: str) -> None:
            console.print(f"[bold yellow]warning:[/] {escape(m)}", emoji=False)

        ckpt = find_resume_checkpoint(run_dir, warn=warn)
        if ckpt is None:
            if not (run_dir / "config.json").is_file():
                raise FileNotFoundError(f"--resume {run_dir}: no finished checkpoint under {run_dir / CHECKPOINTS}")
            # stopped before its first checkpoint (e.g. killed in the evaluation before training):
            # nothing to continue from, so the run starts again, in its own directory
            warn(f"{run_dir} has no checkpoint yet (the process stopped before its first one): "
                 "starting the run again from version 0 in the same directory")
            restart_in_place = True
        check_resume_compatible(run_dir, cfg)
    elif cfg.run.dir:
        check_run_dir(cfg.run.dir)  # a bad run.dir fails now, not after loading the model

    # Everything that can fail on bad input is loaded before the run directory is touched, so a
    # typo never leaves a stray directory or a rewritten config behind.
    torch.manual_seed(cfg.run.seed)
    random.seed(cfg.run.seed)
    engine_threads, trainer_threads = resolve_threads(cfg)
    torch.set_num_threads(trainer_threads)
    reward_fn = load_reward_fn(cfg.reward.fn)
    train_samples = load_dataset(cfg.data.train, split_seed=cfg.data.split_seed)
    heldout = load_dataset(cfg.data.heldout, split_seed=cfg.data.split_seed, limit=cfg.data.heldout_limit) if cfg.data.heldout else []
    lm = load_model(cfg.model.name, seed=cfg.model.seed)
    tokenizer = lm.tokenizer
    policy = lm.model
    train_samples, heldout, n_too_long, warnings = preflight_samples(
        cfg, train_samples, heldout, tokenizer, policy)
    trainer = Trainer(policy, cfg.trainer, cfg.loss, temperature=cfg.rollout.temperature, proximal_cfg=cfg.proximal,
                      eta=cfg.asynchronous.eta, max_new_tokens=cfg.rollout.max_new_tokens, critic_cfg=cfg.critic)
    state = None
    if ckpt is not None:
        trainer.load_state_dict(torch.load(ckpt / "trainer.pt", weights_only=False))
        state = torch.load(ckpt / "state.pt", weights_only=False)
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if trainer.version >= cfg.trainer.total_steps:  # killed after its last step: finish the run
            console.print(f"{run_dir} is already at version {trainer.version} >= "
                          f"trainer.total_steps={cfg.trainer.total_steps}: completing its "
                          "evaluation, export and summary; to train longer: conveyor train "
                          f"--resume {run_dir} trainer.total_steps=N")
        resumed = prepare_resume(run_dir, trainer.log_step)
    elif restart_in_place:  # locked above; every row an earlier process logged is superseded
        resumed = prepare_resume(run_dir, trainer.log_step)
        (run_dir / "eval_before.json").unlink(missing_ok=True)
    else:
        run_dir = _make_run_dir(cfg)
        ctx.lock(run_dir)
    ctx.trainer, ctx.start_version = trainer, trainer.version

    atomic_write_json(run_dir / "config.json", cfg.to_dict())
    logger = MetricsLogger(run_dir, version=trainer.log_step, segment=next_segment(run_dir),
                           purge_step=trainer.log_step + 1 if (ckpt is not None or restart_in_place) else None)
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
    logger.event("precision", bf16=trainer.bf16, note=trainer.precision_note)  # trainer.bf16=auto's choice
    if trainer.critic is not None:
        logger.event("critic", note=trainer.critic_note, warmup_done=trainer.critic_warmup_done,
                     warmup_steps=cfg.critic.warmup_steps)
    if restart_in_place:
        logger.event("restart", version=0, **resumed)
    if ckpt is not None:
        logger.event("resume", checkpoint=str(ckpt), version=trainer.version, **resumed)
        console.print(f"[bold]resumed[/] {run_dir} at version {trainer.version} from {ckpt.name}")
        for line in resumed["cleaned"]:
            console.print(f"  removed {line}")
        if resumed["superseded_rows"]:
            console.print(f"  rows logged after {ckpt.name} by the interrupted process are "
                          "superseded (moved to *.superseded.jsonl / marked in events.jsonl): "
                          f"{resumed['superseded_rows']}")
    announce(warnings, logger, console)

    engine_model = copy.deepcopy(policy).eval()
    for p in engine_model.parameters():
        p.requires_grad_(False)
    engine = InferenceEngine(engine_model, tokenizer, version=trainer.version, max_batch_size=cfg.rollout.max_batch_size,
                             seed=cfg.run.seed + trainer.version, num_threads=engine_threads,
                             track_partials=tracks_partials(trainer.proximal),
                             reencode_on_update=cfg.rollout.reencode_on_update)
    engine.start()
    ctx.stack.callback(engine.stop)
    reward_service = RewardService(reward_fn, timeout_s=cfg.reward.timeout_s,
                                   failure_score=cfg.reward.failure_score, max_workers=cfg.reward.workers,
                                   metrics=ANSWER_METRICS,  # correctness off the main process too
                                   max_abs_score=cfg.reward.max_abs)
    ctx.stack.callback(reward_service.close)
    G = cfg.rollout.group_size
    B = cfg.trainer.batch_size * G  # trajectories per update
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                            min_p=cfg.rollout.min_p)
    workflow = SingleTurnMathWorkflow(tokenizer, reward_service, params, group_size=G, instruction=cfg.data.instruction,
                                      tool=cfg.rollout.tool, max_tool_calls=cfg.rollout.max_tool_calls)
    lat = cfg.rollout.env_latency
    if lat.median_s > 0:
        workflow = EnvLatencyWorkflow(workflow, median_s=lat.median_s, sigma=lat.sigma, max_s=lat.max_s, seed=lat.seed + trainer.version)
    eta = cfg.asynchronous.eta
    staleness = StalenessManager(batch_size=B, eta=eta, max_concurrent=max(cfg.rollout.max_concurrent, G))
    buffer = TrajectoryBuffer(eta, on_drop=staleness.on_drop)
    controller = RolloutController(
        engine, workflow, DataStream(train_samples, seed=cfg.data.shuffle_seed), staleness, buffer,
        group_size=G, filter_all_equal=cfg.rollout.filter_all_equal,
        max_filtered_in_a_row=cfg.rollout.max_filtered_in_a_row, version=trainer.version,
        on_skip=lambda s, why: logger.event("prompt_too_long", sample=s.id, reason=why),
    )
    ctx.stack.callback(controller.stop)
    # prompts dropped up front (on resume, restore() puts back the checkpoint's count)
    controller.stats.prompts_too_long = n_too_long
    controller.set_warmup_batches(trainer.critic_warmup_done)
    if state is not None:
        controller.restore(state["controller"], trainer.version)

    progress = cfg.run.progress and console.is_terminal
    before = after = None
    if heldout and cfg.run.eval_before and ckpt is None:
        ctx.phase = "the held-out evaluation before training"
        console.print(f"held-out evaluation before training ({len(heldout)} problems of {cfg.data.heldout}, greedy)")
        res = _heldout_eval(engine, tokenizer, cfg, heldout, "before", logger, run_dir, progress, reward_service)
        before = res.pass_at_1
        console.print(f"  pass@1 before: [bold]{before:.3f}[/]  format rate {res.format_rate:.3f}  ({res.wall_seconds:.0f} s)")
    elif ckpt is not None and (run_dir / "eval_before.json").is_file():
        before = json.loads((run_dir / "eval_before.json").read_text())["pass_at_1"]

    ctx.phase = "training"
    stop = ctx.interrupts.begin_graceful()  # first Ctrl-C: finish the step, checkpoint, stop
    interrupted = False
    failures = FailureCounter()

    def health():
        if isinstance(controller.error, DatasetError):  # e.g. every prompt too long: a clear error
            raise controller.error
        if controller.error is not None:
            raise RuntimeError(f"rollout controller crashed: {controller.error!r}") from controller.error

    # the publish phase: the weights go to the engine, with what the proximal strategy needs
    publisher = publisher_for(trainer.proximal, engine, lambda: buffered_pending(buffer))
    publisher.start(trainer)
    controller.start()
    t_start = time.perf_counter()
    trainer_busy = 0.0
    eng0 = engine.stats()
    last_eng = eng0
    last_t = t_start
    total = cfg.trainer.total_steps
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(
        TextColumn("[bold]train[/] step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"), console=console, disable=not progress,
    )
    step_task = bar.add_task("train", total=total, completed=trainer.version, info="waiting for rollouts")
    error: BaseException | None = None
    bookkeeping_s: float | None = None
    prox_seconds: list[float] = []
    train_seconds: list[float] = []
    try:
        with bar:
            if trainer.in_critic_warmup:
                def clock(busy_s: float) -> dict[str, float]:
                    wall_s = max(time.perf_counter() - t_start, 1e-9)
                    return {"time/elapsed_s": wall_s, "busy/trainer": busy_s / wall_s,
                            "busy/engine": (engine.stats()["busy_seconds"] - eng0["busy_seconds"]) / wall_s}

                trainer_busy += _critic_warmup(trainer, cfg, buffer, B, controller, logger, run_dir, console,
                                               health, stop, clock)
            while trainer.version < total and not stop.is_set() and not trainer.in_critic_warmup:
                batch = wait_for_batch(buffer, B, lambda: trainer.version, health_fn=health, stop=stop)
                if batch is None:
                    break
                t0 = time.perf_counter()
                publisher.before_step(trainer)
                try:
                    metrics = trainer.train_step(batch)
                except NonFiniteLossError as e:  # the step still counts: log it, then stop
                    logger.log(trainer.version, e.metrics)
                    logger.trained(trainer.version, batch, not_trained=controller.take_not_trained())
                    logger.event("skipped_nonfinite", version=trainer.version)
                    raise
                if bookkeeping_s is not None:
                    metrics["time/bookkeeping_s"] = bookkeeping_s  # logging + checkpoint of the previous step
                t_sync = time.perf_counter()
                metrics.update(publisher.publish(trainer))
                metrics["time/proximal_s"] += metrics.get("time/partial_sync_s", 0.0)
                controller.set_version(trainer.version)
                metrics["time/weight_sync_s"] = time.perf_counter() - t_sync
                trainer_busy += time.perf_counter() - t0
                now = time.perf_counter()
                eng = engine.stats()
                wall = now - t_start
                lengths = [len(t.response_ids) for t in batch]
                metrics.update({
                    "rollout/accuracy": sum(bool(t.correct) for t in batch) / len(batch),
                    "rollout/format_rate": sum(bool(t.metadata.get("format_ok")) for t in batch) / len(batch),
                    # the answer check timed out / crashed: correctness unknown (counted as wrong above)
                    "rollout/correct_unknown_share": sum(t.correct is None for t in batch) / len(batch),
                    "rollout/reward_failed_share": sum(bool(t.metadata.get("reward_failed")) for t in batch) / len(batch),
                    "rollout/truncated_share": sum(t.finish_reason == "length" for t in batch) / len(batch),
                    "response/length_mean": sum(lengths) / len(lengths),
                    "response/length_max": float(max(lengths)),
                    "throughput/generated_tokens_per_s": (eng["generated_tokens"] - last_eng["generated_tokens"]) / max(1e-9, now - last_t),
                    "busy/trainer": trainer_busy / wall,
                    "busy/engine": (eng["busy_seconds"] - eng0["busy_seconds"]) / wall,
                    "time/step_wall_s": now - last_t,
                    "time/elapsed_s": wall,
                    "engine/pause_seconds_total": eng.get("pause_seconds_total", 0.0),
                    **controller.counters(),
                })
                last_eng, last_t = eng, now
                prox_seconds.append(metrics.get("time/proximal_s", 0.0))
                train_seconds.append(metrics.get("time/train_step_s", 0.0))
                logger.log(trainer.version, metrics)
                logger.trained(trainer.version, batch, not_trained=controller.take_not_trained())
                if metrics["train/skipped_nonfinite"]:
                    logger.event("skipped_nonfinite", version=trainer.version)
                for ev in trainer.events:
                    logger.event(ev.pop("event", "proximal"), **ev)
                trainer.events.clear()
                bar.update(step_task, completed=trainer.version, info=(
                    f"reward {metrics['reward/mean']:.2f}  acc {metrics['rollout/accuracy']:.2f}  "
                    f"stale {metrics['staleness/mean']:.1f}/{metrics['staleness/max']:.0f}  "
                    f"gen {metrics['throughput/generated_tokens_per_s']:.0f} tok/s  "
                    f"busy T {metrics['busy/trainer']:.2f} E {metrics['busy/engine']:.2f}"))
                if not progress and (trainer.version % 5 == 0 or trainer.version in (1, total)):
                    console.print(
                        f"step {trainer.version}/{total} reward {metrics['reward/mean']:.3f} acc {metrics['rollout/accuracy']:.3f} "
                        f"staleness {metrics['staleness/mean']:.2f} gen {metrics['throughput/generated_tokens_per_s']:.0f} tok/s "
                        f"busy trainer {metrics['busy/trainer']:.2f} engine {metrics['busy/engine']:.2f} ({wall:.0f} s)")
                report_failures(failures, controller, console)
                fault_point("step_end")  # chaos suite: a kill between steps
                if heldout and cfg.run.eval_every and trainer.version % cfg.run.eval_every == 0 and trainer.version < total:
                    # a held-out curve point (before the checkpoint: a kill here redoes the step and this)
                    res = _heldout_eval(engine, tokenizer, cfg, heldout, f"step_{trainer.version}", logger, run_dir,
                                        False, reward_service)
                    logger.scalars(trainer.version, {"heldout/pass_at_1": res.pass_at_1,
                                                     "heldout/format_rate": res.format_rate})
                    console.print(f"  held-out pass@1 at version {trainer.version}: {res.pass_at_1:.3f} "
                                  f"({res.wall_seconds:.0f} s)")
                # the checkpoint of the last step is the final one (run.final_checkpoint), below
                if trainer.version % cfg.run.checkpoint_every == 0 and trainer.version < total:
                    p = save_checkpoint(run_dir, trainer, controller, keep=cfg.run.keep_checkpoints)
                    logger.event("checkpoint", path=str(p), version=trainer.version)
                bookkeeping_s = time.perf_counter() - now
    except BaseException as e:  # still write a checkpoint: nothing already computed is lost
        error = e
    finally:
        wall = time.perf_counter() - t_start
        eng_end = engine.stats()  # read with `wall`: busy seconds and wall-clock cover one window
        interrupted = ctx.interrupts.requested
        controller.stop()
        publisher.stop()
        ctx.phase = "the final checkpoint"
        final_checkpoint(run_dir, trainer, controller, logger, cfg, error, interrupted)
        ctx.interrupts.end_graceful()  # from here a Ctrl-C stops at once
    ctx.phase = "the evaluation, export and summary after training"
    eng = engine.stats()
    # <= 1 by definition: the engine adds a forward pass's seconds when it ends, so one that began
    # before t_start counts whole; in a short segment (a resume with nothing left to train) that
    # alone gave 1.09-1.35
    engine_busy = min(1.0, (eng_end["busy_seconds"] - eng0["busy_seconds"]) / max(wall, 1e-9))
    try:  # the engine's counters and decode profile: `conveyor simulate RUN_DIR` calibrates from them
        atomic_write_json(run_dir / "engine_stats.json", eng, indent=1)
    except OSError:
        log.exception("could not write engine_stats.json")
    if error is not None:
        engine.stop()
        reward_service.close()
        if not isinstance(error, StopNow):  # (a second Ctrl-C is reported by run_training)
            logger.event("error", error=repr(error), version=trainer.version)
        raise error  # the logs are closed by ctx
    if heldout and cfg.run.eval_after and not interrupted:
        console.print(f"held-out evaluation after training (version {engine.version}, greedy)")
        res = _heldout_eval(engine, tokenizer, cfg, heldout, "after", logger, run_dir, progress, reward_service)
        after = res.pass_at_1
        console.print(f"  pass@1 after: [bold]{after:.3f}[/]  format rate {res.format_rate:.3f}")
    engine.stop()
    reward_service.close()
    if cfg.run.export and trainer.version > 0:
        export_dir = run_dir / "export"
        export_policy(policy, tokenizer, export_dir, cfg.run.export_dtype)  # float32 | bfloat16
        # tool, instruction, data set and eval settings: `conveyor eval --model RUN/export`
        # reproduces the held-out figure by default (issue 10, section 5b)
        from conveyor.eval import write_export_settings

        write_export_settings(export_dir, cfg, policy_version=trainer.version, heldout_pass_at_1=after)
        logger.event("export", path=str(export_dir), version=trainer.version)
    seg = segment_summary(run_dir, {  # wall-clock over every process segment of the run
        "segment": logger.segment, "wall_seconds": wall, "trainer_busy_seconds": trainer_busy,
        "engine_busy_seconds": engine_busy * wall, "start_version": ctx.start_version,
        "end_version": trainer.version})
    summary = {
        "run_dir": str(run_dir), "steps": trainer.version, "heldout_before": before, "heldout_after": after,
        "wall_seconds": seg["wall_seconds"], "interrupted": interrupted,
        "trainer_busy": seg["trainer_busy"], "engine_busy": seg["engine_busy"],
        "segments": seg["segments"], "eta": eta, "controller": controller.counters(),
        # the cost ledger of the proximal strategy (MISSION.md section 2)
        "proximal": {
            "method": trainer.proximal.name if trainer.objective.needs_proximal else "none",
            "requested": cfg.proximal.method,
            "note": trainer.proximal_note if trainer.objective.needs_proximal else f"loss.name={cfg.loss.name} uses no proximal policy",
            "extra_bytes": trainer.proximal.extra_bytes() if trainer.objective.needs_proximal else 0,
            "mean_proximal_s": sum(prox_seconds) / len(prox_seconds) if prox_seconds else 0.0,
            "mean_train_step_s": sum(train_seconds) / len(train_seconds) if train_seconds else 0.0,
        },
    }
    atomic_write_json(run_dir / "summary.json", summary)
    st = controller.stats
    if st.trajectories_accepted and st.reward_failures > 0.5 * st.trajectories_accepted:
        console.print(f"[bold yellow]warning:[/] {st.reward_failures} of {st.trajectories_accepted} rewards failed "
                      f"(reward.fn={cfg.reward.fn}); see {run_dir / 'train.log'}")
    try:
        plot_report(run_dir, title=f"{cfg.model.name} on {cfg.data.train}, eta={eta}")
    except Exception:
        log.exception("report plot failed")
    return TrainResult(run_dir, trainer.version, before, after, summary["wall_seconds"],
                       interrupted, summary["trainer_busy"], summary["engine_busy"])


def load_run_config(run_dir: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """The saved ``config.json`` of a run, with ``overrides`` applied (e.g. a larger
    ``trainer.total_steps`` to continue a finished run)."""
    p = Path(run_dir) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{run_dir} is not a conveyor run directory (no config.json)")
    return load_config(p, overrides)
