"""The record phase of the step protocol (issue 12, section 1): per-step metrics, the run's logs
and the progress display, written once for every runtime.

- :class:`RunClock`: wall-clock and busy seconds of one process segment (trainer and engine), and
  the share of the machine's cores the process kept busy.
- :func:`batch_metrics`: what a batch of trajectories says about the rollouts (accuracy, format,
  reward failures, truncation, lengths; turns, tool calls and sandbox incidents of multi-turn
  episodes: :func:`agent_metrics`).
- :class:`StepRecorder`: one step's row in ``metrics.jsonl`` / TensorBoard, its batch in
  ``trained.jsonl``, the trainer's events, the progress bar or console line.
"""

from __future__ import annotations

import os
import time
from typing import Any

from conveyor.rewards.styles import style_batch_metrics
from conveyor.rundir import failure_counts, report_failures
from conveyor.runlog import FailureCounter, MetricsLogger
from conveyor.types import Trajectory

__all__ = ["RunClock", "StepRecorder", "agent_metrics", "batch_metrics"]


class RunClock:
    """Wall-clock and busy time of one process segment, from construction on.

    Args:
        engine_stats: ``() -> dict`` with the engine's cumulative ``busy_seconds`` (s),
            ``generated_tokens`` and ``pause_seconds_total`` (s)
            (:meth:`~conveyor.rollout.engine.Engine.stats`).

    Attributes:
        trainer_busy: Seconds the trainer side was busy so far (add with :meth:`add_busy`).
        cores: The CPU cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count()``
            where that does not exist), the denominator of ``busy/cpu``.
    """

    def __init__(self, engine_stats):
        self.engine_stats = engine_stats
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.t_start = time.perf_counter()
        self.cpu_start = time.process_time()
        self.eng0 = engine_stats()
        self.trainer_busy = 0.0
        self._last_eng, self._last_t = self.eng0, self.t_start

    def add_busy(self, seconds: float) -> None:
        """Count ``seconds`` of trainer work."""
        self.trainer_busy += seconds

    def wall(self) -> float:
        """Seconds since the segment started."""
        return time.perf_counter() - self.t_start

    def engine_busy_since_start(self, stats: dict | None = None) -> float:
        """Engine busy seconds since the segment started, per engine (the mean over
        ``stats["num_engines"]`` engines of an :class:`~conveyor.rollout.engine.router.EngineRouter`;
        ``stats``: a snapshot to read)."""
        stats = stats if stats is not None else self.engine_stats()
        # .get: a remote engine that reports no busy time (SGLang's server) reads as never busy, it
        # does not break the loop's bookkeeping
        busy = float(stats.get("busy_seconds", 0.0)) - float(self.eng0.get("busy_seconds", 0.0))
        return busy / max(1, int(stats.get("num_engines", 1)))

    def cpu_busy(self, wall_s: float | None = None, stats: dict | None = None) -> float:
        """The share of the machine's cores this process kept busy since the segment started:
        the CPU seconds of all its threads (``time.process_time``: user + system, every thread of
        the engine, the trainer, the reference scorer, ...; not child processes such as reward
        workers, nor Ray actors: with ``runtime.name=ray`` it is the driver's share) over
        ``wall_s x cores`` (cores this process may run on; a CPU quota of a container is not
        read). An engine server the run started (``rollout.engine=vllm``) reports its processes' CPU
        seconds (``server_cpu_seconds`` in the engine's stats), and they count here too. 1.0: every core busy all the time. Unlike
        ``busy/trainer`` / ``busy/engine`` it counts a core by what ran on it, not by which
        component owns it (a trainer that borrows the idle engine's core keeps that core busy)."""
        wall_s = max(self.wall() if wall_s is None else wall_s, 1e-9)
        cpu = time.process_time() - self.cpu_start
        if "server_cpu_seconds" in self.eng0:  # an engine server this run started (rollout.engine=vllm)
            stats = stats if stats is not None else self.engine_stats()  # (a snapshot the caller has: no second fetch)
            cpu += max(0.0, float(stats.get("server_cpu_seconds", 0.0)) - self.eng0["server_cpu_seconds"])
        return cpu / (wall_s * self.cores)

    def busy(self, trainer_busy_s: float) -> dict[str, float]:
        """``time/elapsed_s`` and the busy fractions with ``trainer_busy_s`` trainer seconds
        (the critic warm-up's rows)."""
        wall_s = max(self.wall(), 1e-9)
        return {"time/elapsed_s": wall_s, "busy/trainer": trainer_busy_s / wall_s,
                "busy/engine": self.engine_busy_since_start() / wall_s, "busy/cpu": self.cpu_busy(wall_s)}

    def tick(self) -> dict[str, float]:
        """The step's timing metrics since the previous tick: generation throughput (tokens/s),
        busy fractions over the segment (``busy/trainer``, ``busy/engine``: the components';
        ``busy/cpu``: the cores', :meth:`cpu_busy`), the step's wall-clock and the elapsed time (s); with
        several engines also the router's cumulative ``engine/restarts``,
        ``engine/resubmitted`` (requests run again after their engine died) and
        ``engine/routed_by_affinity``."""
        now = time.perf_counter()
        eng = self.engine_stats()
        wall = now - self.t_start
        out = {
            "throughput/generated_tokens_per_s":
                (eng.get("generated_tokens", 0) - self._last_eng.get("generated_tokens", 0)) / max(1e-9, now - self._last_t),
            "busy/trainer": self.trainer_busy / wall,
            "busy/engine": self.engine_busy_since_start(eng) / wall,
            "busy/cpu": self.cpu_busy(wall, eng),
            "time/step_wall_s": now - self._last_t,
            "time/elapsed_s": wall,
            "engine/pause_seconds_total": eng.get("pause_seconds_total", 0.0),
        }
        if "num_engines" in eng:  # rollout.num_engines > 1: the router's counters (cumulative)
            out["engine/restarts"] = float(eng.get("engine_restarts", 0))
            out["engine/resubmitted"] = float(eng.get("router_resubmitted", 0))
            out["engine/routed_by_affinity"] = float(eng.get("routed_by_affinity", 0))
        self._last_eng, self._last_t = eng, now
        return out


