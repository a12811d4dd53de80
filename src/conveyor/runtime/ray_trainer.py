"""The trainer in a Ray actor of its own (``runtime.trainer=actor``; issue 12, section 3).

docs/notes/scale_out_survey.md section 5.6's ``TrainerActor``: the policy, its optimizer and
schedule, the critic(s), the reference model and the proximal strategy's state live in a
:class:`TrainerActor` (``runtime.trainer_num_cpus`` CPUs; on a cluster, wherever Ray places it),
built there from ``model.name`` / ``model.seed`` exactly as the driver would build it
(:func:`~conveyor.trainer.trainer.build_trainer`; ``trainer.bf16=auto`` measured on the actor's
hardware). The driver keeps the loop (:func:`~conveyor.runtime.step.run_step`, unchanged), the
logs, checkpoints, evaluations and the export, and talks to the trainer through
:class:`RayTrainer`, a proxy with the members of :class:`~conveyor.trainer.trainer.Trainer` the
runtime uses. Messages only:

- ``train_step`` / ``critic_warmup_step``: the batch (:class:`~conveyor.types.Trajectory` list)
  in, the step's metrics out; the trainer's counters (version, warm-up) come back with every
  answer (and with an error: a non-finite step still counts), so reading them is not a call;
  so do the actor's log records (forwarded to the driver's ``train.log``);
- ``weight_update``: the actor ``ray.put``\\ s the :class:`~conveyor.sync.WeightUpdate` once (in
  the engines' dtype when they run bf16: :attr:`RayTrainer.wire_dtype`) and returns its
  reference as a :class:`RemoteWeightUpdate`; the rollout actor (and its engine actors) read
  that object directly, so the weights never pass through the driver;
- ``state_dict`` / ``load_state_dict``: the checkpoint's ``trainer.pt`` contents (CPU tensors),
  written and read by the driver as with a local trainer, so checkpoints of either placement
  resume under the other;
- ``inference_policy``: the plain model (LoRA merged) for the export and float32 evaluations,
  pickled to the driver; ``lora.save_adapter``: peft's files, written by the driver.

Faults: a trainer actor that dies (or raises) stops the run with a :class:`TrainerActorError`
naming the call. The final checkpoint needs the dead actor's state: when a periodic checkpoint of
the current version exists it is the final one, else the attempt fails (logged,
``checkpoint_failed``); either way the last periodic checkpoint is intact and ``conveyor train
--resume`` continues from it (under either placement). ``CONVEYOR_TRAINER_ACTOR_FAULTS`` in the
driver becomes the actor's ``CONVEYOR_FAULTS`` (:mod:`conveyor.faults`; e.g.
``kill@train_step#3``). The set-up waits at most ``runtime.call_timeout_s``; later calls have no
timeout (an update may take minutes): a dead actor process is reported by Ray at once, a hung
one (or an unreachable node) is not detected.

Not with this placement (refused by the configuration): ``trainer.world_size`` > 1 (the data
parallel processes are the driver's) and ``proximal.method=dedicated`` (its worker reads the
trainer's model in the trainer's process; also when ``auto`` picks it).
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["TRAINER_ACTOR_FAULTS_ENV", "RayTrainer", "RemoteWeightUpdate", "TrainerActor", "TrainerActorError",
           "start_trainer_actor", "weights_ref"]

TRAINER_ACTOR_FAULTS_ENV = "CONVEYOR_TRAINER_ACTOR_FAULTS"
"""Environment variable of the driver whose value becomes the trainer actor's ``CONVEYOR_FAULTS``."""

_CALLS = frozenset({"train_step", "critic_warmup_step", "take_events", "state_dict", "load_state_dict",
                    "scoring_spec", "scale_lr", "inference_policy", "proximal_extra_bytes", "save_adapter_files",
                    "weight_update"})
"""The trainer methods the driver may call through :meth:`TrainerActor.call`."""


