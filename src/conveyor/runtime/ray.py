"""The Ray runtime (issue 12, section 3): the same step protocol, with the rollout side in a Ray
actor (``runtime.name=ray``; ``pip install 'conveyor[ray]'``).

Layout (a first, small one; docs/notes/scale_out_survey.md section 5.6 is the full proposal):

- the **driver** (the ``conveyor train`` process) keeps what the inline runtime's main thread
  has: the trainer, the step protocol (:func:`~conveyor.runtime.step.run_step` in
  :func:`~conveyor.runtime.inline.train_loop`, unchanged), the publisher, the logs, checkpoints,
  the export and the summary;
- one :class:`RolloutActor` (a threaded Ray actor in its own worker process) owns what
  :func:`~conveyor.runtime.inline.build_rollout` builds in process: the local
  :class:`~conveyor.rollout.engine.InferenceEngine` (its own copy of the policy: the model is
  loaded from ``model.name`` / ``model.seed`` and the trainer's current weights are applied),
  the :class:`~conveyor.rewards.RewardService` (its worker processes are the actor's children),
  the workflow, the staleness rule, the buffer and the
  :class:`~conveyor.rollout.controller.RolloutController` with its old-log-prob book. The
  held-out evaluations run inside the actor too (its engine and reward workers; no token crosses
  the boundary).

The driver sees the actor through proxies that bind the ports the step protocol already uses:
:class:`RayRollout` (the :class:`~conveyor.runtime.step.RolloutPort`, plus what the loop uses of
the controller: start / stop, ``error``, ``stats``, ``snapshot`` for checkpoints) and
:class:`RayEngine` (the :class:`~conveyor.rollout.engine.Engine` control plane, the
``score_old_logprobs`` capability executed in the actor, and an async ``generate``). Only
picklable messages cross: :class:`~conveyor.types.Trajectory`,
:class:`~conveyor.sync.WeightUpdate` (``ray.put`` once per version, the actor applies it between
two decode steps), :class:`~conveyor.rollout.old_logprobs.OldLogprobPatch`,
:class:`~conveyor.rollout.old_logprobs.ScoringItem`, ``PartialRequest``, ``ScoringSpec``,
counters and checkpoint snapshots; nothing is shared by reference. The checkpoint format is the
inline runtime's (``controller.snapshot()`` is the actor's), so a run can be resumed under
either runtime.

Faults: every remote call has a timeout (``runtime.call_timeout_s``; evaluations
``runtime.eval_timeout_s``); an exception in the actor is raised in the driver as a
:class:`RolloutActorError` with the actor's message (the controller's own error keeps its type,
e.g. :class:`~conveyor.data.DatasetError`), a dead actor likewise; the loop then writes its final
checkpoint (which needs the actor's snapshot: after an actor *death* it fails, logged, and the
last periodic checkpoint stays the newest). Log records of the actor (``conveyor.*`` loggers:
failed rewards, episode tracebacks) are forwarded to the driver's ``train.log``. Several
engines: :mod:`conveyor.runtime.ray_engines`. A dead actor is restarted
(``runtime.max_actor_restarts``, default 2) and continues from the state it handed out last,
its lost episodes generated again (:class:`_ActorReviver`); the loop goes on. With
``runtime.trainer=actor`` the trainer runs in an actor of its own
(:mod:`conveyor.runtime.ray_trainer`) and the weights go from it to the rollout actor without
passing through the driver.

Ray is imported lazily: ``import conveyor`` works without it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
import pickle
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from conveyor.faults import STALL_ENV
from conveyor.rollout.engine.router import CUMULATIVE_ENGINE_STATS
from conveyor.runtime.ray_engines import ENGINE_ACTOR_FAULTS_ENV, forwarded_env
from conveyor.runtime.ray_trainer import weights_ref

log = logging.getLogger(__name__)

__all__ = ["RayEngine", "RayRewardService", "RayRollout", "RolloutActor", "RayConnectError", "RolloutActorError", "RolloutActorTimeout",
           "build_ray_rollout", "check_ray_address", "connect_ray", "require_ray", "start_rollout_actor"]

INSTALL_HINT = "pip install 'conveyor[ray]'"
"""How to install Ray for conveyor (the ``ray`` extra)."""

ACTOR_FAULTS_ENV = "CONVEYOR_ACTOR_FAULTS"
"""Environment variable of the driver whose value becomes the rollout actor's ``CONVEYOR_FAULTS``
(chaos experiments in the actor only; :mod:`conveyor.faults`)."""



class RolloutActorError(RuntimeError):
    """The rollout actor raised, died, or did not answer within its timeout; the message says
    which call, and carries the actor's own message."""


class RolloutActorTimeout(RolloutActorError):
    """The rollout actor did not answer a call within its timeout (it may still be working on it)."""


def require_ray():
    """Import Ray.

    Returns:
        The ``ray`` module.

    Raises:
        ImportError: Ray is not installed (the message names ``pip install 'conveyor[ray]'``).
    """
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"runtime.name=ray needs Ray, which is not installed: {INSTALL_HINT} "
                          f"(or runtime.name=inline)") from e
    return ray


def wire_dtype(cfg):
    """The dtype weights travel in to the rollout side: ``torch.bfloat16`` when the engines run
    bf16 (``rollout.engine_dtype`` resolved: half of float32's bytes through the object store,
    and exactly the weights the engines store, :meth:`~conveyor.sync.WeightUpdate.cast`),
    else None (as the trainer holds them)."""
    if cfg.rollout.engine_dtype == "bfloat16":
        import torch

        return torch.bfloat16
    return None


def run_cpus(cfg) -> float:
    """CPUs the run's actors reserve: the rollout actor, engine actors 1 .. N-1 and, with
    ``runtime.trainer=actor``, the trainer actor (``runtime.*_num_cpus``)."""
    rt = cfg.runtime
    return (rt.rollout_num_cpus + (cfg.rollout.num_engines - 1) * rt.engine_num_cpus
            + (rt.trainer_num_cpus if rt.trainer == "actor" else 0.0))


class RayConnectError(RuntimeError):
    """The Ray cluster cannot be started or joined (:func:`connect_ray`,
    :func:`check_ray_address`): the message names ``runtime.address`` and what to do."""


def check_ray_address(address: str | None, timeout_s: float = 5.0) -> None:
    """Fail fast when ``runtime.address`` names a host and port where nothing answers:
    ``ray.init`` retries such an address for minutes without a word (fresh-user trial 3,
    finding 3). ``None`` (a local cluster), ``auto`` and ``local`` are not probed; ``host:port``
    and ``ray://host:port`` get one TCP connection attempt of ``timeout_s`` seconds.

    Raises:
        ValueError: the address has no port, or a port that is not a number in 1..65535.
        RayConnectError: nothing accepts a connection there (the OS's reason, what to do).
    """
    import socket

    if address is None or address in ("auto", "local"):
        return
    hostport = address.removeprefix("ray://").rstrip("/")
    host, sep, port_s = hostport.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
        raise ValueError(f"runtime.address={address!r}: expected auto, host:port or ray://host:port (the head "
                         "node's address as `ray start --head` prints it), or null for a local cluster")
    try:
        socket.create_connection((host.strip("[]"), int(port_s)), timeout=timeout_s).close()
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
        raise RayConnectError(f"runtime.address={address}: no Ray cluster answers at {host}:{port_s} ({why}); start "
                           "one with `ray start --head` (it prints the address to use) or set runtime.address=null "
                           "for a local cluster of this run's own") from e


