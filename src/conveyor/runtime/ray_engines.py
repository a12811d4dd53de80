"""Engine actors of the Ray runtime (``rollout.num_engines`` > 1 with ``runtime.name=ray``;
issue 12, section 3: "rollout engines (N, each with its CPU / GPU share)").

Layout: the :class:`~conveyor.runtime.ray.RolloutActor` keeps engine 0 in its own process (as
with one engine) and starts engines 1 .. N-1 as :class:`EngineActor`\\ s, each a Ray actor
reserving ``runtime.engine_num_cpus`` CPUs (placed by Ray on any node of the cluster that has
them) with its own copy of the policy. The rollout actor's controller sees the N engines through
one :class:`~conveyor.rollout.engine.router.EngineRouter`, so the controller and the staleness
rule keep their exact semantics; an engine actor is reached through a :class:`RayEngineClient`
(the :class:`~conveyor.rollout.engine.Engine` protocol over actor calls).

Messages only: prompts in, :class:`~conveyor.rollout.engine.types.GenerationOutput` out;
weights as a :class:`~conveyor.sync.WeightUpdate` in the object store: the driver puts each
version once and the rollout actor hands the same object reference to every engine actor
(:class:`WeightRefs`), so a version travels through the object store once whatever N is.

Faults: a dead engine actor shows as :class:`~conveyor.rollout.engine.router.EngineDiedError`;
the router replaces it (``runtime.max_engine_restarts``) with a new actor built at the newest
weights and runs its in-flight requests again. Engine actors are owned by the rollout actor and
die with it; a restarted rollout actor starts new ones.

Chaos experiments: ``CONVEYOR_ENGINE_ACTOR_FAULTS`` in the driver's environment becomes
``CONVEYOR_FAULTS`` of the first engine actor (engine 1) only, not of its replacements.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from conveyor.rollout.engine.router import EngineDiedError

log = logging.getLogger(__name__)

__all__ = ["ENGINE_ACTOR_FAULTS_ENV", "EngineActor", "RayEngineClient", "WeightRefs", "build_local_engine",
           "start_engine_actors"]

ENGINE_ACTOR_FAULTS_ENV = "CONVEYOR_ENGINE_ACTOR_FAULTS"
"""Environment variable of the driver whose value becomes ``CONVEYOR_FAULTS`` of the first engine
actor (:mod:`conveyor.faults`; e.g. ``kill@generate#40``)."""

FORWARDED_ENV = ("CONVEYOR_CACHE", "OMP_WAIT_POLICY", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
"""Environment variables Ray actors get from the process that starts them (a cluster joined by
address does not inherit the driver's environment)."""


def forwarded_env() -> dict[str, str]:
    """This process's values of :data:`FORWARDED_ENV` (those set)."""
    return {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}


def build_local_engine(cfg, weights, *, seed_index: int, engine_threads: int, track_partials: bool):
    """An :class:`~conveyor.rollout.engine.InferenceEngine` in this process holding ``weights``
    (what :class:`~conveyor.runtime.ray.RolloutActor` and :class:`EngineActor` build).

    Args:
        cfg: The run's :class:`~conveyor.config.TrainConfig` (``model.*``, ``rollout.*``,
            ``lora.*``, ``run.seed``).
        weights: The trainer's :class:`~conveyor.sync.WeightUpdate`, applied to the model loaded
            from ``model.name`` / ``model.seed``. With LoRA it holds the merged adapted weights or
            the adapter factors, applied to that base model; with ``lora.sync=adapter`` the engine
            keeps the base weights of the adapted matrices to merge later adapters onto.
        seed_index: Index of its sampling seed (:func:`~conveyor.rollout.engine.router.engine_seed`):
            the engine's index, plus ``num_engines`` per replacement of that engine (a
            replacement draws other random streams than the engine it replaces).
        engine_threads: Intra-op threads of its decode thread.
        track_partials: Keep request tokens for old-log-prob scoring.

    Returns:
        ``(engine, tokenizer, model_seconds)``; the engine is not started.

    Raises:
        Whatever loading fails with (a model that is not there, a bad update).
    """
    from conveyor.models import load_model
    from conveyor.runtime.inline import make_engine

    t0 = time.perf_counter()
    lm = load_model(cfg.model.name, seed=cfg.model.seed, init=cfg.model.init)
    model = lm.model
    lora_base = None
    if cfg.lora.enabled:  # the base model from model.name (frozen under LoRA), the adapted weights on top
        from conveyor.sync import apply_update

        targets = dict(model.state_dict())
        lora_base = {n: targets[n].detach().clone() for n in weights.lora} or None
        apply_update(targets, weights, lora_base)
    else:
        model.load_state_dict(weights.state_dict())
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    model_s = time.perf_counter() - t0
    engine = make_engine(cfg, model, lm.tokenizer, version=weights.version, seed_index=seed_index,
                         engine_threads=engine_threads, track_partials=track_partials, lora_base=lora_base)
    return engine, lm.tokenizer, model_s


class WeightRefs:
    """The object reference of the newest weights, so that one version is put into the object
    store once and every engine actor reads the same object (only the newest is kept: older
    versions are released).

    Args:
        ray: The ``ray`` module.
    """

    def __init__(self, ray):
        self.ray = ray
        self._lock = threading.Lock()
        self._version: int | None = None
        self._ref = None

    def remember(self, update, ref) -> None:
        """``ref`` is the object holding ``update`` (put by the driver); kept unless a newer
        version is already known."""
        with self._lock:
            if self._version is None or update.version >= self._version:
                self._version, self._ref = update.version, ref

    def ref(self, update):
        """The object reference of ``update``: the remembered one for its version, else a
        ``ray.put`` (remembered when it is the newest)."""
        with self._lock:
            if update.version == self._version:
                return self._ref
            ref = self.ray.put(update)
            if self._version is None or update.version > self._version:
                self._version, self._ref = update.version, ref
            return ref


class EngineActor:
    """One inference engine in a Ray actor (an asyncio actor: its ``generate`` calls run
    concurrently on the actor's event loop, batched by the engine's decode thread).

    Used in-process it is an ordinary object (tests)."""

    def __init__(self):
        self.engine = None

    def setup(self, cfg, weights, *, seed_index: int, engine_threads: int, track_partials: bool = False) -> dict:
        """Build and start the engine holding ``weights`` (:func:`build_local_engine`;
        ``track_partials``: keep request tokens for old-log-prob scoring).

        Returns:
            ``{"pid", "version", "model_seconds"}``.
        """
        self.engine, _, model_s = build_local_engine(cfg, weights, seed_index=seed_index,
                                                     engine_threads=engine_threads, track_partials=track_partials)
        self.engine.start()
        return {"pid": os.getpid(), "version": self.engine.version, "model_seconds": model_s}

    def ready(self) -> int:
        """The actor's process id (a liveness check)."""
        return os.getpid()

    async def generate(self, prompt_ids: list[int], params, priority: int | None):
        """:meth:`InferenceEngine.generate`."""
        if priority is None:
            return await self.engine.generate(prompt_ids, params)
        return await self.engine.generate(prompt_ids, params, priority=priority)

    async def update_weights(self, update) -> int:
        """Apply ``update`` (resolved from its object reference by Ray) between two decode steps;
        returns its version when applied."""
        await asyncio.wrap_future(self.engine.update_weights(update, wait=False))
        return update.version

    async def control(self, name: str) -> None:
        """``engine.<name>()`` for start, stop, pause and resume (off the event loop: pause waits
        for the current forward pass)."""
        if name not in ("start", "stop", "pause", "resume"):
            raise ValueError(f"control: {name!r} is not start / stop / pause / resume")
        await asyncio.to_thread(getattr(self.engine, name))

    def stats(self) -> dict:
        """:meth:`InferenceEngine.stats`."""
        return self.engine.stats()

    def partial_requests(self, require_pause: bool) -> list:
        """:meth:`InferenceEngine.partial_requests`."""
        return self.engine.partial_requests(require_pause=require_pause)

    async def score_old_logprobs(self, spec, items: list, version: int | None):
        """:meth:`InferenceEngine.score_old_logprobs` (off the event loop: forward passes)."""
        return await asyncio.to_thread(self.engine.score_old_logprobs, spec, items, version)

    def version(self) -> int:
        """The engine's policy version."""
        return self.engine.version


def start_engine_actors(cfg, weights_ref, engines: Sequence[tuple[int, int, str | None]], *,
                        engine_threads: int, track_partials: bool = False) -> list[RayEngineClient]:
    """Create one :class:`EngineActor` per entry of ``engines`` on the connected cluster and
    build their engines from ``weights_ref`` (the object reference of a
    :class:`~conveyor.sync.WeightUpdate`), all at once.

    Args:
        cfg: The run's :class:`~conveyor.config.TrainConfig` (``runtime.engine_num_cpus``,
            ``runtime.call_timeout_s``).
        weights_ref: The weights' object reference.
        engines: ``(index, seed_index, faults)`` per actor: the engine's index (>= 1), the index
            of its sampling seed, and ``CONVEYOR_FAULTS`` for it (chaos experiments) or None
            (an inherited value is cleared).
        engine_threads: Intra-op threads of each decode thread.
        track_partials: The engines keep request tokens for old-log-prob scoring
            (``proximal.method=partial_sync`` / ``dedicated``).

    Returns:
        Started :class:`RayEngineClient` objects, in the order of ``engines``.

    Raises:
        EngineDiedError: an actor did not start and build within ``runtime.call_timeout_s`` (the
            message names the CPUs it asked for and the cluster's), or failed while building;
            every actor of the call is then killed.
    """
    import ray

    timeout = cfg.runtime.call_timeout_s
    actors, setups = [], []
    for index, seed_index, faults in engines:
        env = forwarded_env()
        env["CONVEYOR_FAULTS"] = faults or ""  # never the rollout actor's own chaos plan
        actor = ray.remote(EngineActor).options(
            num_cpus=cfg.runtime.engine_num_cpus, max_concurrency=1000, runtime_env={"env_vars": env},
            name=f"conveyor-engine{index}-{os.getpid()}-{uuid.uuid4().hex[:8]}").remote()
        actors.append(actor)
        setups.append(actor.setup.remote(cfg, weights_ref, seed_index=seed_index, engine_threads=engine_threads,
                                         track_partials=track_partials))
    try:
        infos = ray.get(setups, timeout=timeout)
    except Exception as e:
        for a in actors:
            ray.kill(a)
        if isinstance(e, ray.exceptions.GetTimeoutError):
            raise EngineDiedError(
                f"{len(actors)} engine actor(s) did not start within {timeout:.0f} s (runtime.call_timeout_s); each "
                f"asks for runtime.engine_num_cpus={cfg.runtime.engine_num_cpus} CPUs of the cluster's "
                f"{ray.cluster_resources().get('CPU', 0):g}") from None
        raise EngineDiedError(f"engine actor(s) {[i for i, _, _ in engines]} could not be built: {e}") from None
    clients = []
    for (index, _, _), actor, info in zip(engines, actors, infos, strict=True):
        log.info("engine actor %d: pid %s, model loaded in %.1f s", index, info["pid"], info["model_seconds"])
        clients.append(RayEngineClient(actor, index=index, version=info["version"], timeout_s=timeout, pid=info["pid"]))
    return clients


class RayEngineClient:
    """The :class:`~conveyor.rollout.engine.Engine` protocol over an :class:`EngineActor` (used
    by the rollout actor's :class:`~conveyor.rollout.engine.router.EngineRouter`).

    Args:
        actor: The actor handle.
        index: The engine's index (messages).
        version: The engine's version after its setup.
        timeout_s: Seconds a control call or a generation may take (``runtime.call_timeout_s``).
        refs: The rollout actor's :class:`WeightRefs` (one object per version), or None
            (``ray.put`` per update).
        pid: The actor's process id (logs).

    A dead actor raises :class:`~conveyor.rollout.engine.router.EngineDiedError` from every
    call (``stop`` only logs it); an actor that does not answer in ``timeout_s`` raises
    RuntimeError, never hangs.
    """

    def __init__(self, actor, *, index: int, version: int, timeout_s: float, refs: WeightRefs | None = None,
                 pid: int | None = None):
        import ray

        self.ray = ray
        self.actor = actor
        self.index = index
        self.pid = pid
        self.timeout_s = timeout_s
        self.refs = refs
        self._version = version
        self._lock = threading.Lock()

    def _error(self, method: str, e: BaseException) -> BaseException:
        ray = self.ray
        unavailable = getattr(ray.exceptions, "ActorUnavailableError", ())
        if unavailable and isinstance(e, unavailable):  # unreachable for now, not known dead
            return RuntimeError(f"engine actor {self.index} is unavailable during {method}(): {e}")
        if isinstance(e, ray.exceptions.RayActorError):
            return EngineDiedError(f"engine actor {self.index} died during {method}(): "
                                   f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")
        if isinstance(e, ray.exceptions.RayTaskError):
            cause = getattr(e, "cause", None)
            if isinstance(cause, (ValueError, KeyError, TypeError)):
                return cause
            return RuntimeError(f"engine actor {self.index}: {method}() failed: {type(cause).__name__}: {cause}")
        if isinstance(e, (ray.exceptions.GetTimeoutError, TimeoutError)):
            return RuntimeError(f"engine actor {self.index} did not answer {method}() within {self.timeout_s:.0f} s "
                                "(runtime.call_timeout_s)")
        return e

    def _call(self, method: str, *args):
        try:
            return self.ray.get(getattr(self.actor, method).remote(*args), timeout=self.timeout_s)
        except Exception as e:
            raise self._error(method, e) from None

    @property
    def version(self) -> int:
        """The version of the newest weights the engine has applied."""
        return self._version

    supports_priority = True
    """The engine actor takes ``generate(..., priority=p)``."""

    def start(self) -> None:
        """Start the engine's decode thread."""
        self._call("control", "start")

    def stop(self) -> None:
        """Stop the engine (a dead actor is only logged)."""
        try:
            self._call("control", "stop")
        except EngineDiedError as e:
            log.warning("%s", e)

    def close(self) -> None:
        """Kill the actor (its engine and its CPUs released; idempotent)."""
        try:
            self.ray.kill(self.actor)
        except Exception as e:  # already gone
            log.debug("engine actor %d: kill: %s", self.index, e)

    def pause(self) -> None:
        """Pause the engine (returns when its current forward pass has finished)."""
        self._call("control", "pause")

    def resume(self) -> None:
        """Resume the engine."""
        self._call("control", "resume")

    def stats(self) -> dict[str, Any]:
        """The engine's counters (:meth:`InferenceEngine.stats`)."""
        return self._call("stats")

    def update_weights(self, update, *, wait: bool = True) -> concurrent.futures.Future:
        """Send ``update`` (its object reference from :class:`WeightRefs`: read from the object
        store by the actor, applied between two decode steps).

        Returns:
            A future resolving to None when applied (failing with EngineDiedError when the actor
            dies, ValueError / KeyError / TypeError when the engine refuses the update).
        """
        ref = self.refs.ref(update) if self.refs is not None else self.ray.put(update)
        out: concurrent.futures.Future = concurrent.futures.Future()
        inner = self.actor.update_weights.remote(ref).future()

        def done(f: concurrent.futures.Future) -> None:
            err = f.exception()
            if err is not None:
                out.set_exception(self._error("update_weights", err))
                return
            with self._lock:
                self._version = max(self._version, int(f.result()))
            out.set_result(None)

        inner.add_done_callback(done)
        if wait:
            try:
                out.result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError:
                raise RuntimeError(f"engine actor {self.index} did not apply weight version {update.version} within "
                                   f"{self.timeout_s:.0f} s (runtime.call_timeout_s)") from None
        return out

    def partial_requests(self, *, require_pause: bool = True) -> list:
        """The engine's requests with tokens (copies; the actor was set up with
        ``track_partials``), for old-log-prob scoring.

        Raises:
            RuntimeError: ``require_pause`` and the engine is running (as the engine raises it).
        """
        return self._call("partial_requests", require_pause)

    def score_old_logprobs(self, spec, items, version: int | None = None):
        """The paused engine actor scores ``items`` with its weights
        (:meth:`InferenceEngine.score_old_logprobs`).

        Returns:
            ``(patches, tokens scored)``.
        """
        return self._call("score_old_logprobs", spec, list(items), version)

    async def generate(self, prompt_ids: Sequence[int], params=None, *, priority: int | None = None):
        """One generation in the engine actor; awaitable from any event loop.

        Raises:
            ValueError: an invalid prompt (as the engine raises it).
            EngineDiedError: the actor died. RuntimeError: it failed or did not answer in time.
        """
        ref = self.actor.generate.remote(list(prompt_ids), params, priority)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout=self.timeout_s)
        except BaseException as e:
            if isinstance(e, (asyncio.CancelledError, TimeoutError)):
                try:  # the actor drops the request instead of generating it for nobody
                    self.ray.cancel(ref)
                except Exception:
                    pass
            if isinstance(e, asyncio.CancelledError):
                raise
            raise self._error("generate", e) from None