def agent_metrics(batch: list[Trajectory]) -> dict[str, float]:
    """Statistics of a batch's multi-turn episodes (trajectories of
    :class:`~conveyor.rollout.agent.AgentWorkflow`, recognised by ``metadata["turns"]``); empty
    when there are none.

    Keys: ``agent/turns_mean`` (model turns per episode), ``agent/tool_calls_mean`` (turns that
    called a tool, per episode), ``agent/tool_call_rate`` (share of turns that called a tool),
    ``agent/tool_call_success_rate`` (share of calls that ran and succeeded; NaN without calls),
    ``agent/episodes_cut_share`` (episodes ended by a limit, not by the environment),
    ``agent/sandbox_incidents`` (contained sandbox incidents in the batch) and, when the
    environment reports them, ``agent/incidents/<kind>`` for every kind of
    :data:`conveyor.envs.sandbox.INCIDENT_KINDS`. Tool counts come from the environment's
    ``episode_stats()`` (``metadata["env_stats"]``); environments without tools count 0."""
    agent = [t for t in batch if "turns" in t.metadata]
    if not agent:
        return {}
    n = len(agent)
    stats = [t.metadata.get("env_stats") or {} for t in agent]
    turns = sum(int(t.metadata["turns"]) for t in agent)
    calls = sum(int(st.get("tool_calls", 0)) for st in stats)
    ok = sum(int(st.get("tool_calls_ok", 0)) for st in stats)
    out = {
        "agent/turns_mean": turns / n,
        "agent/tool_calls_mean": calls / n,
        "agent/tool_call_rate": calls / turns if turns else 0.0,
        "agent/tool_call_success_rate": ok / calls if calls else float("nan"),
        "agent/episodes_cut_share": sum(not t.metadata.get("env_done", True) for t in agent) / n,
    }
    kinds: dict[str, float] = {}
    if any("incidents" in st for st in stats):
        from conveyor.envs.sandbox import INCIDENT_KINDS

        kinds = dict.fromkeys(INCIDENT_KINDS, 0.0)
        for st in stats:
            for kind, v in (st.get("incidents") or {}).items():
                kinds[kind] = kinds.get(kind, 0.0) + float(v)
    out["agent/sandbox_incidents"] = float(sum(kinds.values()))
    out.update({f"agent/incidents/{k}": v for k, v in kinds.items()})
    return out