def connect_ray(runtime_cfg, min_cpus: float = 0.0) -> Callable[[], None] | None:
    """Connect this process to a Ray cluster for a run.

    Args:
        runtime_cfg: The :class:`~conveyor.config.RuntimeConfig`: ``address`` None starts a local
            cluster of ``num_cpus`` CPUs (default: this machine's); ``"auto"``, ``host:port`` or
            ``ray://host:port`` joins a running one. When Ray is already initialised in this
            process (a notebook, a test), that cluster is used as it is.
        min_cpus: CPUs the run's actors reserve: a local cluster without ``num_cpus`` gets at
            least that many logical CPUs (more than the machine's cores: oversubscribed, with a
            warning), so that its actors can start.

    Returns:
        ``ray.shutdown`` when this call connected (the caller disconnects at the end, which also
        stops a local cluster it started), None when Ray was already initialised.

    Raises:
        ImportError: Ray is missing (:func:`require_ray`).
        ValueError: a local cluster of ``runtime.num_cpus`` smaller than ``min_cpus``.
        RayConnectError: the cluster cannot be started or joined (Ray's message, with the
            address; a RuntimeError).
    """
    ray = require_ray()
    if ray.is_initialized():
        if runtime_cfg.address is not None:
            log.warning("Ray is already initialised in this process: using that cluster, not runtime.address=%s",
                        runtime_cfg.address)
        return None
    if runtime_cfg.address is None and runtime_cfg.num_cpus is not None and runtime_cfg.num_cpus < min_cpus:
        raise ValueError(f"runtime.num_cpus={runtime_cfg.num_cpus} is fewer than the {min_cpus:g} CPUs the run's "
                         "actors reserve (runtime.rollout_num_cpus + the engine actors' runtime.engine_num_cpus + "
                         "runtime.trainer_num_cpus with runtime.trainer=actor): they could never start")
    kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": True}
    try:
        if runtime_cfg.address is None:
            # "local": always a new cluster, never one Ray finds running on this machine
            num_cpus = runtime_cfg.num_cpus
            if num_cpus is None:
                cores = os.cpu_count() or 1
                num_cpus = max(cores, math.ceil(min_cpus))
                if num_cpus > cores:
                    log.warning("the run's Ray actors reserve %g CPUs on this %d-core machine: the local cluster gets "
                                "%d logical CPUs (oversubscribed)", min_cpus, cores, num_cpus)
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **kwargs)
        else:
            check_ray_address(runtime_cfg.address)
            ray.init(address=runtime_cfg.address, **kwargs)
    except Exception as e:
        where = "start a local Ray cluster" if runtime_cfg.address is None else f"join the Ray cluster at runtime.address={runtime_cfg.address}"
        if isinstance(e, RayConnectError):
            raise
        raise RayConnectError(f"could not {where}: {type(e).__name__}: {e}") from e
    return ray.shutdown


# ---------------------------------------------------------------------- the actor
class _LogCollector(logging.Handler):
    """Keeps the actor's ``conveyor.*`` log records (formatted, picklable) until the driver
    takes them (:meth:`RolloutActor.drain`); at most ``cap``, the oldest dropped first."""

    def __init__(self, cap: int = 5000):
        super().__init__(logging.INFO)
        self.records: deque[dict] = deque(maxlen=cap)
        self._fmt = logging.Formatter()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:
            msg = str(record.msg)
        exc = record.exc_text
        if record.exc_info and not exc:
            exc = self._fmt.formatException(record.exc_info)
        self.records.append({
            "name": record.name, "levelno": record.levelno, "levelname": record.levelname, "msg": msg,
            "exc_text": exc, "created": record.created, "console": getattr(record, "console", True),
            "threadName": record.threadName,
        })

    def take(self) -> list[dict]:
        out = []
        while self.records:
            out.append(self.records.popleft())
        return out

    @classmethod
    def for_actor(cls, collect: bool) -> _LogCollector:
        """A collector; with ``collect`` (in an actor's own process) it takes this process's
        ``conveyor.*`` records at INFO and up, which are then forwarded to the driver's
        ``train.log`` rather than printed here too."""
        logs = cls()
        if collect:
            lg = logging.getLogger("conveyor")
            lg.addHandler(logs)
            lg.setLevel(logging.INFO)
            lg.propagate = False
        return logs


def _picklable_error(e: BaseException | None) -> BaseException | None:
    """``e`` itself when it pickles (its type survives the trip), else a RuntimeError with its repr."""
    if e is None:
        return None
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(repr(e))