class TrainerActorError(RuntimeError):
    """The trainer actor raised, or died; the message names the call (and the actor's message)."""


@dataclass(frozen=True)
class RemoteWeightUpdate:
    """A :class:`~conveyor.sync.WeightUpdate` held in Ray's object store by the trainer actor.

    Attributes:
        version: The policy version of the weights.
        ref: Ray's object reference of the ``WeightUpdate``.
        num_bytes: Its payload size (bytes).
    """

    version: int
    ref: Any
    num_bytes: int = 0


def weights_ref(ray, update, dtype=None) -> Any:
    """The object reference of ``update``: a :class:`RemoteWeightUpdate`'s own (the trainer
    actor cast it already), else one ``ray.put`` of the local
    :class:`~conveyor.sync.WeightUpdate`, cast to ``dtype`` first when given (the wire dtype:
    :meth:`~conveyor.sync.WeightUpdate.cast`)."""
    if isinstance(update, RemoteWeightUpdate):
        return update.ref
    return ray.put(update if dtype is None else update.cast(dtype))


class TrainerActor:
    """The run's :class:`~conveyor.trainer.trainer.Trainer` in a Ray actor (module docstring).

    Args:
        collect_logs: Keep this process's ``conveyor.*`` log records to return them with every
            :meth:`call` (true in the actor's process: they go to the driver's ``train.log``).
    """

    def __init__(self, collect_logs: bool = False):
        from conveyor.runtime.ray import _LogCollector

        self._logs = _LogCollector.for_actor(collect_logs)
        self.trainer = None

    def setup(self, cfg, *, bf16_choice: bool | None, threads: int) -> dict:
        """Load ``model.name`` and build the trainer (:func:`~conveyor.trainer.trainer.build_trainer`).

        Args:
            cfg: The run's :class:`~conveyor.config.TrainConfig`.
            bf16_choice: ``trainer.bf16=auto``'s recorded choice on a resume, or None.
            threads: Intra-op threads of the trainer (``torch.set_num_threads``).

        Returns:
            :meth:`info`.
        """
        import torch

        from conveyor.models import load_model
        from conveyor.trainer.trainer import build_trainer

        torch.set_num_threads(max(1, int(threads)))
        torch.manual_seed(cfg.run.seed)
        random.seed(cfg.run.seed)
        lm = load_model(cfg.model.name, seed=cfg.model.seed, init=cfg.model.init)
        self.trainer = build_trainer(cfg, lm.model, bf16_choice=bf16_choice)
        return self.info()

    def info(self) -> dict:
        """The trainer's counters and notes (what :class:`RayTrainer` reads without a call)."""
        t = self.trainer
        from conveyor.runtime.ray import _node_ip

        return {
            "pid": os.getpid(), "node": _node_ip(), "version": t.version, "log_step": t.log_step, "bf16": t.bf16,
            "precision_note": t.precision_note, "critic_note": t.critic_note, "proximal_note": t.proximal_note,
            "proximal_name": t.proximal.name, "needs_proximal": t.objective.needs_proximal,
            "has_critic": t.critic is not None, "critic_warmup_done": t.critic_warmup_done,
            "in_critic_warmup": t.in_critic_warmup,
            "lora": None if t.lora is None else {"note": t.lora.note, "trainable": t.lora.trainable},
            "settings_taken": list(t.settings_taken),
        }

    def call(self, method: str, *args, **kwargs) -> tuple[Any, dict, list[dict]]:
        """``trainer.<method>(*args, **kwargs)`` for the methods in ``_CALLS``
        (``weight_update``: :meth:`weight_update`).

        Returns:
            ``(result, info(), this process's log records since the last call)``.

        Raises:
            ValueError: a method not in the list. Whatever the trainer raises (e.g.
                :class:`~conveyor.trainer.trainer.NonFiniteLossError`), with the counters as the
                failure left them (``trainer_info``: a non-finite step still counts, the version
                moved) and the log records (``trainer_logs``) attached.
        """
        if method not in _CALLS:
            raise ValueError(f"TrainerActor.call: {method!r} is not one of {sorted(_CALLS)}")
        try:
            if method == "proximal_extra_bytes":
                out = self.trainer.proximal.extra_bytes()
            elif method == "save_adapter_files":
                out = self._adapter_files()
            elif method == "weight_update":
                out = self.weight_update(*args, **kwargs)
            else:
                out = getattr(self.trainer, method)(*args, **kwargs)
        except Exception as e:
            e.trainer_info = self.info()
            e.trainer_logs = self._logs.take()
            raise
        return out, self.info(), self._logs.take()

    def _adapter_files(self) -> dict[str, bytes]:
        with tempfile.TemporaryDirectory() as d:
            self.trainer.save_adapter(d)
            return {str(p.relative_to(d)): p.read_bytes() for p in Path(d).rglob("*") if p.is_file()}

    def weight_update(self, dtype=None) -> RemoteWeightUpdate:
        """The current parameters as a :class:`RemoteWeightUpdate` (``ray.put`` once, here; cast
        to ``dtype`` first when given: the engines' wire dtype)."""
        import ray

        upd = self.trainer.weight_update()
        if dtype is not None:
            upd = upd.cast(dtype)
        return RemoteWeightUpdate(upd.version, ray.put(upd), upd.num_bytes)


