"""The inline runtime: every component in one process (issue 12, section 1).

Threads: the engine's decode loop (:class:`~conveyor.rollout.engine.InferenceEngine`), the rollout
controller's asyncio loop (:class:`~conveyor.rollout.controller.RolloutController`), reward worker
processes (:class:`~conveyor.rewards.RewardService`), and the trainer in the calling thread.
Components share no mutable objects: the engine has its own copy of the weights and receives
:class:`~conveyor.sync.WeightUpdate` messages through the publisher.

- :func:`build_rollout`: the engine, rewards, workflow, staleness rule, buffer, controller and
  publisher for a trainer (a :class:`RolloutSide`; the Ray runtime builds the same bundle over
  actor handles: :func:`conveyor.runtime.ray.build_ray_rollout`).
- :func:`train_loop`: the critic warm-up, then :func:`~conveyor.runtime.step.run_step` until
  ``trainer.total_steps``, recording each step, evaluating every ``run.eval_every`` versions
  and checkpointing every ``run.checkpoint_every``; the final checkpoint however it ends.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conveyor.checkpoint import save_checkpoint
from conveyor.config import TrainConfig, resolve_reference_scoring
from conveyor.data import DatasetError
from conveyor.eval import evaluate, reward_note, run_grader_kwargs, unknown_note
from conveyor.faults import fault_point
from conveyor.rewards import RewardService
from conveyor.rewards.guard import FailedRewardSteps
from conveyor.rewards.styles import service_metrics
from conveyor.rollout.adaptive import AsyncRatioController
from conveyor.rollout.buffer import TrajectoryBuffer
from conveyor.rollout.controller import DataStream, EpisodesFailedError, RolloutController
from conveyor.rollout.engine import InferenceEngine, SamplingParams
from conveyor.rollout.engine.router import EngineRouter, engine_seed
from conveyor.rollout.staleness import StalenessManager
from conveyor.rollout.style_schedule import (
    stamp_target_style,
    style_at_version,
    with_style_schedule,
)
from conveyor.rollout.workflow import EnvLatencyWorkflow, SingleTurnMathWorkflow
from conveyor.rundir import RunContext, final_checkpoint
from conveyor.runlog import MetricsLogger
from conveyor.runtime.elastic import TrainerThreadBorrowing
from conveyor.runtime.monitor import MonitorSettings, RunMonitor
from conveyor.runtime.publish import Publisher, publisher_for, tracks_partials
from conveyor.runtime.record import RunClock, StepRecorder, batch_metrics
from conveyor.runtime.steering import RunSteering
from conveyor.runtime.step import LocalRollout, run_step
from conveyor.trainer.reference import ReferenceScorer
from conveyor.trainer.trainer import NonFiniteLossError, Trainer

log = logging.getLogger(__name__)

__all__ = ["InlineRollout", "LoopResult", "RolloutSide", "build_rollout", "critic_warmup", "heldout_eval", "eval_policy", "resolve_engine_dtype",
           "train_loop"]


def eval_policy(cfg: TrainConfig, trainer: Trainer) -> torch.nn.Module | None:
    """The model held-out evaluations run instead of the rollout engine: the trainer's policy
    when ``run.eval_dtype=float32`` and the engine runs another dtype (``rollout.engine_dtype``
    resolved, :func:`resolve_engine_dtype`); None: evaluate with the engine. Greedy decoding
    follows the weights' precision: on the main job the initial SmolLM2 scored 0.173 with a
    bf16 engine against 0.218 in float32 (docs/results/main_job.md), so comparisons across
    engine dtypes need one evaluation precision."""
    if cfg.run.eval_dtype == "float32" and _engine_dtype(cfg, trainer.bf16) != "float32":
        return trainer.inference_policy()  # with LoRA: a merged plain copy
    return None


def heldout_eval(engine, tokenizer, cfg: TrainConfig, samples, label: str, logger: MetricsLogger,
                 run_dir: Path, progress: bool, reward_service: RewardService | None = None, *,
                 evaluate_fn: Callable = evaluate, version: int = 0, policy: torch.nn.Module | None = None):
    """Pass@1 of the engine's current weights on ``samples`` (greedy, or ``run.eval_samples``
    responses per problem at ``run.eval_temperature``); written atomically to
    ``RUN/eval_<label>.json`` with ``policy_version`` = ``version`` (the policy it measured) and
    logged as an ``eval`` event at the latest log step. With an
    environment (``env.name`` not ``none``) the samples are the environment's episodes
    (:func:`conveyor.eval.evaluate` with ``env=cfg.env``).

    The preference-shift task (``data.style_schedule`` set): every held-out prompt is stamped
    with the target style in force at ``version``, so pass@1 is the held-out share judged in that
    style; the share judged in each style is in the ``eval`` event (``metric_style_<name>``) and
    the TensorBoard / W&B curves ``heldout/style_<name>_rate``.

    Args:
        evaluate_fn: Runs the evaluation, with :func:`conveyor.eval.evaluate`'s signature (the
            default; :attr:`RolloutSide.evaluate` of the runtime, e.g. the Ray runtime's runs it
            inside the rollout actor).
        version: The policy version evaluated: recorded as the result's ``policy_version`` (in
            the file and the event), and the target style of the preference-shift task.
        policy: Evaluate this model (a float32 copy, in a temporary in-process engine of its
            own, stopped afterwards) instead of ``engine`` (:func:`eval_policy`); answers are
            checked in ``reward_service`` when it is an in-process one, else in workers of the
            evaluation's own.

    Returns:
        The :class:`~conveyor.eval.EvalResult`.
    """
    env = {"env": cfg.env} if cfg.env.name != "none" else {}  # the run's environment's episodes
    if cfg.data.style_schedule:  # judged against the target in force at this version
        style = style_at_version(cfg.data.style_schedule, cfg.data.style_every, max(0, version))
        samples = [stamp_target_style(s, style, version) for s in samples]
    kwargs = dict(k=1, samples_per_problem=cfg.run.eval_samples, temperature=cfg.run.eval_temperature,
                  max_new_tokens=cfg.run.eval_max_new_tokens,
                  instruction=cfg.data.instruction, dataset=cfg.data.heldout, model_name=cfg.model.name,
                  progress=progress, tool=cfg.rollout.tool, max_tool_calls=cfg.rollout.max_tool_calls, **env,
                  **run_grader_kwargs(cfg))  # a user's reward.fn grades the held-out figure (issue 44)
    if policy is None:  # answer checks in the run's reward workers (metrics only)
        res = evaluate_fn(engine, tokenizer, samples, reward_service=reward_service, **kwargs)
    else:
        model = copy.deepcopy(policy).float().eval()
        for p in model.parameters():
            p.requires_grad_(False)
        eval_engine = InferenceEngine(model, tokenizer, version=version, max_batch_size=cfg.rollout.max_batch_size,
                                      seed=cfg.run.seed, dtype=torch.float32,
                                      prefix_cache_tokens=cfg.rollout.prefix_cache_tokens)
        eval_engine.start()
        try:
            local = reward_service if hasattr(reward_service, "metric_names") else None  # not a Ray proxy
            res = evaluate(eval_engine, tokenizer, samples, reward_service=local, **kwargs)
        finally:
            eval_engine.stop()
            del model, eval_engine
    res.policy_version = version  # which policy the file measured (conveyor inspect compares it)
    res.write_json(run_dir / f"eval_{label}.json")  # atomic: never a half-written file
    # version: the latest log step (the policy version; k - W during a critic warm-up of W steps)
    logger.event("eval", label=label, **{k: v for k, v in res.summary().items() if not isinstance(v, dict)},
                 **{f"metric_{k}": v for k, v in res.metrics_mean.items()})  # e.g. metric_style_cute
    if res.episodes_failed:  # the agent / environment raised: counted as wrong, the first error recorded
        first = next((r["error"] for r in res.records if "error" in r), "")
        logger.event("warning", message=f"held-out evaluation {label}: {res.episodes_failed} of "
                     f"{res.num_problems * res.samples_per_problem} episodes failed (counted as wrong); "
                     f"the first: {first}")
    styles = {f"heldout/{k}_rate": v for k, v in res.metrics_mean.items() if k.startswith("style_")}
    if styles:  # TensorBoard / W&B curves
        logger.scalars(max(0, version), styles)
    return res


@dataclass
class RolloutSide:
    """The rollout side of a run as the training loop sees it, and the publisher that feeds it
    weights; the same bundle for every runtime (:func:`build_rollout`: in-process objects;
    :func:`conveyor.runtime.ray.build_ray_rollout`: proxies of a Ray actor).

    Attributes:
        engine: The :class:`~conveyor.rollout.engine.Engine` (inline: the local engine, its own
            deep copy of the policy, no gradients).
        reward_service: Reward worker processes (``close()``).
        buffer: The trajectory buffer (None when it lives in another process).
        controller: The rollout controller, or what the loop uses of it (``start``, ``stop``,
            ``error``, ``stats``, ``counters``, ``take_not_trained``, ``set_warmup_batches``,
            ``snapshot`` for checkpoints).
        rollout: The :class:`~conveyor.runtime.step.RolloutPort`.
        publisher: The proximal strategy's publisher (:func:`~conveyor.runtime.publish.publisher_for`).
        batch_size: Trajectories per update (``trainer.batch_size x rollout.group_size``).
        evaluate: Runs a held-out evaluation (:func:`conveyor.eval.evaluate`'s signature), for
            :func:`heldout_eval`.
        trainer_threads: ``trainer.elastic_threads``: the
            :class:`~conveyor.runtime.elastic.TrainerThreadBorrowing` whose ``update`` span the
            training loop runs each update in; None otherwise.
    """

    engine: InferenceEngine
    reward_service: RewardService
    buffer: TrajectoryBuffer | None
    controller: RolloutController
    rollout: LocalRollout
    publisher: Publisher
    batch_size: int
    evaluate: Callable = evaluate
    trainer_threads: TrainerThreadBorrowing | None = None


InlineRollout = RolloutSide  # the name before the Ray runtime (kept for callers)


def build_workflow(cfg: TrainConfig, tokenizer, reward_service: RewardService, *, version: int):
    """The main job's workflow from ``cfg`` (``rollout.*``, ``data.instruction``,
    ``reward.overlong*``, ``env.*``): :class:`~conveyor.rollout.workflow.SingleTurnMathWorkflow`
    when ``env.name=none``, else an :class:`~conveyor.rollout.agent.AgentWorkflow` over the
    environment, or for ``env.name=openai:package.module:fn`` an
    :class:`~conveyor.rollout.openai_agent.OpenAIAgentWorkflow` (which has ``close``)
    (:func:`conveyor.envs.registry.build_env_workflow`; ``rollout.group_size`` episodes
    per sample, each turn at most ``rollout.max_new_tokens`` tokens, ``env.max_turns`` turns and
    ``env.max_episode_tokens`` response tokens per episode); either wrapped in
    :class:`~conveyor.rollout.workflow.EnvLatencyWorkflow` when ``rollout.env_latency.median_s >
    0`` (its seed offset by ``version`` so a resumed run draws new latencies). The same for every
    runtime (inline, the Ray rollout actor).

    Raises:
        ValueError: an environment that cannot be built (e.g. ``env.options`` it does not take).
    """
    r = cfg.rollout
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                            top_k=r.top_k, min_p=r.min_p)
    if cfg.env.name != "none":
        from conveyor.envs.registry import build_env_workflow

        # an AgentWorkflow over the environment, or the OpenAI-client agent's workflow (openai:...)
        workflow = build_env_workflow(cfg.env, tokenizer=tokenizer, reward_service=reward_service, params=params,
                                      group_size=r.group_size, instruction=cfg.data.instruction or "")
    else:
        workflow = SingleTurnMathWorkflow(tokenizer, reward_service, params, group_size=r.group_size,
                                          instruction=cfg.data.instruction, tool=r.tool,
                                          max_tool_calls=r.max_tool_calls, overlong=cfg.reward.overlong,
                                          overlong_buffer=cfg.reward.overlong_buffer,
                                          overlong_penalty=cfg.reward.overlong_penalty)
    lat = r.env_latency
    if lat.median_s > 0:
        workflow = EnvLatencyWorkflow(workflow, median_s=lat.median_s, sigma=lat.sigma, max_s=lat.max_s,
                                      seed=lat.seed + version)
    return workflow


def _engine_dtype(cfg: TrainConfig, trainer_bf16: bool) -> str:
    """``rollout.engine_dtype`` with ``auto`` resolved (no logging)."""
    if cfg.rollout.engine_dtype != "auto":
        return cfg.rollout.engine_dtype
    return "bfloat16" if trainer_bf16 else "float32"


def resolve_engine_dtype(cfg: TrainConfig, trainer_bf16: bool) -> TrainConfig:
    """``cfg`` with ``rollout.engine_dtype=auto`` resolved (a copy; other values: ``cfg`` itself):
    ``bfloat16`` when the trainer runs bf16 autocast (``trainer_bf16``, ``trainer.bf16`` after
    its ``auto`` choice), so the engine samples at the precision the trainer scores at
    (docs/results/main_job.md section 3), else ``float32``. The engine (in process or in a Ray
    actor) is built from the resolved value."""
    if cfg.rollout.engine_dtype != "auto":
        return cfg
    dtype = _engine_dtype(cfg, trainer_bf16)
    log.info("rollout.engine_dtype=auto: %s (trainer bf16 autocast %s)", dtype, "on" if trainer_bf16 else "off")
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine_dtype": dtype})})


def engine_device(cfg: TrainConfig) -> torch.device:
    """``rollout.engine_device`` in this process (:func:`conveyor.devices.resolve`, role
    ``engine``: with ``auto``, a GPU of its own when the process sees two or more, else the one GPU,
    else the CPU).

    Raises:
        ConfigError: a device this process does not have (the message names the key).
    """
    from conveyor.config import ConfigError
    from conveyor.devices import resolve

    try:
        return resolve(cfg.rollout.engine_device, "rollout.engine_device", role="engine")
    except ValueError as e:
        raise ConfigError(str(e)) from e


def make_engine(cfg: TrainConfig, model, tokenizer, *, version: int, seed_index: int, engine_threads: int,
                track_partials: bool, lora_base: dict | None = None) -> InferenceEngine:
    """The run's :class:`~conveyor.rollout.engine.InferenceEngine` over ``model`` (not started),
    set from ``rollout.*`` (decode batch, re-encoding, ``engine_dtype`` resolved, prefix cache,
    the device: :func:`engine_device`).

    Args:
        model: The engine's own copy of the policy (eval mode, no gradients).
        version: Policy version of its weights.
        seed_index: Index of its sampling seed (:func:`~conveyor.rollout.engine.router.engine_seed`).
        engine_threads: Intra-op threads of its decode thread.
        track_partials: Keep request tokens for old-log-prob scoring (partial_sync / dedicated).
        lora_base: Base weights the LoRA adapters it receives are merged onto, or None.
    """
    return InferenceEngine(model, tokenizer, version=version, max_batch_size=cfg.rollout.max_batch_size,
                           seed=engine_seed(cfg.run.seed, version, seed_index), num_threads=engine_threads,
                           track_partials=track_partials, reencode_on_update=cfg.rollout.reencode_on_update,
                           dtype=getattr(torch, cfg.rollout.engine_dtype),
                           prefix_cache_tokens=cfg.rollout.prefix_cache_tokens, lora_base=lora_base,
                           device=engine_device(cfg))


def make_remote_engine(cfg: TrainConfig, tokenizer, *, version: int, index: int, run_dir: Path | None):
    """Engine ``index`` of ``rollout.engine=vllm`` / ``sglang``, not started: a
    :class:`~conveyor.rollout.engine.vllm.VllmEngine` that owns a
    :class:`~conveyor.rollout.engine.vllm.VllmServer` on ``model.name``'s safetensors directory
    (``rollout.vllm.url`` null; its log ``RUN/vllm_server<index>.log``, its weight files under
    ``RUN/vllm_weights/<index>``), or one on ``rollout.vllm.url``; an
    :class:`~conveyor.rollout.engine.remote.HttpEngine` on ``rollout.sglang.url``.

    Args:
        version: Policy version the server's weights are labelled with.
        index: The engine's index (its seed: :func:`~conveyor.rollout.engine.router.engine_seed`).
        run_dir: The run directory (None: temporary files).
    """
    from conveyor.models import resolve_model_dir
    from conveyor.rollout.engine.remote import HttpEngine
    from conveyor.rollout.engine.vllm import VllmEngine, VllmServer

    r = cfg.rollout
    weight_dir = run_dir / f"{r.engine}_weights" / str(index) if run_dir is not None else None
    if r.engine == "sglang":
        return HttpEngine(r.sglang.url, api_key=r.sglang.api_key, weight_dir=weight_dir, initial_version=version)
    v = r.vllm
    server = None
    if v.url is None:
        server = VllmServer(
            model=str(resolve_model_dir(cfg.model.name)), python=v.python, port=v.port if index == 0 else 0,
            dtype=_engine_dtype(cfg, False), kv_cache_gb=v.kv_cache_gb, max_model_len=v.max_model_len,
            enforce_eager=v.enforce_eager, max_num_seqs=v.max_num_seqs or r.max_batch_size,
            seed=engine_seed(cfg.run.seed, version, index), extra_args=list(v.extra_args),
            log_path=str(run_dir / f"vllm_server{index}.log") if run_dir is not None else None,
            startup_timeout_s=v.startup_timeout_s)
    return VllmEngine(v.url, server=server, tokenizer=tokenizer, version=version, api_key=v.api_key,
                      weight_dir=weight_dir, update_timeout=v.update_timeout_s)


def start_remote_engines(engines: list, trainer, *, random_init: bool = False) -> None:
    """Start each remote engine and give its server the trainer's weights where they may differ
    from what it loaded (a resumed run, ``model.init=random``, LoRA, a server conveyor did not
    start): the trainer's
    :meth:`~conveyor.trainer.trainer.Trainer.weight_update` at its current version.

    Raises:
        VllmServerError / EngineHTTPError: a server cannot start or lacks what training needs.
    """
    update = None
    # a server someone else started (rollout.vllm.url) may hold any weights: it gets the trainer's
    foreign = any(getattr(e, "server", True) is None for e in engines)
    if trainer.version > 0 or getattr(trainer, "lora", None) is not None or random_init or foreign:
        update = trainer.weight_update()
    for e in engines:
        e.start()
        if update is not None and hasattr(e, "load_weights"):
            e.load_weights(update)
        elif update is not None:
            raise ValueError(f"{type(e).__name__} cannot take the trainer's starting weights (resume / LoRA / "
                             "model.init=random): use rollout.engine=vllm or local")


def build_rollout(cfg: TrainConfig, trainer: Trainer, tokenizer, reward_fn, train_samples, *,
                  engine_threads: int, logger: MetricsLogger, ctx: RunContext, n_too_long: int = 0,
                  state: dict | None = None) -> RolloutSide:
    """Start the engine and the reward workers and build the controller (not started) for
    ``trainer`` (at its current version: a resumed run continues from ``state["controller"]``,
    the checkpoint's data cursor, counters and buffered trajectories). Everything started is
    registered on ``ctx`` to be stopped however the run ends.

    Args:
        reward_fn: What the reward workers run: ``reward.fn``'s name or import path (loaded in
            each worker, so nothing is pickled), or a picklable callable.
        n_too_long: Prompts dropped up front by the preflight (the controller's counter).
        state: The checkpoint's ``state.pt`` contents when resuming.
    """
    cfg = resolve_engine_dtype(cfg, trainer.bf16)
    n_engines = cfg.rollout.num_engines
    if cfg.rollout.engine != "local":  # engines in server processes (rollout.engine=vllm / sglang)
        trainer.publish_device = None  # the weights go through the host's disk
        engines = [make_remote_engine(cfg, tokenizer, version=trainer.version, index=i, run_dir=ctx.run_dir)
                   for i in range(n_engines)]
        for e in engines:  # closed (an owned server stopped) however the run ends, started or not
            ctx.stack.callback(e.close)
        start_remote_engines(engines, trainer, random_init=cfg.model.init == "random")
    else:
        # weight updates for an engine on a GPU: staged on the trainer's GPU when the trainer has one
        # (the engine copies device to device), else in pinned host memory (Trainer.weight_update)
        trainer.publish_device = engine_device(cfg) if isinstance(trainer, Trainer) else None
        # the engine's own plain copy (with LoRA: adapters merged, no peft modules; lora.sync=adapter
        # also hands it the base weights W0 that the adapters it receives are merged onto)
        policy = trainer.inference_policy()
        engine_model = (copy.deepcopy(policy) if policy is trainer.model else policy).eval()
        for p in engine_model.parameters():
            p.requires_grad_(False)
        # rollout.num_engines > 1: further engines, each with its own copy (taken before engine 0
        # may convert its model to rollout.engine_dtype)
        models = [engine_model] + [copy.deepcopy(engine_model) for _ in range(n_engines - 1)]
        engines = [make_engine(cfg, m, tokenizer, version=trainer.version, seed_index=i, engine_threads=engine_threads,
                               track_partials=tracks_partials(trainer.proximal), lora_base=trainer.engine_lora_base())
                   for i, m in enumerate(models)]
    engine = engines[0] if n_engines == 1 else EngineRouter(engines, restart=None,
                                                             max_batch_size=cfg.rollout.max_batch_size)
    engine.start()
    if cfg.rollout.engine == "local":
        ctx.stack.callback(engine.close if isinstance(engine, EngineRouter) else engine.stop)
    else:
        ctx.stack.callback(engine.stop)
    reward_service = RewardService(reward_fn, timeout_s=cfg.reward.timeout_s,
                                   failure_score=cfg.reward.failure_score, max_workers=cfg.reward.workers,
                                   metrics=service_metrics(cfg.data.style_schedule),  # correctness (style verdicts) off the main process too
                                   max_abs_score=cfg.reward.max_abs)
    ctx.stack.callback(reward_service.close)
    G = cfg.rollout.group_size
    workflow = build_workflow(cfg, tokenizer, reward_service, version=trainer.version)
    close_workflow = getattr(getattr(workflow, "inner", workflow), "close", None)
    if close_workflow is not None:  # the OpenAI endpoint of env.name=openai:... agents
        ctx.stack.callback(close_workflow)
    eta = cfg.asynchronous.eta
    B = cfg.trainer.batch_size * G  # trajectories per update
    staleness = StalenessManager(batch_size=B, eta=eta, max_concurrent=max(cfg.rollout.max_concurrent, G))
    buffer = TrajectoryBuffer(eta, on_drop=staleness.on_drop)
    controller = RolloutController(
        engine, workflow,
        # data.style_schedule: each sample stamped with the target style at its admission version
        with_style_schedule(DataStream(train_samples, seed=cfg.data.shuffle_seed), cfg.data, lambda: controller.version),
        staleness, buffer,
        group_size=G, filter_all_equal=cfg.rollout.filter_all_equal,
        max_filtered_in_a_row=cfg.rollout.max_filtered_in_a_row, priority=cfg.rollout.priority,
        max_engine_waiting=cfg.rollout.max_engine_waiting, wait_for_expiring=cfg.asynchronous.wait_for_expiring,
        expiring_wait_s=cfg.asynchronous.expiring_wait_s,
        version=trainer.version,
        on_skip=lambda s, why: logger.event("prompt_too_long", sample=s.id, reason=why),
    )
    ctx.stack.callback(controller.stop)
    # prompts dropped up front (on resume, restore() puts back the checkpoint's count)
    controller.stats.prompts_too_long = n_too_long
    controller.set_warmup_batches(trainer.critic_warmup_done)
    if state is not None:
        controller.restore(state["controller"], trainer.version)
    # the publish phase: the weights go to the engine, with what the proximal strategy needs
    # rollout.elastic_threads: the trainer's threads (this thread's intra-op count) are lent to the
    # engine while the trainer waits for a batch
    elastic = (engine, engine_threads, engine_threads + torch.get_num_threads()) if cfg.rollout.elastic_threads else None
    rollout = LocalRollout(controller, buffer, elastic=elastic)
    rollout.reference = reference_scorer(cfg, trainer, engine, rollout.buffered, engine_threads, ctx)
    publisher = publisher_for(trainer.proximal, engine, rollout)
    side = RolloutSide(engine, reward_service, buffer, controller, rollout, publisher, B)
    if cfg.trainer.elastic_threads and torch.device(trainer.device).type != "cpu":
        log.warning("trainer.elastic_threads=true ignored: the trainer runs on %s, not on the CPU's threads", trainer.device)
    elif cfg.trainer.elastic_threads:  # the trainer borrows the idle engine's threads in its updates
        side.trainer_threads = TrainerThreadBorrowing(engine, torch.get_num_threads(), engine_threads)
        hooked = side.trainer_threads.install([trainer.model, trainer.reference_model, *trainer.critics])
        ctx.stack.callback(side.trainer_threads.remove)
        log.info("trainer.elastic_threads: %d blocks checked for the idle engine's %d thread(s)", hooked, engine_threads)
    return side


def reference_scorer(cfg: TrainConfig, trainer: Trainer, engine, buffered: Callable[[], list], engine_threads: int,
                     ctx: RunContext) -> ReferenceScorer | None:
    """``trainer.reference_scoring=idle_engine`` / ``background`` (or ``auto`` resolved to one:
    :func:`~conveyor.config.resolve_reference_scoring`): a started
    :class:`~conveyor.trainer.reference.ReferenceScorer` over the trainer's frozen reference
    policy that scores the buffered trajectories (``buffered()``) while ``engine`` idles (``idle_engine``) or at
    the lowest scheduling priority (``background``), with the engine's thread count (stopped
    with the run); None otherwise or without a KL reference (``loss.kl_coef=0``)."""
    if getattr(trainer, "reference_model", None) is None:
        return None
    mode, _ = resolve_reference_scoring(cfg, str(trainer.device))  # (train.py logs auto's choice)
    if mode == "update":
        return None
    scorer = ReferenceScorer(trainer.reference_model, trainer.scoring_spec(),
                             source=buffered,
                             idle=(lambda: engine.idle) if mode == "idle_engine" else None,
                             threads=engine_threads, share_prompts=trainer.shares_prompts,
                             lowest_priority=mode == "background")
    scorer.start()
    ctx.stack.callback(scorer.stop)
    return scorer


def critic_warmup(trainer: Trainer, cfg: TrainConfig, parts: RolloutSide, logger: MetricsLogger, run_dir: Path,
                  console, health, stop, clock: RunClock) -> float:
    """The critic warm-up (``critic.warmup_steps``; SAO's cold start, MISSION.md section 3):
    critic-only steps on batches of the frozen initial policy's rollouts, before any policy
    update. Each step is logged (``critic_warmup.jsonl``, TensorBoard ``critic_warmup/*``, the
    batch in ``trained.jsonl`` with ``phase: critic_warmup``) and checkpointed as
    ``warmup_<k>`` every ``run.checkpoint_every`` steps, so a resume continues mid-warm-up.

    Returns:
        Seconds the trainer was busy.
    """
    total = cfg.critic.warmup_steps
    controller = parts.controller
    busy = 0.0
    console.print(f"critic warm-up: {total - trainer.critic_warmup_done} critic-only steps on rollouts of the "
                  f"initial policy ({trainer.critic_note})")
    while trainer.in_critic_warmup and not stop.is_set():
        batch = parts.rollout.next_batch(parts.batch_size, trainer.version, health=health, stop=stop)
        if batch is None:
            break
        t0 = time.perf_counter()
        metrics = trainer.critic_warmup_step(batch)
        controller.set_warmup_batches(trainer.critic_warmup_done)
        busy += time.perf_counter() - t0
        k = trainer.critic_warmup_done
        metrics.update(clock.busy(busy))
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


@dataclass
class LoopResult:
    """How the training loop ended.

    Attributes:
        wall_s: Seconds of the loop (this process segment).
        trainer_busy_s: Trainer-side busy seconds (warm-up, updates, publishes).
        engine_busy_s: Engine busy seconds over the same window (<= wall_s).
        cpu_busy: The share of the machine's cores the process kept busy over the same window
            (:meth:`~conveyor.runtime.record.RunClock.cpu_busy`; 0..1).
        interrupted: It stopped after a step before ``trainer.total_steps``: a Ctrl-C / SIGTERM
            or a monitor rule's ``stop`` action (:attr:`stop_reason` says which).
        error: The exception that ended it (re-raised by the caller after the final checkpoint
            and the engine statistics are written), or None.
        mean_proximal_s / mean_train_step_s: Means over the recorded steps (s).
        engine_stats: The engine's counters at the end of the loop.
        eta: The staleness bound in force at the end (``async.eta``, or what the adaptive
            controller, a monitor action or a resumed checkpoint made of it; None: unbounded).
        stop_reason: ``"signal"`` (Ctrl-C / SIGTERM), ``"monitor rule R"`` (rule R's ``stop``
            action), or None (it ran to the end or failed).
    """

    wall_s: float
    trainer_busy_s: float
    engine_busy_s: float
    interrupted: bool
    error: BaseException | None = None
    mean_proximal_s: float = 0.0
    mean_train_step_s: float = 0.0
    engine_stats: dict = field(default_factory=dict)
    eta: int | None = None
    stop_reason: str | None = None
    cpu_busy: float | None = None


def _health(controller):
    def health():
        if isinstance(controller.error, DatasetError | EpisodesFailedError):  # e.g. every prompt too long, a
            raise controller.error                                                # broken environment: clear errors
        if controller.error is not None:
            raise RuntimeError(f"rollout controller crashed: {controller.error!r}") from controller.error
    return health


def build_steering(cfg: TrainConfig, trainer: Trainer, controller, logger: MetricsLogger, console,
                   stop: threading.Event, state: dict | None = None) -> RunSteering:
    """The run's :class:`~conveyor.runtime.steering.RunSteering`: the monitor (``monitor.*``)
    and the adaptive staleness controller (``async.adaptive``), acting on ``controller``
    (``set_eta``), every updater of ``trainer`` (``scale_lr``) and ``stop``; restored from a
    checkpoint's ``state``. The eta in force (the adaptive start ``floor(ratio_base x eta_max)``
    or a resumed run's) is applied to the rollout side before it starts."""
    a, m = cfg.asynchronous, cfg.monitor
    monitor = None
    if m.enabled:
        monitor = RunMonitor(MonitorSettings(
            plateau_evals=m.plateau_evals, plateau_min_rel=m.plateau_min_rel, keep_rate_min=m.keep_rate_min,
            nonfinite_steps=m.nonfinite_steps, pinned_steps=m.pinned_steps, pinned_share=m.pinned_share,
            reward_failure_share=m.reward_failure_share, lr_scale=m.lr_scale, actions=dict(m.actions)))
    ratio = (AsyncRatioController(base=a.ratio_base, r_min=a.ratio_min, r_max=a.ratio_max, step=a.ratio_step,
                                  threshold=a.variance_threshold, eta_max=a.eta_max) if a.adaptive else None)

    settings = {"adaptive": a.adaptive} if a.adaptive else {"adaptive": False, "eta": a.eta}
    if a.adaptive:  # async.eta plays no part then
        settings.update(eta_max=a.eta_max, ratio_base=a.ratio_base, ratio_min=a.ratio_min, ratio_max=a.ratio_max,
                        ratio_step=a.ratio_step, variance_threshold=a.variance_threshold)
    steering = RunSteering(monitor, ratio, ratio.eta() if ratio is not None else a.eta, set_eta=controller.set_eta,
                           scale_lr=trainer.scale_lr, request_stop=stop.set, event=logger.event, say=console.print,
                           lr_scale=m.lr_scale, settings=settings)
    changed = steering.changed_settings(state) if state else []
    if changed:
        saved = state.get("eta")
        logger.event("steering_reset", version=trainer.version, checkpoint_eta=saved, new_eta=steering.eta,
                     changed=[f"async.{k}" for k in changed])
        console.print(f"async.{', async.'.join(changed)} changed since the checkpoint: eta {steering.eta} "
                      f"(the checkpoint's {saved} and its controller state are not restored)")
    if state:
        steering.load_state_dict(state)
    if steering.eta != a.eta:
        controller.set_eta(steering.eta)
        reason = ("resumed" if state and not changed else "async.adaptive: floor(ratio_base x eta_max)")
        logger.event("eta_change", version=trainer.version, old_eta=a.eta, new_eta=steering.eta, reason=reason)
        console.print(f"eta {steering.eta} instead of async.eta={a.eta} ({reason})")
    return steering


def train_loop(cfg: TrainConfig, trainer: Trainer, parts: RolloutSide, logger: MetricsLogger, run_dir: Path,
               console, ctx: RunContext, *, tokenizer, heldout, progress: bool,
               steering_state: dict | None = None) -> LoopResult:
    """Train until ``trainer.total_steps`` (module docstring). The first Ctrl-C stops it after
    the current step; any error is caught, the final checkpoint written
    (:func:`~conveyor.rundir.final_checkpoint`) and the error returned in the result; threads
    are stopped (the engine stays up for the evaluation after training). After every step and
    every periodic evaluation the run's steering (:func:`build_steering`: monitor alerts and
    actions, adaptive eta) runs; its state goes into the checkpoints.

    Args:
        tokenizer / heldout: For the evaluations every ``run.eval_every`` versions.
        progress: Show the progress bar (otherwise a console line every 5 steps).
        steering_state: The steering's state from the checkpoint being resumed.
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    engine, controller, publisher = parts.engine, parts.controller, parts.publisher
    total = cfg.trainer.total_steps
    ctx.phase = "training"
    stop: threading.Event = ctx.interrupts.begin_graceful()  # first Ctrl-C: finish the step, checkpoint, stop
    health = _health(controller)
    steering = build_steering(cfg, trainer, controller, logger, console, stop, steering_state)
    failed_rewards = FailedRewardSteps(cfg.reward.max_failed_steps, cfg.reward.fn)  # reward.max_failed_steps
    publisher.start(trainer)
    controller.start()
    clock = RunClock(engine.stats)
    bar = Progress(
        TextColumn("[bold]train[/] step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"), console=console, disable=not progress,
    )
    task = bar.add_task("train", total=total, completed=trainer.version, info="waiting for rollouts")
    recorder = StepRecorder(logger, controller, console, bar, task, total, progress)
    error: BaseException | None = None
    bookkeeping_s: float | None = None
    sent_state: dict | None = None  # the steering state the rollout side holds for checkpoints
    try:
        with bar:
            if trainer.in_critic_warmup:
                clock.add_busy(critic_warmup(trainer, cfg, parts, logger, run_dir, console, health, stop, clock))
            while trainer.version < total and not stop.is_set() and not trainer.in_critic_warmup:
                try:
                    out = run_step(trainer, parts.rollout, publisher, parts.batch_size, health=health, stop=stop,
                                   update_context=parts.trainer_threads.update if parts.trainer_threads else None)
                except NonFiniteLossError as e:  # the step still counts: log it, then stop
                    recorder.nonfinite(trainer.version, e.metrics, e.batch, controller.take_not_trained())
                    raise
                except BaseException as e:  # publishing failed after the update: the step is logged
                    done = getattr(e, "trained_step", None)
                    if done is not None:
                        recorder.unpublished(trainer.version, done.metrics, done.batch, repr(e))
                    raise
                if out is None:
                    break
                clock.add_busy(out.busy_s)
                t_rec = time.perf_counter()
                metrics = out.metrics
                if bookkeeping_s is not None:
                    metrics["time/bookkeeping_s"] = bookkeeping_s  # logging + checkpoint of the previous step
                metrics.update(batch_metrics(out.batch))
                metrics.update(clock.tick())
                metrics.update(parts.rollout.counters())
                metrics["staleness/eta"] = float("nan") if steering.eta is None else float(steering.eta)  # in force
                recorder.step(trainer.version, metrics, out.batch, parts.rollout.take_not_trained(),
                              trainer.take_events())
                steering.after_step(trainer.version, metrics, [float(t.reward) for t in out.batch])
                failed_rewards.after_step(trainer.version, out.batch)  # raises: stopped with a checkpoint
                fault_point("step_end")  # chaos suite: a kill between steps
                if heldout and cfg.run.eval_every and trainer.version % cfg.run.eval_every == 0 and trainer.version < total:
                    # a held-out curve point (before the checkpoint: a kill here redoes the step and this)
                    res = heldout_eval(engine, tokenizer, cfg, heldout, f"step_{trainer.version}", logger, run_dir,
                                       False, parts.reward_service, evaluate_fn=parts.evaluate,
                                       version=trainer.version, policy=eval_policy(cfg, trainer))
                    curve = {"heldout/pass_at_1": res.pass_at_1, "heldout/format_rate": res.format_rate}
                    if res.reward_mean is not None:  # graded by the user's reward.fn (issue 44)
                        curve["heldout/reward_mean"] = res.reward_mean
                    logger.scalars(trainer.version, curve)
                    console.print(f"  held-out pass@1 at version {trainer.version}: {res.pass_at_1:.3f} "
                                  f"({res.wall_seconds + res.check_seconds:.0f} s)" + unknown_note(res)
                                  + reward_note(res))
                    steering.after_eval(trainer.version, res.pass_at_1)
                runtime_state = {"steering": steering.state_dict()}
                if runtime_state != sent_state:  # for the checkpoints; unchanged: no call (an actor call on Ray)
                    controller.set_runtime_state(runtime_state)
                    sent_state = runtime_state
                # the checkpoint of the last step is the final one (run.final_checkpoint), below
                if trainer.version % cfg.run.checkpoint_every == 0 and trainer.version < total:
                    p = save_checkpoint(run_dir, trainer, controller, keep=cfg.run.keep_checkpoints)
                    logger.event("checkpoint", path=str(p), version=trainer.version)
                bookkeeping_s = time.perf_counter() - t_rec
    except BaseException as e:  # still write a checkpoint: nothing already computed is lost
        error = e
    finally:
        wall = clock.wall()
        eng_end = engine.stats()  # read with `wall`: busy seconds and wall-clock cover one window
        cpu_busy = clock.cpu_busy(wall)
        # a monitor rule's stop action sets the same event as a first Ctrl-C, and ends the same way
        # (a stop after the last update stops nothing: the run finished)
        interrupted = ctx.interrupts.requested or (stop.is_set() and trainer.version < total)
        stop_reason = ("signal" if ctx.interrupts.requested else steering.stopped_by or "stop requested") \
            if interrupted else None
        controller.stop()
        publisher.stop()
        parts.rollout.training_ended()
        ctx.phase = "the final checkpoint"
        final_checkpoint(run_dir, trainer, controller, logger, cfg, error, interrupted)
        ctx.interrupts.end_graceful()  # from here a Ctrl-C stops at once
    # <= wall by definition: the engine adds a forward pass's seconds when it ends, so one that
    # began before the loop counts whole; in a short segment (a resume with nothing left to
    # train) that alone gave 1.09-1.35 x wall
    engine_busy = min(wall, clock.engine_busy_since_start(eng_end))
    prox_s, train_s = recorder.mean_seconds()
    return LoopResult(wall, clock.trainer_busy, engine_busy, interrupted, error, prox_s, train_s, eng_end,
                      eta=steering.eta, stop_reason=stop_reason, cpu_busy=cpu_busy)