class RolloutActor:
    """The rollout side of a run in a Ray actor (module docstring): engine, rewards, workflow,
    staleness rule, buffer and controller, built by :meth:`setup` from picklable arguments.

    Created by :func:`start_rollout_actor` as a threaded actor (several calls run at once: the
    driver's :meth:`next_batch` waits in one thread while weight updates, counters and snapshots
    come in on others). Used in-process it is an ordinary object (tests).

    Args:
        collect_logs: Collect this process's ``conveyor.*`` log records for :meth:`drain` (and
            stop printing them here): true in the actor's own process; false in-process.
    """

    def __init__(self, collect_logs: bool = False):
        self._logs = _LogCollector.for_actor(collect_logs)
        self._skips: list[dict] = []
        self._skips_lock = threading.Lock()
        self.engine = self.controller = self.buffer = self.reward_service = self.tokenizer = self.workflow = None
        self._refs = None  # WeightRefs (engine actors)
        self._sync_lock = threading.Lock()
        self._syncs: dict[int, concurrent.futures.Future] = {}  # version -> its update's outcome (retries join)
        self._engine_actors: list = []  # every engine actor started (replacements too)
        self._remote: list = []  # rollout.engine=vllm / sglang: the engines (their servers) of this actor

    # ------------------------------------------------------------------ build
    def setup(self, cfg, train_samples: list, weights, *, engine_threads: int, track_partials: bool,
              warmup_batches: int = 0, n_too_long: int = 0, controller_state: dict | None = None,
              engine_faults: str | None = None) -> dict:
        """Build the rollout side for a trainer at ``weights.version`` (what
        :func:`~conveyor.runtime.inline.build_rollout` builds in process), the engine started,
        the controller not.

        Args:
            cfg: The run's :class:`~conveyor.config.TrainConfig`.
            train_samples: The training samples (already preflighted by the driver).
            weights: The trainer's current :class:`~conveyor.sync.WeightUpdate`, or ``[its object
                reference]`` (then the engine actors read that same object), applied to the
                model loaded from ``model.name`` / ``model.seed``, so the engine starts from
                exactly the trainer's parameters, also on a resume; with LoRA the adapted
                weights on that base model (:func:`~conveyor.runtime.ray_engines.build_local_engine`).
            engine_threads: Intra-op threads of the engine's decode thread.
            track_partials: Keep request tokens for old-log-prob scoring (partial_sync / dedicated).
            warmup_batches: Critic warm-up batches consumed so far.
            n_too_long: Prompts the driver's preflight dropped (the controller's counter).
            controller_state: A checkpoint's ``state["controller"]`` to continue from, or None.
            engine_faults: ``CONVEYOR_FAULTS`` of the first engine actor (chaos tests), or None.

        With ``rollout.num_engines`` N > 1, engines 1 .. N-1 are started as engine actors
        (:mod:`conveyor.runtime.ray_engines`) and the controller generates through an
        :class:`~conveyor.rollout.engine.router.EngineRouter` over all N.

        Returns:
            ``{"pid", "node", "version", "model_seconds", "engine_pids"}``.

        Raises:
            Whatever loading fails with (a reward function that does not import on this node, a
            model that is not there, an engine actor that cannot start), raised in the driver as
            :class:`RolloutActorError`.
        """
        from conveyor.rewards import RewardService
        from conveyor.rewards.styles import service_metrics
        from conveyor.rollout.buffer import TrajectoryBuffer
        from conveyor.rollout.controller import DataStream, RolloutController
        from conveyor.rollout.engine.router import EngineRouter
        from conveyor.rollout.staleness import StalenessManager
        from conveyor.rollout.style_schedule import with_style_schedule
        from conveyor.runtime.inline import build_workflow
        from conveyor.runtime.ray_engines import WeightRefs, build_local_engine, start_engine_actors

        weights_ref = None
        if isinstance(weights, list):  # [object reference]: the engine actors read the same object
            import ray

            weights_ref = weights[0]
            weights = ray.get(weights_ref)
        version = weights.version
        reward_fn = cfg.reward.fn  # the workers import it by path (checked by the driver; nothing pickled)
        n = cfg.rollout.num_engines
        if cfg.rollout.engine != "local":  # rollout.engine=vllm / sglang: servers, one per engine
            self.engine, engine_pids, model_s = self._remote_engines_setup(cfg, weights, version)
            n = 0  # (no local engine, no engine actors)
        else:
            engine0, self.tokenizer, model_s = build_local_engine(cfg, weights, seed_index=0,
                                                                  engine_threads=engine_threads,
                                                                  track_partials=track_partials)
            engine_pids = [os.getpid()]
        if n == 0:
            pass
        elif n == 1:
            self.engine = engine0
        else:
            import ray

            refs = self._refs = WeightRefs(ray)
            if weights_ref is not None:
                refs.remember(weights, weights_ref)
            slots: dict[int, Any] = {}  # engine index -> its current client
            replaced = [0]

            def restart(index: int, update):  # the router's replacement of a dead engine actor
                old = slots.get(index)
                if old is not None:
                    old.close()  # perhaps only unreachable: never two actors for one slot
                replaced[0] += 1
                (client,) = start_engine_actors(cfg, refs.ref(update), [(index, index + n * replaced[0], None)],
                                                engine_threads=engine_threads, track_partials=track_partials)
                client.refs = refs
                slots[index] = client
                self._engine_actors.append(client.actor)
                return client

            try:
                clients = start_engine_actors(cfg, refs.ref(weights),
                                              [(i, i, engine_faults if i == 1 else None) for i in range(1, n)],
                                              engine_threads=engine_threads, track_partials=track_partials)
            except Exception:
                engine0.stop()
                raise
            for c in clients:
                c.refs = refs
                slots[c.index] = c
                self._engine_actors.append(c.actor)
            engine_pids += [c.pid for c in clients]
            self.engine = EngineRouter([engine0, *clients], restart=restart, initial=weights,
                                       max_restarts=cfg.runtime.max_engine_restarts,
                                       max_batch_size=cfg.rollout.max_batch_size,
                                       update_timeout_s=cfg.runtime.call_timeout_s,
                                       # below the driver's wait for close() (60 s); an engine
                                       # actor still starting after it dies with this actor
                                       replace_timeout_s=45.0)
        self.engine.start()
        self.reward_service = RewardService(reward_fn, timeout_s=cfg.reward.timeout_s,
                                            failure_score=cfg.reward.failure_score, max_workers=cfg.reward.workers,
                                            metrics=service_metrics(cfg.data.style_schedule), max_abs_score=cfg.reward.max_abs)
        G = cfg.rollout.group_size
        workflow = self.workflow = build_workflow(cfg, self.tokenizer, self.reward_service, version=version)
        eta = cfg.asynchronous.eta
        B = cfg.trainer.batch_size * G
        staleness = StalenessManager(batch_size=B, eta=eta, max_concurrent=max(cfg.rollout.max_concurrent, G))
        self.buffer = TrajectoryBuffer(eta, on_drop=staleness.on_drop)
        self.controller = RolloutController(
            self.engine, workflow,
            with_style_schedule(DataStream(train_samples, seed=cfg.data.shuffle_seed), cfg.data,
                                lambda: self.controller.version),  # data.style_schedule
            staleness, self.buffer,
            group_size=G, filter_all_equal=cfg.rollout.filter_all_equal,
            max_filtered_in_a_row=cfg.rollout.max_filtered_in_a_row, priority=cfg.rollout.priority,
            max_engine_waiting=cfg.rollout.max_engine_waiting, version=version, on_skip=self._on_skip,
            wait_for_expiring=cfg.asynchronous.wait_for_expiring,
            expiring_wait_s=cfg.asynchronous.expiring_wait_s)
        self.controller.stats.prompts_too_long = n_too_long
        self.controller.set_warmup_batches(warmup_batches)
        if controller_state is not None:
            self.controller.restore(controller_state, version)
        return {"pid": os.getpid(), "node": _node_ip(), "version": version, "model_seconds": model_s,
                "engine_pids": engine_pids}

    def _on_skip(self, sample, why: str) -> None:
        with self._skips_lock:
            self._skips.append({"sample": sample.id, "reason": why})

    def ready(self) -> int:
        """The actor's process id (a liveness check)."""
        return os.getpid()

    def drain(self) -> tuple[list[dict], list[dict]]:
        """The log records and skipped-prompt events since the previous call (both emptied)."""
        with self._skips_lock:
            skips, self._skips = self._skips, []
        return self._logs.take(), skips

    # ------------------------------------------------------------------ the rollout port
    def next_batch(self, n: int, version: int, wait_s: float):
        """Wait up to ``wait_s`` seconds for ``n`` trajectories admissible at trainer ``version``
        (the same rule as :func:`~conveyor.rollout.controller.wait_for_batch`); the batch leaves
        with its old-log-prob patches attached, or None when none is ready in time."""
        deadline = time.monotonic() + wait_s
        while True:
            batch = self.controller.take_batch(n, version)
            if batch is not None:
                return self.controller.hand_out(batch)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.buffer.wait_for(n, timeout=min(left, 0.2))
            if self.buffer.size() >= n:  # enough but not admissible (e.g. group sizes): do not spin
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def next_batch_with_snapshot(self, n: int, version: int, wait_s: float):
        """:meth:`next_batch`, and when a batch leaves, the controller's :meth:`snapshot` taken
        right after it (``(batch, snapshot)``, or ``(None, None)``): the state a restarted actor
        continues from, consistent with what the driver has received (nothing handed out is in
        it, nothing buffered is missing)."""
        batch = self.next_batch(n, version, wait_s)
        if batch is None:
            return None, None
        return batch, self.controller.snapshot()

    def set_version(self, version: int) -> None:
        """:meth:`RolloutController.set_version`."""
        self.controller.set_version(version)

    def buffered(self) -> list:
        """The buffered trajectories (copies on arrival in the driver)."""
        return [t for g in self.buffer.snapshot() for t in g]

    def apply_old_logprobs(self, patches: list) -> int:
        """:meth:`RolloutController.apply_old_logprobs`."""
        return self.controller.apply_old_logprobs(patches)

    def counters(self) -> dict[str, float]:
        """:meth:`RolloutController.counters`."""
        return self.controller.counters()

    def take_not_trained(self) -> list[dict]:
        """:meth:`RolloutController.take_not_trained`."""
        return self.controller.take_not_trained()

    # ------------------------------------------------------------------ the controller
    def controller_start(self) -> None:
        """Start admitting episodes."""
        self.controller.start()

    def controller_stop(self, timeout: float = 30.0) -> None:
        """:meth:`RolloutController.stop`."""
        if self.controller is not None:
            self.controller.stop(timeout)

    def controller_error(self) -> BaseException | None:
        """The controller's error (its own type when it pickles), or None."""
        return _picklable_error(self.controller.error)

    def controller_stats(self):
        """The controller's :class:`~conveyor.rollout.controller.ControllerStats` (a copy)."""
        import copy

        return copy.copy(self.controller.stats)

    def snapshot(self) -> dict:
        """:meth:`RolloutController.snapshot` (the checkpoint's ``state["controller"]``)."""
        return self.controller.snapshot()

    def restore(self, state: dict, version: int) -> None:
        """:meth:`RolloutController.restore`."""
        self.controller.restore(state, version)

    def set_warmup_batches(self, n: int) -> None:
        """:meth:`RolloutController.set_warmup_batches`."""
        self.controller.set_warmup_batches(n)

    def set_eta(self, eta: int | None) -> None:
        """:meth:`RolloutController.set_eta`."""
        self.controller.set_eta(eta)

    def set_runtime_state(self, state: dict) -> None:
        """:meth:`RolloutController.set_runtime_state`."""
        self.controller.set_runtime_state(state)

    # ------------------------------------------------------------------ the engine
    def engine_version(self) -> int:
        """The engine's policy version."""
        return self.engine.version

    def engine_call(self, name: str, *args, **kwargs):
        """``engine.<name>(*args, **kwargs)`` for the control plane (start, stop, pause, resume,
        stats, partial_requests, score_old_logprobs)."""
        if name not in ("start", "stop", "pause", "resume", "stats", "partial_requests", "score_old_logprobs"):
            raise ValueError(f"engine_call: {name!r} is not a control-plane method")
        return getattr(self.engine, name)(*args, **kwargs)

    def update_weights(self, update, version: int | None = None) -> int:
        """Apply a :class:`~conveyor.sync.WeightUpdate` (or ``[its object reference]``, the
        driver's ``ray.put``: engine actors then read that same object), waiting until every
        engine has it.

        Args:
            update: The update, or ``[its object reference]``.
            version: Its version, given by a driver that may retry the call after a timeout
                (``runtime.sync_retries``): a call for a version already applied or being
                applied joins that attempt's outcome instead of applying it again.

        Returns:
            The version applied.
        """
        fut: concurrent.futures.Future | None = None
        if version is not None:
            with self._sync_lock:
                fut = self._syncs.get(version)
                if fut is not None:  # a retry: the first attempt's outcome
                    log.warning("weight update to version %d asked again (a retry after a timeout in the driver): "
                                "joining the attempt under way", version)
                    owner = False
                else:
                    fut = self._syncs[version] = concurrent.futures.Future()
                    owner = True
                    for old in [v for v in self._syncs if v < version - 4]:  # (a few kept)
                        del self._syncs[old]
            if not owner:
                return fut.result()
        try:
            if isinstance(update, list):
                import ray

                ref = update[0]
                update = ray.get(ref)
                if self._refs is not None:
                    self._refs.remember(update, ref)
            self.engine.update_weights(update)
        except BaseException as e:
            if fut is not None:
                fut.set_exception(e)
            raise
        if fut is not None:
            fut.set_result(update.version)
        return update.version

    def generate(self, prompt_ids: list[int], params, timeout_s: float | None = None):
        """One generation (on one of the engines), waited for at most ``timeout_s`` seconds."""
        return asyncio.run(asyncio.wait_for(self.engine.generate(prompt_ids, params), timeout_s))

    def evaluate(self, samples: list, kwargs: dict):
        """:func:`conveyor.eval.evaluate` with this actor's engine, tokenizer and reward service
        (``kwargs``: its keyword arguments, without ``progress`` / ``reward_service``)."""
        from conveyor.eval import evaluate

        return evaluate(self.engine, self.tokenizer, samples, progress=False, reward_service=self.reward_service,
                        **kwargs)

    def _remote_engines_setup(self, cfg, weights, version: int):
        """``rollout.engine=vllm`` / ``sglang`` in this actor: one engine per ``rollout.num_engines``,
        each owning its vLLM server (started here, on this actor's node; its log and weight files
        in temporary files) or on ``rollout.vllm.url`` / ``rollout.sglang.url``, started and given
        ``weights``; an :class:`~conveyor.rollout.engine.router.EngineRouter` over several (group
        affinity, weights to every server). Returns ``(engine, pids, seconds)``."""
        from conveyor.models import load_tokenizer
        from conveyor.rollout.engine.router import EngineRouter
        from conveyor.runtime.inline import make_remote_engine

        t0 = time.perf_counter()
        self.tokenizer = load_tokenizer(cfg.model.name)
        n = cfg.rollout.num_engines
        engines = [make_remote_engine(cfg, self.tokenizer, version=version, index=i, run_dir=None) for i in range(n)]
        self._remote = engines
        try:
            for e in engines:
                e.start()
                if hasattr(e, "load_weights"):
                    e.load_weights(weights)  # the trainer's exact parameters, also on a resume
        except BaseException:
            self._close_remote()
            raise
        pids = [os.getpid()] + [e.server.pid for e in engines if getattr(e, "server", None) is not None]
        engine = engines[0] if n == 1 else EngineRouter(engines, restart=None, max_batch_size=cfg.rollout.max_batch_size)
        return engine, pids, time.perf_counter() - t0

    def _close_remote(self) -> None:
        for e in getattr(self, "_remote", []):
            try:
                e.close()  # an owned server stops with it
            except Exception:
                log.exception("closing a remote engine")
        self._remote = []

    def close_rewards(self) -> None:
        """Close the reward service (its worker processes)."""
        if self.reward_service is not None:
            self.reward_service.close()

    def close(self) -> None:
        """Stop the controller and the engine, close the workflow (e.g. the OpenAI-compatible
        endpoint of ``env.name=openai:...``) and the reward service (idempotent)."""
        close_workflow = getattr(self.workflow, "close", None)
        for f in (self.controller_stop, lambda: self.engine is not None and self.engine.stop(),
                  lambda: close_workflow is not None and close_workflow(), self.close_rewards, self._kill_engines,
                  self._close_remote):
            try:
                f()
            except Exception:
                log.exception("closing the rollout actor")

    def _kill_engines(self) -> None:
        if self._engine_actors:
            import ray

            actors, self._engine_actors = self._engine_actors, []
            for a in actors:
                try:
                    ray.kill(a)
                except Exception:  # already gone
                    pass