class RayTrainer:
    """The driver's proxy of a :class:`TrainerActor`: the members of
    :class:`~conveyor.trainer.trainer.Trainer` the runtime uses (module docstring).

    Args:
        actor: The actor handle.
        info: Its first :meth:`TrainerActor.info`.
    """

    def __init__(self, actor, info: dict):
        import ray

        self._ray = ray
        self.actor = actor
        self._info = info
        self._lock = threading.Lock()
        self.dead: str | None = None
        self.proximal = _ProximalView(self, info["proximal_name"])
        self.objective = _ObjectiveView(bool(info["needs_proximal"]))
        self.lora = None if info["lora"] is None else _LoraView(self, info["lora"])
        self.critic = True if info["has_critic"] else None  # (only ever tested against None)
        self.precision_note = info["precision_note"]
        self.critic_note = info["critic_note"]
        self.proximal_note = info["proximal_note"]
        self.bf16 = bool(info["bf16"])
        self.pid = info["pid"]
        self.node = info["node"]
        self.wire_dtype = None  # set by the Ray rollout side: the engines' dtype when it saves bytes

    # ------------------------------------------------------------------ counters (no call)
    @property
    def version(self) -> int:
        """Policy version (optimizer steps taken)."""
        return self._info["version"]

    @property
    def log_step(self) -> int:
        """The step the run's logs are at (the trainer's :attr:`~conveyor.trainer.trainer.Trainer.log_step`)."""
        return self._info["log_step"]

    @property
    def critic_warmup_done(self) -> int:
        """Critic warm-up steps taken."""
        return self._info["critic_warmup_done"]

    @property
    def in_critic_warmup(self) -> bool:
        """Whether the critic warm-up still runs."""
        return self._info["in_critic_warmup"]

    # ------------------------------------------------------------------ calls
    def _remote(self, method: str, *args, **kwargs):
        from conveyor.trainer.trainer import NonFiniteLossError

        ray = self._ray
        if self.dead is not None:
            raise TrainerActorError(f"{self.dead}; {method}() was not called")
        try:
            out, info, records = ray.get(self.actor.call.remote(method, *args, **kwargs))
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            self._emit(getattr(cause, "trainer_logs", []))  # (the actor's log of the failure first)
            info = getattr(cause, "trainer_info", None)
            if info is not None:
                with self._lock:
                    self._info = info
            if isinstance(cause, (NonFiniteLossError, ValueError, KeyError, TypeError)):
                raise cause from None  # the trainer's own error, as a local trainer raises it
            what = f"{type(cause).__name__}: {cause}" if cause is not None else str(e).splitlines()[0]
            raise TrainerActorError(f"trainer actor: {method}() failed: {what}") from cause
        except ray.exceptions.RayActorError as e:
            first = str(e).strip().splitlines()
            self.dead = (f"the trainer actor died during {method}(): {' '.join(first[:3]) if first else type(e).__name__}"
                         " (the run stops; its last checkpoint is intact: conveyor train --resume RUN_DIR)")
            raise TrainerActorError(self.dead) from None
        self._emit(records)
        with self._lock:
            self._info = info
        return out

    @staticmethod
    def _emit(records: list[dict]) -> None:
        """Re-emit the actor's log records in the driver (``train.log``)."""
        for r in records:
            r = dict(r)
            r["msg"] = "[trainer actor] " + r["msg"]
            logging.getLogger(r["name"]).handle(logging.makeLogRecord({**r, "args": None, "exc_info": None}))

    def train_step(self, trajectories: list) -> dict[str, float]:
        """One policy update in the actor (:meth:`~conveyor.trainer.trainer.Trainer.train_step`).

        Raises:
            NonFiniteLossError: as the trainer raises it. TrainerActorError: the actor failed or died.
        """
        return self._remote("train_step", list(trajectories))

    def critic_warmup_step(self, trajectories: list) -> dict[str, float]:
        """One critic-only warm-up step in the actor."""
        return self._remote("critic_warmup_step", list(trajectories))

    def take_events(self) -> list[dict]:
        """The proximal strategy's events since the last call."""
        return self._remote("take_events")

    def weight_update(self) -> RemoteWeightUpdate:
        """The current parameters, put into the object store by the actor (module docstring)."""
        return self._remote("weight_update", self.wire_dtype)

    def state_dict(self) -> dict:
        """The trainer's checkpoint state (CPU tensors), fetched from the actor."""
        return self._remote("state_dict")

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint's ``trainer.pt`` contents in the actor."""
        self._remote("load_state_dict", state)

    @property
    def settings_taken(self) -> list[str]:
        """Optimizer settings the last :meth:`load_state_dict` changed (the actor's
        ``Trainer.settings_taken``)."""
        return list(self._info.get("settings_taken", []))

    def scoring_spec(self):
        """The trainer's :class:`~conveyor.rollout.old_logprobs.ScoringSpec`."""
        return self._remote("scoring_spec")

    def scale_lr(self, factor: float) -> None:
        """Scale every updater's learning rate (the run monitor's action)."""
        self._remote("scale_lr", factor)

    def inference_policy(self):
        """The plain policy (LoRA merged), pickled from the actor (export, float32 evaluations)."""
        return self._remote("inference_policy")

    def save_adapter(self, directory: str | Path) -> Path:
        """With LoRA: the adapter's peft files, made in the actor, written into ``directory``
        (:meth:`conveyor.trainer.trainer.Trainer.save_adapter`).

        Raises:
            ValueError: the policy has no LoRA adapters.
        """
        if self.lora is None:
            raise ValueError("save_adapter: the policy is fully fine-tuned (lora.enabled=false), it has no adapter")
        return self.lora.save_adapter(directory)

    def close(self) -> None:
        """Kill the actor (idempotent)."""
        try:
            self._ray.kill(self.actor)
        except Exception:
            pass
        self.dead = self.dead or "the trainer actor was closed"