def batch_metrics(batch: list[Trajectory]) -> dict[str, float]:
    """Rollout statistics of a non-empty batch: shares of correct answers, well-formatted
    answers, unknown correctness (the answer check timed out / crashed: counted as wrong in the
    accuracy), failed rewards and truncated responses; response length mean / max (tokens);
    for multi-turn episodes also :func:`agent_metrics`; on the preference-shift task
    (``data.style_schedule``) also ``style/<name>_rate``, ``style/target`` and
    ``style/target_rate`` (:func:`conveyor.rewards.styles.style_batch_metrics`)."""
    n = len(batch)
    lengths = [len(t.response_ids) for t in batch]
    return {
        "rollout/accuracy": sum(bool(t.correct) for t in batch) / n,
        "rollout/format_rate": sum(bool(t.metadata.get("format_ok")) for t in batch) / n,
        "rollout/correct_unknown_share": sum(t.correct is None for t in batch) / n,
        "rollout/reward_failed_share": sum(bool(t.metadata.get("reward_failed")) for t in batch) / n,
        "rollout/truncated_share": sum(t.finish_reason == "length" for t in batch) / n,
        "response/length_mean": sum(lengths) / n,
        "response/length_max": float(max(lengths)),
        **agent_metrics(batch),
        **style_batch_metrics(batch),  # preference-shift task only (data.style_schedule)
    }


class StepRecorder:
    """Writes each step to the run's logs and shows progress.

    Args:
        logger: The run's :class:`~conveyor.runlog.MetricsLogger`.
        controller: The rollout controller (reward-failure counts for the console line).
        console: A ``rich`` console.
        bar: A ``rich.progress.Progress`` (disabled when the progress display is off) and
            ``task``: its task id.
        total: ``trainer.total_steps``.
        progress: Whether the progress bar is shown (otherwise a console line every 5 steps).
    """

    def __init__(self, logger: MetricsLogger, controller, console, bar, task, total: int, progress: bool):
        self.logger, self.controller, self.console = logger, controller, console
        self.bar, self.task, self.total, self.progress = bar, task, total, progress
        # a resumed run's counts, restored with its checkpoint: not new
        self.failures = FailureCounter(baseline=failure_counts(controller.stats))
        self.proximal_seconds: list[float] = []
        self.train_seconds: list[float] = []

    def unpublished(self, version: int, metrics: dict[str, Any], batch, error: str) -> None:
        """A step whose update was taken but whose weights could not be published (the run
        stops; the final checkpoint holds this version): its metrics row and batch are logged,
        so every version a checkpoint holds has its rows, and a ``publish_failed`` event."""
        self.logger.log(version, metrics)
        self.logger.trained(version, batch, not_trained=[])
        self.logger.event("publish_failed", version=version, error=error)

    def nonfinite(self, version: int, metrics: dict[str, Any], batch, not_trained: list[dict]) -> None:
        """A step whose loss stayed non-finite (it counts: logged before the run stops)."""
        self.logger.log(version, metrics)
        self.logger.trained(version, batch, not_trained=not_trained)
        self.logger.event("skipped_nonfinite", version=version)

    def step(self, version: int, metrics: dict[str, Any], batch, not_trained: list[dict],
             events: list[dict]) -> None:
        """Record step ``version``: its metrics row, its batch, the trainer's ``events`` (each
        ``{"event": name, ...}``; ``proximal`` when unnamed), the progress display."""
        self.proximal_seconds.append(metrics.get("time/proximal_s", 0.0))
        self.train_seconds.append(metrics.get("time/train_step_s", 0.0))
        self.logger.log(version, metrics)
        self.logger.trained(version, batch, not_trained=not_trained)
        if metrics["train/skipped_nonfinite"]:
            self.logger.event("skipped_nonfinite", version=version)
        for ev in events:
            ev = dict(ev)
            self.logger.event(ev.pop("event", "proximal"), **ev)
        self.bar.update(self.task, completed=version, info=(
            f"reward {metrics['reward/mean']:.2f}  acc {metrics['rollout/accuracy']:.2f}  "
            f"stale {metrics['staleness/mean']:.1f}/{metrics['staleness/max']:.0f}  "
            f"gen {metrics['throughput/generated_tokens_per_s']:.0f} tok/s  "
            f"busy T {metrics['busy/trainer']:.2f} E {metrics['busy/engine']:.2f}"))
        if not self.progress and (version % 5 == 0 or version in (1, self.total)):
            self.console.print(
                f"step {version}/{self.total} reward {metrics['reward/mean']:.3f} acc {metrics['rollout/accuracy']:.3f} "
                f"staleness {metrics['staleness/mean']:.2f} gen {metrics['throughput/generated_tokens_per_s']:.0f} tok/s "
                f"busy trainer {metrics['busy/trainer']:.2f} engine {metrics['busy/engine']:.2f} "
                f"({metrics['time/elapsed_s']:.0f} s)")
        report_failures(self.failures, self.controller, self.console)

    def mean_seconds(self) -> tuple[float, float]:
        """Mean proximal and train-step seconds over the recorded steps (0 when none)."""
        def mean(xs):
            return sum(xs) / len(xs) if xs else 0.0
        return mean(self.proximal_seconds), mean(self.train_seconds)