def _node_ip() -> str | None:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return None


# ---------------------------------------------------------------------- the driver's side
class _Handle:
    """Calls on the actor with a timeout, Ray's errors turned into :class:`RolloutActorError`;
    the actor's forwarded log records and skip events go to the driver's loggers."""

    def __init__(self, actor, timeout_s: float, logger=None):
        self.ray = require_ray()
        self.actor = actor
        self.timeout_s = timeout_s
        self.logger = logger  # the run's MetricsLogger (skip events), or None
        self.dead: str | None = None
        self.generation = 0  # incremented by every restart (a call knows which actor it talked to)
        # calls other than the batch wait, and their seconds (the runtime's per-step overhead)
        self.calls = 0
        self.call_seconds = 0.0
        self._count_lock = threading.Lock()
        self.reviver: _ActorReviver | None = None  # restarts a dead actor (build_ray_rollout)

    def call(self, method: str, *args, timeout: float | None = None, passthrough: tuple = (), **kwargs):
        """``actor.<method>(*args, **kwargs)``, waited for at most ``timeout`` seconds
        (default ``runtime.call_timeout_s``).

        Raises:
            RolloutActorError: the actor raised (its message), died, or timed out.
            An exception of a ``passthrough`` type raised in the actor, as itself.
        """
        ray = self.ray
        timeout = self.timeout_s if timeout is None else timeout
        if self.dead is not None:
            raise RolloutActorError(f"{self.dead}; {method}() was not called")
        generation = self.generation
        t0 = time.perf_counter()
        try:
            ref = getattr(self.actor, method).remote(*args, **kwargs)
            out = ray.get(ref, timeout=timeout)
            if method not in _NOT_PER_STEP_OVERHEAD:
                with self._count_lock:
                    self.calls += 1
                    self.call_seconds += time.perf_counter() - t0
            return out
        except ray.exceptions.GetTimeoutError:
            raise RolloutActorTimeout(f"the rollout actor did not answer {method}() within {timeout:.0f} s "
                                      "(runtime.call_timeout_s); stopping rather than waiting forever") from None
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, passthrough):
                raise cause from None
            log.error("rollout actor: %s() failed:\n%s", method, e, extra={"console": False})
            what = f"{type(cause).__name__}: {cause}" if cause is not None else str(e).splitlines()[0]
            raise RolloutActorError(f"rollout actor: {method}() failed: {what}") from cause
        except ray.exceptions.RayActorError as e:
            first = str(e).strip().splitlines()
            why = f"the rollout actor died during {method}(): {' '.join(first[:3]) if first else type(e).__name__}"
            if self.reviver is not None and self.reviver.revive(generation, method, why):
                if method in _NOT_REPEATED_AFTER_RESTART:
                    return None
                return self.call(method, *args, timeout=timeout, passthrough=passthrough, **kwargs)
            # every later call repeats this (the first caller may have swallowed it, e.g. stats())
            self.dead = why
            raise RolloutActorError(self.dead) from None
        except ray.exceptions.RayError as e:
            raise RolloutActorError(f"rollout actor: {method}(): {type(e).__name__}: {e}") from None

    def forward(self, timeout: float | None = None) -> None:
        """Re-emit the actor's log records in the driver (``train.log``) and log its skipped
        prompts as ``prompt_too_long`` events (best effort: errors are ignored)."""
        if self.dead is not None:
            return
        try:
            records, skips = self.call("drain", timeout=timeout)
        except RolloutActorError:
            return
        for r in records:
            r = dict(r)
            r["msg"] = "[rollout actor] " + r["msg"]
            rec = logging.makeLogRecord({**r, "args": None, "exc_info": None})
            logging.getLogger(r["name"]).handle(rec)
        if self.logger is not None:
            for s in skips:
                self.logger.event("prompt_too_long", sample=s["sample"], reason=s["reason"])


