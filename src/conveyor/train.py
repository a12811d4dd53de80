"""The inline runtime and the main job: asynchronous RL training in one process.

Threads: the engine's decode loop (:class:`~conveyor.rollout.engine.InferenceEngine`), the rollout
controller's asyncio loop (:class:`~conveyor.rollout.controller.RolloutController`), and the
trainer in the calling thread. Generation and training overlap; the staleness bound eta
(MISSION.md section 1) limits how far rollouts run ahead; eta = 0 is synchronous training through
the same code path. Components share no mutable objects: the engine has its own copy of the
weights and receives :class:`~conveyor.sync.WeightUpdate` messages.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from conveyor.config import TrainConfig, load_config
from conveyor.data import load_dataset
from conveyor.eval import evaluate
from conveyor.models import load_model
from conveyor.rewards import RewardService, load_reward_fn
from conveyor.rollout.buffer import TrajectoryBuffer
from conveyor.rollout.controller import DataStream, RolloutController, wait_for_batch
from conveyor.rollout.engine import InferenceEngine, SamplingParams
from conveyor.rollout.staleness import StalenessManager
from conveyor.rollout.workflow import EnvLatencyWorkflow, SingleTurnMathWorkflow
from conveyor.runlog import MetricsLogger, plot_report
from conveyor.trainer.proximal import score_partials
from conveyor.trainer.trainer import Trainer

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"


@dataclass
class TrainResult:
    """What a finished (or interrupted) run reports.

    Attributes:
        run_dir: The run directory. steps: policy version reached.
        heldout_before / heldout_after: greedy held-out pass@1 (None when not evaluated).
        wall_seconds: Training-loop wall-clock (s). interrupted: stopped by Ctrl-C / SIGTERM.
        trainer_busy / engine_busy: Busy fractions of the training-loop wall-clock.
    """

    run_dir: Path
    steps: int
    heldout_before: float | None
    heldout_after: float | None
    wall_seconds: float
    interrupted: bool
    trainer_busy: float
    engine_busy: float


# ---------------------------------------------------------------------- checkpoints
def _latest_checkpoint(run_dir: Path) -> Path | None:
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return None
    cands = sorted((p for p in root.iterdir() if p.name.startswith("step_") and (p / "DONE").is_file()),
                   key=lambda p: int(p.name.split("_")[1]))
    return cands[-1] if cands else None


def save_checkpoint(run_dir: Path, trainer: Trainer, controller: RolloutController, keep: int = 1) -> Path:
    """Write ``checkpoints/step_<version>`` atomically (temporary directory, then rename, then a
    ``DONE`` marker) with the policy, optimizer, scheduler, version, data cursor, buffered
    trajectories, controller / staleness counters and RNG states; keep the newest ``keep``."""
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{trainer.version}"
    if (final / "DONE").is_file():
        return final
    tmp = root / f".tmp_step_{trainer.version}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(trainer.state_dict(), tmp / "trainer.pt")
    torch.save({
        "controller": controller.snapshot(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "version": trainer.version,
    }, tmp / "state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    (final / "DONE").write_text(str(trainer.version))
    done = sorted((p for p in root.iterdir() if p.name.startswith("step_")), key=lambda p: int(p.name.split("_")[1]))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


class _TrajView:
    """A buffered trajectory seen as a partial request by :func:`score_partials`: the shared
    ``metadata["old_logprobs"]`` list is extended in place."""

    def __init__(self, t):
        self.prompt_ids, self.token_ids, self.versions = t.prompt_ids, t.response_ids, t.versions
        self.old_logprobs = t.metadata.setdefault("old_logprobs", [])


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
    p.mkdir(parents=True, exist_ok=True)
    return p


# keys a resumed run must keep (the checkpoint was made with them)
_FIXED_ON_RESUME = (("model", "name"), ("run", "dir"), ("rollout", "group_size"), ("trainer", "batch_size"))


def _check_resume_compatible(run_dir: Path, cfg: TrainConfig) -> None:
    saved = load_config(run_dir / "config.json")
    for section, key in _FIXED_ON_RESUME:
        old, new = getattr(getattr(saved, section), key), getattr(getattr(cfg, section), key)
        if old != new:
            raise ValueError(f"--resume {run_dir}: {section}.{key} cannot change on resume (checkpoint has {old!r}, got {new!r})")


def _heldout_eval(engine, tokenizer, cfg: TrainConfig, samples, label: str, logger: MetricsLogger, run_dir: Path, progress: bool):
    res = evaluate(
        engine, tokenizer, samples, k=1, temperature=0.0, max_new_tokens=cfg.run.eval_max_new_tokens,
        instruction=cfg.data.instruction, dataset=cfg.data.heldout, model_name=cfg.model.name, progress=progress,
        tool=cfg.rollout.tool, max_tool_calls=cfg.rollout.max_tool_calls,
    )
    res.write_json(run_dir / f"eval_{label}.json")
    logger.event("eval", label=label, version=engine.version, **{k: v for k, v in res.summary().items() if not isinstance(v, dict)})
    return res


def run_training(cfg: TrainConfig, *, resume_dir: str | Path | None = None, console=None) -> TrainResult:
    """Run (or resume) an asynchronous RL training job; see the module docstring.

    Args:
        cfg: The resolved configuration (ignored except for overrides when resuming: the run's
            saved config is loaded and the given overrides already merged by the caller).
        resume_dir: A run directory with checkpoints to continue from, exactly: same version
            numbers, data cursor and buffered trajectories; no trajectory is trained twice.
        console: Optional ``rich.console.Console`` for the progress display.

    Returns:
        A :class:`TrainResult`.

    Raises:
        FileExistsError / FileNotFoundError: run directory conflicts.
        conveyor.trainer.trainer.NonFiniteLossError: too many non-finite steps in a row (a
            checkpoint is written first).
    """
    from rich.console import Console

    console = console or Console()
    ckpt = None
    if resume_dir is not None:
        run_dir = Path(resume_dir)
        ckpt = _latest_checkpoint(run_dir)
        if ckpt is None:
            raise FileNotFoundError(f"--resume {run_dir}: no finished checkpoint under {run_dir / CHECKPOINTS}")
        _check_resume_compatible(run_dir, cfg)

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
    trainer = Trainer(policy, cfg.trainer, cfg.loss, temperature=cfg.rollout.temperature, proximal_cfg=cfg.proximal,
                      eta=cfg.asynchronous.eta, max_new_tokens=cfg.rollout.max_new_tokens)
    state = None
    if ckpt is not None:
        trainer.load_state_dict(torch.load(ckpt / "trainer.pt", weights_only=False))
        state = torch.load(ckpt / "state.pt", weights_only=False)
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if trainer.version >= cfg.trainer.total_steps:
            console.print(f"{run_dir} is already at version {trainer.version} >= trainer.total_steps="
                          f"{cfg.trainer.total_steps}; to train longer: conveyor train --resume {run_dir} "
                          f"trainer.total_steps=N")
    else:
        run_dir = _make_run_dir(cfg)

    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    logger = MetricsLogger(run_dir)
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("conveyor").addHandler(handler)
    logging.getLogger("conveyor").setLevel(logging.INFO)
    logger.event("proximal", method=trainer.proximal.name, requested=cfg.proximal.method, note=trainer.proximal_note,
                 extra_bytes=trainer.proximal.extra_bytes())
    if ckpt is not None:
        logger.event("resume", checkpoint=str(ckpt), version=trainer.version)
        console.print(f"[bold]resumed[/] {run_dir} at version {trainer.version} from {ckpt.name}")

    engine_model = copy.deepcopy(policy).eval()
    for p in engine_model.parameters():
        p.requires_grad_(False)
    partial_sync = trainer.proximal.name == "partial_sync"
    dedicated = trainer.proximal if trainer.proximal.name == "dedicated" else None
    engine = InferenceEngine(engine_model, tokenizer, version=trainer.version, max_batch_size=cfg.rollout.max_batch_size,
                             seed=cfg.run.seed + trainer.version, num_threads=engine_threads,
                             track_partials=partial_sync or dedicated is not None,
                             reencode_on_update=cfg.rollout.reencode_on_update)
    engine.start()
    reward_service = RewardService(reward_fn, timeout_s=cfg.reward.timeout_s,
                                   failure_score=cfg.reward.failure_score, max_workers=cfg.reward.workers)
    G = cfg.rollout.group_size
    B = cfg.trainer.batch_size * G  # trajectories per update
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
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
    )
    if state is not None:
        controller.restore(state["controller"], trainer.version)

    progress = cfg.run.progress and console.is_terminal
    before = after = None
    if heldout and cfg.run.eval_before and ckpt is None:
        console.print(f"held-out evaluation before training ({len(heldout)} problems of {cfg.data.heldout}, greedy)")
        res = _heldout_eval(engine, tokenizer, cfg, heldout, "before", logger, run_dir, progress)
        before = res.pass_at_1
        console.print(f"  pass@1 before: [bold]{before:.3f}[/]  format rate {res.format_rate:.3f}  ({res.wall_seconds:.0f} s)")
    elif ckpt is not None and (run_dir / "eval_before.json").is_file():
        before = json.loads((run_dir / "eval_before.json").read_text())["pass_at_1"]

    stop = threading.Event()
    interrupted = False

    def _on_signal(signum, frame):
        nonlocal interrupted
        interrupted = True
        stop.set()
        console.print("[yellow]stopping: finishing the current step and writing a checkpoint...[/]")

    old_handlers = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            old_handlers[s] = signal.signal(s, _on_signal)

    def health():
        if controller.error is not None:
            raise RuntimeError(f"rollout controller crashed: {controller.error!r}") from controller.error

    if dedicated is not None:
        dedicated.start(trainer)
    if partial_sync or dedicated is not None:
        engine.partial_requests(require_pause=False)  # forget the held-out evaluation's requests
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
            while trainer.version < total and not stop.is_set():
                batch = wait_for_batch(buffer, B, lambda: trainer.version, health_fn=health, stop=stop)
                if batch is None:
                    break
                t0 = time.perf_counter()
                if dedicated is not None:  # every version below the trainer's must be scored
                    dedicated.wait_retired(trainer.version)
                metrics = trainer.train_step(batch)
                if bookkeeping_s is not None:
                    metrics["time/bookkeeping_s"] = bookkeeping_s  # logging + checkpoint of the previous step
                t_sync = time.perf_counter()
                if partial_sync:
                    # MISSION.md section 2, recovery 3: pause, score every token of the outgoing
                    # version with the engine's (outgoing) parameters, update, resume
                    engine.pause()
                    try:
                        pending = engine.partial_requests() + [_TrajView(t) for g in buffer.snapshot() for t in g]
                        metrics["proximal/partial_sync_tokens"] = float(score_partials(trainer, engine.model, pending, engine.version))
                        metrics["time/partial_sync_s"] = time.perf_counter() - t_sync
                        metrics["time/proximal_s"] += metrics["time/partial_sync_s"]
                        engine.update_weights(trainer.weight_update())
                    finally:
                        engine.resume()
                else:
                    upd = trainer.weight_update()
                    engine.update_weights(upd)
                    if dedicated is not None:  # the engine no longer samples the outgoing version
                        dedicated.retire(engine.partial_requests(require_pause=False)
                                         + [_TrajView(t) for g in buffer.snapshot() for t in g], upd)
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
                logger.trained(trainer.version, batch)
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
                if not progress and (trainer.version % 5 == 0 or trainer.version == 1):
                    console.print(
                        f"step {trainer.version}/{total} reward {metrics['reward/mean']:.3f} acc {metrics['rollout/accuracy']:.3f} "
                        f"staleness {metrics['staleness/mean']:.2f} gen {metrics['throughput/generated_tokens_per_s']:.0f} tok/s "
                        f"busy trainer {metrics['busy/trainer']:.2f} engine {metrics['busy/engine']:.2f} ({wall:.0f} s)")
                if trainer.version % cfg.run.checkpoint_every == 0:
                    p = save_checkpoint(run_dir, trainer, controller, keep=cfg.run.keep_checkpoints)
                    logger.event("checkpoint", path=str(p), version=trainer.version)
                bookkeeping_s = time.perf_counter() - now
    except BaseException as e:  # still write a checkpoint: nothing already computed is lost
        error = e
    finally:
        wall = time.perf_counter() - t_start
        controller.stop()
        if dedicated is not None:
            dedicated.stop()
        if trainer.version > 0 and not isinstance(error, KeyboardInterrupt | SystemExit) or interrupted:
            try:
                p = save_checkpoint(run_dir, trainer, controller, keep=cfg.run.keep_checkpoints)
                logger.event("checkpoint", path=str(p), version=trainer.version, final=True)
            except Exception:
                log.exception("final checkpoint failed")
        for s, h in old_handlers.items():
            signal.signal(s, h)
    eng = engine.stats()
    engine_busy = (eng["busy_seconds"] - eng0["busy_seconds"]) / max(wall, 1e-9)
    try:  # the engine's counters and decode profile: `conveyor simulate RUN_DIR` calibrates from them
        (run_dir / "engine_stats.json").write_text(json.dumps(eng, indent=1, default=str))
    except OSError:
        log.exception("could not write engine_stats.json")
    if error is not None:
        engine.stop()
        reward_service.close()
        logger.event("error", error=repr(error), version=trainer.version)
        logger.close()
        raise error
    if heldout and cfg.run.eval_after and not interrupted:
        console.print(f"held-out evaluation after training (version {engine.version}, greedy)")
        res = _heldout_eval(engine, tokenizer, cfg, heldout, "after", logger, run_dir, progress)
        after = res.pass_at_1
        console.print(f"  pass@1 after: [bold]{after:.3f}[/]  format rate {res.format_rate:.3f}")
    engine.stop()
    reward_service.close()
    if cfg.run.export and trainer.version > 0:
        export_dir = run_dir / "export"
        policy.save_pretrained(str(export_dir))
        tokenizer.save_pretrained(str(export_dir))
        logger.event("export", path=str(export_dir), version=trainer.version)
    summary = {
        "run_dir": str(run_dir), "steps": trainer.version, "heldout_before": before, "heldout_after": after,
        "wall_seconds": wall, "interrupted": interrupted, "trainer_busy": trainer_busy / max(wall, 1e-9),
        "engine_busy": engine_busy, "eta": eta, "controller": controller.counters(),
        # the cost ledger of the proximal strategy (MISSION.md section 2)
        "proximal": {
            "method": trainer.proximal.name, "requested": cfg.proximal.method, "note": trainer.proximal_note,
            "extra_bytes": trainer.proximal.extra_bytes(),
            "mean_proximal_s": sum(prox_seconds) / len(prox_seconds) if prox_seconds else 0.0,
            "mean_train_step_s": sum(train_seconds) / len(train_seconds) if train_seconds else 0.0,
        },
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    st = controller.stats
    if st.trajectories_accepted and st.reward_failures > 0.5 * st.trajectories_accepted:
        console.print(f"[bold yellow]warning:[/] {st.reward_failures} of {st.trajectories_accepted} rewards failed "
                      f"(reward.fn={cfg.reward.fn}); see {run_dir / 'train.log'}")
    try:
        plot_report(run_dir, title=f"{cfg.model.name} on {cfg.data.train}, eta={eta}")
    except Exception:
        log.exception("report plot failed")
    logger.close()
    logging.getLogger("conveyor").removeHandler(handler)
    return TrainResult(run_dir, trainer.version, before, after, wall, interrupted, summary["trainer_busy"], engine_busy)


def load_run_config(run_dir: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """The saved ``config.json`` of a run, with ``overrides`` applied (e.g. a larger
    ``trainer.total_steps`` to continue a finished run)."""
    p = Path(run_dir) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{run_dir} is not a conveyor run directory (no config.json)")
    return load_config(p, overrides)