class _ProximalView:
    """``trainer.proximal`` for the runtime: its name and its memory cost."""

    def __init__(self, owner: RayTrainer, name: str):
        self._owner = owner
        self.name = name

    def extra_bytes(self) -> int:
        return int(self._owner._remote("proximal_extra_bytes"))


@dataclass(frozen=True)
class _ObjectiveView:
    needs_proximal: bool


class _LoraView:
    """``trainer.lora`` for the runtime: its note, trainable parameters and adapter files."""

    def __init__(self, owner: RayTrainer, info: dict):
        self._owner = owner
        self.note = info["note"]
        self.trainable = info["trainable"]

    def save_adapter(self, directory: str | Path) -> Path:
        """Write the adapter's peft files (made in the actor) into ``directory``."""
        directory = Path(directory)
        for rel, data in self._owner._remote("save_adapter_files").items():
            path = directory / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return directory


def start_trainer_actor(cfg, *, bf16_choice: bool | None, threads: int, ctx) -> RayTrainer:
    """Connect to (or start) the run's Ray cluster, start a :class:`TrainerActor` and build the
    trainer in it; everything registered on ``ctx`` (the actor killed, a cluster this call
    started shut down, at the end of the run).

    Args:
        cfg: The run's :class:`~conveyor.config.TrainConfig` (``runtime.trainer=actor``).
        bf16_choice: ``trainer.bf16=auto``'s recorded choice on a resume, or None.
        threads: The trainer's intra-op threads.
        ctx: The :class:`~conveyor.rundir.RunContext`.

    Returns:
        The :class:`RayTrainer` proxy.

    Raises:
        ImportError: Ray is missing. RuntimeError: the cluster cannot be started / joined.
        TrainerActorError: the actor did not start or could not build the trainer (its message).
        ValueError: what building the trainer raises for a bad configuration (as in the driver),
            or ``proximal.method=auto`` chose ``dedicated`` (not with this placement).
    """
    from conveyor.runtime.ray import connect_ray, require_ray, run_cpus
    from conveyor.runtime.ray_engines import forwarded_env

    ray = require_ray()
    shutdown = connect_ray(cfg.runtime, min_cpus=run_cpus(cfg))
    if shutdown is not None:
        ctx.stack.callback(shutdown)
    env = forwarded_env()
    faults = os.environ.get(TRAINER_ACTOR_FAULTS_ENV)
    if faults is not None:
        env["CONVEYOR_FAULTS"] = faults
    opts: dict[str, Any] = {"num_cpus": cfg.runtime.trainer_num_cpus, "max_concurrency": 1}
    if env:
        opts["runtime_env"] = {"env_vars": env}
    actor = ray.remote(TrainerActor).options(**opts).remote(collect_logs=True)
    holder: list = [actor]  # killed however the run ends, also during the set-up below (Ctrl-C)

    def kill() -> None:
        try:
            ray.kill(holder[0])
        except Exception:
            pass

    ctx.stack.callback(kill)
    timeout = cfg.runtime.call_timeout_s
    try:
        info = ray.get(actor.setup.remote(cfg, bf16_choice=bf16_choice, threads=threads), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        kill()
        raise TrainerActorError(
            f"the trainer actor was not set up within {timeout:.0f} s (runtime.call_timeout_s): it asks for "
            f"runtime.trainer_num_cpus={cfg.runtime.trainer_num_cpus} CPUs of the cluster's "
            f"{ray.cluster_resources().get('CPU', 0):g} (free now: {ray.available_resources().get('CPU', 0):g})") from None
    except ray.exceptions.RayError as e:
        kill()
        cause = getattr(e, "cause", None)
        if isinstance(cause, ValueError):  # a configuration error, as a local trainer raises it
            raise cause from None
        what = f"{type(cause).__name__}: {cause}" if cause is not None else str(e).splitlines()[0]
        raise TrainerActorError(f"the trainer actor could not build the trainer: {what} (it asks for "
                                f"runtime.trainer_num_cpus={cfg.runtime.trainer_num_cpus} CPUs)") from cause
    proxy = RayTrainer(actor, info)
    ctx.stack.callback(proxy.close)
    # (its set-up log stays in the actor until the first call: train.log is not open yet)
    if proxy.proximal.name == "dedicated":
        raise ValueError("runtime.trainer=actor: proximal.method=auto chose dedicated, whose worker reads the "
                         "trainer's model in its process; set proximal.method explicitly or runtime.trainer=driver")
    log.info("trainer actor: pid %s on node %s", info["pid"], info["node"])
    return proxy