class RayRollout:
    """The :class:`~conveyor.runtime.step.RolloutPort` over a :class:`RolloutActor`, plus what
    the training loop and checkpoints use of the controller (``start``, ``stop``, ``error``,
    ``stats``, ``snapshot``, ``restore``, ``set_warmup_batches``, ``counters``,
    ``take_not_trained``): :attr:`~conveyor.runtime.inline.RolloutSide.rollout` and
    ``.controller`` of a Ray run.

    Args:
        handle: The actor's :class:`_Handle`.
        poll_s: Seconds one :meth:`next_batch` call waits in the actor before the driver checks
            ``stop`` and ``health`` again.
    """

    def __init__(self, handle: _Handle, poll_s: float = 0.5):
        self._h = handle
        self.poll_s = poll_s
        self._last_stats = None
        self._calls_read = (0, 0.0)  # (calls, seconds) at the previous counters()

    # the port
    def next_batch(self, n: int, version: int, *, health=None, stop=None):
        """Block until ``n`` trajectories admissible at trainer ``version`` are ready (waiting
        in the actor ``poll_s`` at a time); None when ``stop`` is set first. ``health`` is
        called between waits.

        Raises:
            RolloutActorError: the actor failed; whatever ``health`` raises.
        """
        while True:
            wait = 0.0 if stop is not None and stop.is_set() else self.poll_s
            reviver = self._h.reviver
            if reviver is None:
                batch = self._h.call("next_batch", n, version, wait, timeout=wait + self._h.timeout_s)
            else:  # the state a restarted actor continues from, taken with the hand-out
                batch, snap = self._h.call("next_batch_with_snapshot", n, version, wait,
                                           timeout=wait + self._h.timeout_s) or (None, None)
                if snap is not None:
                    reviver.snapshot = snap
            if batch is not None:
                return batch
            if stop is not None and stop.is_set():
                return None
            if health is not None:
                health()

    def set_version(self, version: int) -> None:
        """The engine now samples ``version``."""
        self._h.call("set_version", version)

    def buffered(self) -> list:
        """Copies of the buffered trajectories."""
        return self._h.call("buffered")

    def apply_old_logprobs(self, patches: list) -> None:
        """Deliver old-log-prob patches to the actor's book."""
        self._h.call("apply_old_logprobs", list(patches))

    def counters(self) -> dict[str, float]:
        """The controller's counters (and the actor's log records forwarded), plus the runtime's
        own: ``runtime/actor_calls`` and ``runtime/actor_call_s``, the calls to the actor since
        the previous read (one step) and their seconds, the batch wait, set-up, evaluations and
        shutdown excepted (the Ray runtime's per-step overhead; calls from other threads
        included)."""
        self._h.forward()
        out = dict(self._h.call("counters"))
        h = self._h
        with h._count_lock:
            out["runtime/actor_calls"] = float(h.calls - self._calls_read[0])
            out["runtime/actor_call_s"] = h.call_seconds - self._calls_read[1]
            self._calls_read = (h.calls, h.call_seconds)
        return out

    def take_not_trained(self) -> list[dict]:
        """Trajectories dropped since the previous call."""
        return self._h.call("take_not_trained")

    def training_ended(self) -> None:
        """Nothing runs for future batches on a Ray rollout (no off-update reference scoring)."""

    # the controller
    def start(self) -> None:
        """Start the controller in the actor."""
        if self._h.reviver is not None:
            self._h.reviver.started = True  # a restarted actor starts its controller too
        self._h.call("controller_start")

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the controller (tolerant: an actor already gone is only logged). From here on a
        dead actor is not restarted."""
        if self._h.reviver is not None:
            self._h.reviver.active = False
        try:
            self._h.call("controller_stop", timeout, timeout=timeout + self._h.timeout_s)
        except RolloutActorError as e:
            log.warning("stopping the rollout controller: %s", e, extra={"console": False})
        self._h.forward(timeout=10.0)

    @property
    def error(self) -> BaseException | None:
        """The controller's error (its type kept when it pickles), or None.

        Raises:
            RolloutActorError: the actor itself is gone or does not answer.
        """
        err = self._h.call("controller_error")
        if err is not None:
            self._h.forward(timeout=10.0)  # the traceback into train.log before the run stops
        return err

    @property
    def stats(self):
        """The controller's :class:`~conveyor.rollout.controller.ControllerStats` (the last one
        read when the actor is gone)."""
        try:
            self._last_stats = self._h.call("controller_stats")
        except RolloutActorError:
            if self._last_stats is None:
                raise
        return self._last_stats

    def snapshot(self) -> dict:
        """The controller's checkpointable state (the inline runtime's format).

        Raises:
            RolloutActorError: the actor is gone (the checkpoint cannot be written).
        """
        return self._h.call("snapshot")

    def restore(self, state: dict, version: int) -> None:
        """Restore a snapshot in the actor (before :meth:`start`)."""
        self._h.call("restore", state, version)

    def set_warmup_batches(self, n: int) -> None:
        """Critic warm-up batches consumed so far."""
        self._h.call("set_warmup_batches", n)

    def set_eta(self, eta: int | None) -> None:
        """Change the staleness bound in the actor (capacity rule and buffer)."""
        if self._h.reviver is not None:
            self._h.reviver.eta = (eta,)  # a restarted actor gets it too
        self._h.call("set_eta", eta)

    def set_runtime_state(self, state: dict) -> None:
        """Runtime state to keep in the actor's checkpoint snapshots."""
        self._h.call("set_runtime_state", dict(state))

    def hand_out(self, batch: list) -> list:
        """Batches already leave the actor with their patches attached (:meth:`next_batch`)."""
        return batch


class RayEngine:
    """The :class:`~conveyor.rollout.engine.Engine` of a :class:`RolloutActor`, from the driver:
    the control plane as remote calls, weights through the object store, the
    ``score_old_logprobs`` capability executed in the actor, and ``generate`` (one remote call
    per generation, awaitable).

    Args:
        handle: The actor's :class:`_Handle`.
        wire_dtype: The dtype local updates are cast to before ``ray.put`` (the engines' dtype
            when they run bf16: half the bytes, the same weights in the engine), or None.
        sync_timeout_s: Seconds one weight update may take before it is retried (None: the
            handle's timeout, ``runtime.call_timeout_s``).
        sync_retries: Further attempts of an update that timed out.
    """

    def __init__(self, handle: _Handle, wire_dtype=None, *, sync_timeout_s: float | None = None,
                 sync_retries: int = 1):
        self._h = handle
        self.wire_dtype = wire_dtype
        self.sync_timeout_s = sync_timeout_s
        self.sync_retries = sync_retries
        self._last_stats: dict | None = None
        self._offset: dict[str, float] = {}  # the counters of engines that died (restarts)

    def carry_counters(self) -> None:
        """The actor was restarted: the dead engine's cumulative counters (the last ones read)
        are added to the new engine's, so busy seconds and token counts never go backwards."""
        if self._last_stats is not None:
            self._offset = {k: v for k, v in self._last_stats.items() if k in CUMULATIVE_ENGINE_STATS}

    @property
    def version(self) -> int:
        """The engine's policy version."""
        return self._h.call("engine_version")

    def start(self) -> None:
        """Start the engine's decode thread."""
        self._h.call("engine_call", "start")

    def stop(self) -> None:
        """Stop the engine (tolerant: an actor already gone is only logged)."""
        try:
            self._h.call("engine_call", "stop")
        except RolloutActorError as e:
            log.warning("stopping the engine: %s", e, extra={"console": False})

    def pause(self) -> None:
        """Pause the engine (returns when the current forward pass has finished)."""
        self._h.call("engine_call", "pause")

    def resume(self) -> None:
        """Resume the engine."""
        self._h.call("engine_call", "resume")

    def stats(self) -> dict[str, Any]:
        """The engine's counters; the last ones read when the actor is gone (so the loop's
        bookkeeping after a failure never raises a second error).

        Raises:
            RolloutActorError: the actor never answered.
        """
        try:
            st = self._h.call("engine_call", "stats")
            for k, v in self._offset.items():
                st[k] = st.get(k, 0) + v
            self._last_stats = st
        except RolloutActorError:
            if self._last_stats is None:
                raise
            log.warning("engine statistics: the rollout actor does not answer; using the last ones read",
                        extra={"console": False})
        return dict(self._last_stats)

    def update_weights(self, update, *, wait: bool = True) -> concurrent.futures.Future:
        """Send a :class:`~conveyor.sync.WeightUpdate`: ``ray.put`` once, the actor applies it
        between two decode steps.

        With ``wait``, an update not applied within ``sync_timeout_s`` is reported (a warning and
        a ``weight_sync_retry`` event) and asked again, ``sync_retries`` times; a retry joins the
        attempt still under way in the actor (:meth:`RolloutActor.update_weights` by version),
        so the weights are never applied twice.

        Returns:
            A future resolving to None when the engine has the weights (done when ``wait``).

        Raises:
            ValueError / KeyError / TypeError: the engine refused the update (as in the actor).
            RolloutActorError: the actor failed or died; RolloutActorTimeout: every attempt timed out.
        """
        ray = self._h.ray
        # passed as [ref]: the actor hands the same object to its engine actors (a trainer
        # actor's RemoteWeightUpdate: its own reference, never through this process)
        ref = weights_ref(ray, update, self.wire_dtype)
        if not wait:
            return self._h.actor.update_weights.remote([ref]).future()
        attempts = 1 + self.sync_retries
        for attempt in range(1, attempts + 1):
            try:
                self._h.call("update_weights", [ref], update.version, timeout=self.sync_timeout_s,
                             passthrough=(ValueError, KeyError, TypeError))
                break
            except RolloutActorTimeout:
                limit = self.sync_timeout_s or self._h.timeout_s
                if attempt == attempts:
                    raise RolloutActorTimeout(f"weight update to version {update.version}: not applied after "
                                              f"{attempts} attempt(s) of {limit:g} s (runtime.sync_timeout_s; "
                                              f"runtime.sync_retries={self.sync_retries}); stopping rather than "
                                              "waiting forever") from None
                log.warning("weight update to version %d: not applied within %g s; asking again (%d of %d)",
                            update.version, limit, attempt, attempts - 1)
                if self._h.logger is not None:
                    self._h.logger.event("weight_sync_retry", version=update.version, attempt=attempt, timeout_s=limit)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(None)
        return fut

    def partial_requests(self, *, require_pause: bool = True) -> list:
        """The engine's requests with tokens (copies), for old-log-prob scoring."""
        return self._h.call("engine_call", "partial_requests", require_pause=require_pause)

    def score_old_logprobs(self, spec, items, version: int | None = None):
        """The paused engine scores ``items`` with its own weights, in the actor
        (:meth:`InferenceEngine.score_old_logprobs`).

        Returns:
            ``(patches, tokens scored)``.
        """
        return self._h.call("engine_call", "score_old_logprobs", spec, list(items), version)

    async def generate(self, prompt_ids: Sequence[int], params=None):
        """Generate one response in the actor's engine; awaitable from any event loop.

        Raises:
            ValueError: an invalid prompt (as the engine raises it).
            RolloutActorError: the actor failed, died, or did not answer within
                ``runtime.call_timeout_s``.
        """
        h = self._h
        ref = h.actor.generate.remote(list(prompt_ids), params, h.timeout_s)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout=h.timeout_s + 5.0)
        except TimeoutError:
            raise RolloutActorError(f"the rollout actor did not answer generate() within {h.timeout_s:.0f} s") from None
        except h.ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, ValueError):
                raise cause from None
            raise RolloutActorError(f"rollout actor: generate() failed: {type(cause).__name__}: {cause}") from cause
        except h.ray.exceptions.RayError as e:
            raise RolloutActorError(f"rollout actor: generate(): {type(e).__name__}: {e}") from None


class RayRewardService:
    """The actor's reward service as the driver sees it: only ``close`` (rewards and answer
    checks run in the actor)."""

    def __init__(self, handle: _Handle):
        self._h = handle

    def close(self) -> None:
        """Close the actor's reward workers (tolerant: an actor already gone is only logged)."""
        try:
            self._h.call("close_rewards")
        except RolloutActorError as e:
            log.warning("closing the reward service: %s", e, extra={"console": False})


def _actor_env(faults: bool = True) -> dict[str, str]:
    env = forwarded_env()
    value = os.environ.get(ACTOR_FAULTS_ENV)
    if faults and value is not None:
        env["CONVEYOR_FAULTS"] = value
        if STALL_ENV in os.environ:
            env[STALL_ENV] = os.environ[STALL_ENV]
    return env


def start_rollout_actor(runtime_cfg, *, logger=None, faults: bool = True):
    """Create a :class:`RolloutActor` on the connected cluster (not set up yet) and wait until
    it answers.

    Args:
        runtime_cfg: The :class:`~conveyor.config.RuntimeConfig` (``rollout_num_cpus``,
            ``call_timeout_s``).
        logger: The run's :class:`~conveyor.runlog.MetricsLogger` (skip events), or None.
        faults: Pass the driver's ``CONVEYOR_ACTOR_FAULTS`` on (chaos tests: a restarted actor
            does not get it, so a fault fires in the first actor only).

    Returns:
        ``(actor handle, _Handle)``.

    Raises:
        RolloutActorError: the actor did not start (no CPUs free: the message says how many it
            asked for, and the timeout).
    """
    ray = require_ray()
    env = _actor_env(faults)
    opts: dict[str, Any] = {"num_cpus": runtime_cfg.rollout_num_cpus, "max_concurrency": 16,
                            "name": f"conveyor-rollout-{os.getpid()}-{uuid.uuid4().hex[:8]}"}
    if env:
        opts["runtime_env"] = {"env_vars": env}
    actor = ray.remote(RolloutActor).options(**opts).remote(collect_logs=True)
    handle = _Handle(actor, runtime_cfg.call_timeout_s, logger)
    try:
        handle.call("ready")
    except RolloutActorError as e:
        ray.kill(actor)
        raise RolloutActorError(f"{e} (the actor asks for runtime.rollout_num_cpus={runtime_cfg.rollout_num_cpus} "
                                f"CPUs of the cluster's {ray.cluster_resources().get('CPU', 0):g})") from None
    return actor, handle


_NOT_REPEATED_AFTER_RESTART = frozenset({"update_weights", "controller_start"})
"""Calls not repeated on a restarted actor: it was built from the trainer's current weights and
starts its controller itself."""

_NOT_PER_STEP_OVERHEAD = frozenset({"next_batch", "next_batch_with_snapshot", "setup", "ready", "evaluate", "close",
                                    "close_rewards"})
"""Calls not counted as the runtime's per-step overhead (``runtime/actor_call_s``): the batch wait
is waiting; set-up, evaluations and shutdown are phases of their own."""

class _ActorReviver:
    """Restarts a dead :class:`RolloutActor` (``runtime.max_actor_restarts`` times per run) and
    continues from the last consistent state (issue 12, section 3, "Faults").

    The state: the controller snapshot the actor returned with the last batch it handed out
    (:meth:`RolloutActor.next_batch_with_snapshot`; before the first batch: the resume state or
    a fresh start). It holds the data cursor with the episodes then in flight re-queued first,
    the buffered groups and the staleness counters, exactly what a checkpoint holds, so the new
    actor continues as a resume at the trainer's current version would
    (:meth:`~conveyor.rollout.controller.RolloutController.restore`): every episode in flight at
    the death or started since the snapshot is generated again (resubmitted) from its sample,
    nothing handed out is handed out again, nothing buffered is lost. The new engine starts from
    the trainer's current weights (``ray.put`` once).

    Not restarted: a run whose proximal method tracks partial requests (``partial_sync``,
    ``dedicated``: their old-log-prob patches delivered after the snapshot would be lost), an
    actor that dies while it is being set up, and after the controller was stopped (the run is
    ending).

    Thread-safe: the first caller that sees the death restarts; a call that talked to an actor
    already replaced just retries.
    """

    def __init__(self, handle: _Handle, cfg, trainer, train_samples, *, engine_threads: int, logger,
                 n_too_long: int, state: dict | None):
        self.h = handle
        self.cfg = cfg
        self.trainer = trainer
        self.train_samples = list(train_samples)
        self.engine_threads = engine_threads
        self.logger = logger
        self.n_too_long = n_too_long
        self.max_restarts = cfg.runtime.max_actor_restarts
        self.restarts = 0
        self.snapshot: dict | None = None if state is None else state["controller"]
        self.started = False  # the controller was started (a new actor starts its own)
        self.active = False  # after the setup, until the controller is stopped
        self.eta: tuple | None = None  # (eta,) once the run's steering changed it
        self.engine: RayEngine | None = None  # its counters carried over a restart
        self.lock = threading.RLock()

    def revive(self, generation: int, method: str, why: str) -> bool:
        """Restart the actor that died under ``generation`` (a no-op returning True when another
        caller already did).

        Returns:
            True when a live actor is there now (retry the call), False when the death stands
            (restarts used up, restarts not allowed now, or the restart itself failed: logged).
        """
        with self.lock:
            if self.h.generation != generation:
                return True
            if not self.active or self.restarts >= self.max_restarts:
                if self.active:
                    log.error("%s; not restarted: runtime.max_actor_restarts=%d used up", why, self.max_restarts)
                return False
            from conveyor.runtime.publish import tracks_partials

            if tracks_partials(self.trainer.proximal):
                log.error("%s; not restarted: proximal.method=%s keeps old-log-prob patches in the actor",
                          why, self.trainer.proximal.name)
                return False
            self.active = False  # the setup below must not restart recursively
            t0 = time.perf_counter()
            inflight = 0 if self.snapshot is None else int(self.snapshot.get("inflight", 0))
            log.warning("%s; restarting it (%d of runtime.max_actor_restarts=%d) from the state of its last "
                        "hand-out at trainer version %d", why, self.restarts + 1, self.max_restarts, self.trainer.version)
            try:
                self.h.ray.kill(self.h.actor)
            except Exception:  # already gone
                pass
            fresh = None
            try:
                actor, fresh = start_rollout_actor(self.cfg.runtime, logger=self.logger, faults=False)
                weights = weights_ref(self.h.ray, self.trainer.weight_update(), wire_dtype(self.cfg))
                info = fresh.call("setup", self.cfg, self.train_samples, [weights], engine_threads=self.engine_threads,
                                  track_partials=False, warmup_batches=self.trainer.critic_warmup_done,
                                  n_too_long=self.n_too_long, controller_state=self.snapshot)
                if self.eta is not None:
                    fresh.call("set_eta", self.eta[0])
                if self.started:
                    fresh.call("controller_start")
            except Exception as e:  # the death stands, with why the restart failed
                log.error("%s; the restart failed: %s", why, e)
                if fresh is not None:
                    fresh.forward(timeout=10.0)  # the new actor's setup log into train.log
                    self.h.ray.kill(actor)  # with its engine actors (owned by it)
                    fresh = None
                return False
            finally:
                if fresh is not None:
                    fresh.forward(timeout=10.0)  # the new actor's setup log into train.log
            if self.engine is not None:
                self.engine.carry_counters()
            self.h.actor = actor
            self.h.dead = None
            self.h.generation += 1
            self.restarts += 1
            self.active = True
            if self.logger is not None:
                self.logger.event("actor_restarted", reason=why, restarts=self.restarts, method=method,
                                  version=self.trainer.version, resubmitted_in_flight=inflight,
                                  actor_pid=info["pid"], seconds=time.perf_counter() - t0)
            return True


def build_ray_rollout(cfg, trainer, train_samples, *, engine_threads: int, logger, ctx, n_too_long: int = 0,
                      state: dict | None = None):
    """The Ray runtime's :class:`~conveyor.runtime.inline.RolloutSide`: connect to (or start) a
    Ray cluster, start a :class:`RolloutActor`, hand it the trainer's current weights through
    the object store and build the rollout side in it (restored from ``state`` on a resume),
    and bind the proxies. Everything is registered on ``ctx`` to be released however the run
    ends (the actor killed, a cluster this call started shut down).

    Args:
        cfg: The run's :class:`~conveyor.config.TrainConfig` (``runtime.*``).
        trainer: The :class:`~conveyor.trainer.trainer.Trainer` (its version, weights, proximal
            strategy).
        train_samples: The training samples.
        engine_threads: Intra-op threads of the actor's engine.
        logger: The run's :class:`~conveyor.runlog.MetricsLogger`.
        ctx: The :class:`~conveyor.rundir.RunContext`.
        n_too_long: Prompts dropped by the preflight.
        state: The checkpoint's ``state.pt`` contents when resuming.

    Returns:
        A :class:`~conveyor.runtime.inline.RolloutSide` whose engine, controller, rollout port and
        reward service are proxies of the actor; ``evaluate`` runs in the actor.

    Raises:
        ImportError: Ray is missing. RuntimeError: the cluster cannot be started / joined.
        RolloutActorError: the actor cannot start or build (the actor's message, e.g. a reward
            module that does not import on the worker).
    """
    from conveyor.runtime.inline import RolloutSide, resolve_engine_dtype
    from conveyor.runtime.publish import publisher_for, tracks_partials

    cfg = resolve_engine_dtype(cfg, trainer.bf16)  # the actor builds its engine from the resolved value
    ray = require_ray()
    if not (cfg.runtime.trainer == "actor" and ray.is_initialized()):  # (the trainer actor's start connected)
        shutdown = connect_ray(cfg.runtime, min_cpus=run_cpus(cfg))
        if shutdown is not None:
            ctx.stack.callback(shutdown)
    actor, handle = start_rollout_actor(cfg.runtime, logger=logger)

    def close():
        try:
            handle.call("close", timeout=min(60.0, handle.timeout_s))
        except RolloutActorError as e:
            log.warning("closing the rollout actor: %s", e, extra={"console": False})
        handle.forward(timeout=10.0)
        handle.dead = handle.dead or "closed"
        ray.kill(handle.actor)  # the current one (a restart replaces it)

    ctx.stack.callback(close)
    t0 = time.perf_counter()
    wire = wire_dtype(cfg)
    if hasattr(trainer, "wire_dtype"):  # a trainer actor casts before its own put
        trainer.wire_dtype = wire
    weights = weights_ref(ray, trainer.weight_update(), wire)  # (runtime.trainer=actor: put by the trainer actor)
    try:
        info = handle.call("setup", cfg, list(train_samples), [weights], engine_threads=engine_threads,
                           track_partials=tracks_partials(trainer.proximal),
                           warmup_batches=trainer.critic_warmup_done, n_too_long=n_too_long,
                           controller_state=None if state is None else state["controller"],
                           engine_faults=os.environ.get(ENGINE_ACTOR_FAULTS_ENV))
    except RolloutActorError as e:
        raise RolloutActorError(
            f"{e} (the rollout actor builds the engine, rewards and workflow in a Ray worker process: "
            "reward.fn's module and model.name must be importable in the actor's process, i.e. installed "
            "or on PYTHONPATH on every node; a local cluster inherits this process's environment)") from e.__cause__
    finally:
        handle.forward(timeout=10.0)
    del weights
    reviver = None
    if cfg.runtime.max_actor_restarts > 0:  # else no snapshot per hand-out: nothing would use it
        reviver = _ActorReviver(handle, cfg, trainer, train_samples, engine_threads=engine_threads, logger=logger,
                                n_too_long=n_too_long, state=state)
        reviver.active = True
        handle.reviver = reviver
    logger.event("runtime", name="ray", actor_pid=info["pid"], actor_node=info["node"], address=cfg.runtime.address,
                 engine_pids=info["engine_pids"], trainer=cfg.runtime.trainer,
                 trainer_pid=getattr(trainer, "pid", os.getpid()), trainer_node=getattr(trainer, "node", None),
                 setup_seconds=time.perf_counter() - t0, cluster_cpus=ray.cluster_resources().get("CPU", 0))
    engine = RayEngine(handle, wire, sync_timeout_s=cfg.runtime.sync_timeout_s, sync_retries=cfg.runtime.sync_retries)
    if reviver is not None:
        reviver.engine = engine
    rollout = RayRollout(handle)
    B = cfg.trainer.batch_size * cfg.rollout.group_size

    def evaluate(engine_, tokenizer, samples, *, progress=False, reward_service=None, **kwargs):
        return handle.call("evaluate", list(samples), kwargs, timeout=cfg.runtime.eval_timeout_s)

    publisher = publisher_for(trainer.proximal, engine, rollout)
    return RolloutSide(engine, RayRewardService(handle), None, rollout, rollout, publisher, B, evaluate)
