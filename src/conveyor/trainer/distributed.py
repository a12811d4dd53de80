"""Data-parallel training of the policy (and its critic) with PyTorch FSDP2
(``torch.distributed.fsdp.fully_shard``).

``trainer.world_size`` = W processes train one policy together: each holds 1/W of every
parameter, gradient and AdamW moment (FSDP2 shards them as ``DTensor``; ZeRO-3 in DeepSpeed's
terms), gathers a decoder layer's weights just before it runs and frees them after. Every process
receives the WHOLE batch, packs it exactly as one process would (so every aggregation
denominator, every advantage and every group statistic is the global one) and trains on its share
of the micro-batches (:func:`assign_micro_batches`); the gradients are summed across processes by
FSDP's reduce-scatter. The result is the single-process update up to floating-point summation
order (``tests/test_distributed_trainer.py`` compares loss, gradients and parameters).

The seam: this module knows torch.distributed and FSDP2; :class:`conveyor.trainer.Trainer` asks it
to shard its model, to split a packed batch, to agree on a flag and to gather metrics; the
runtimes never see a ``DTensor`` (weights leave as full tensors, :func:`full_model_state`).

Collectives: every forward and backward of a sharded model is a collective (all-gather /
reduce-scatter), so every process must run the same number of passes in the same order. A process
with fewer micro-batches than the others runs zero-weight copies (:func:`padding_batch`); a
non-finite loss on one process is agreed on (:func:`all_true`) instead of breaking out of the loop.

References: PyTorch FSDP2 (``fully_shard``, torch >= 2.6), torchtitan's ``parallelize_llama``
(per-layer sharding, then the root); distributed state dicts
(``torch.distributed.checkpoint.state_dict``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from conveyor.trainer.batch import PackedBatch


@dataclass(frozen=True)
class DataParallel:
    """This process's place in the trainer's process group.

    Attributes:
        rank: 0 .. ``world_size - 1``; rank 0 is the leader (it runs the rollout side and
            publishes weights).
        world_size: Trainer processes (``trainer.world_size``), >= 2.
        announce: At rank 0 of a :class:`~conveyor.runtime.trainer_group.TrainerGroup`: sends
            ``(method, args, kwargs)`` to every follower before a :func:`collective` call
            (None: the processes call the trainer in step by themselves, as in tests).
    """

    rank: int
    world_size: int
    announce: Any = None

    @property
    def leader(self) -> bool:
        """Whether this is rank 0."""
        return self.rank == 0


def default_backend(device: str = "cpu") -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise (the CPU's only backend with the collectives
    FSDP2 uses)."""
    return "nccl" if device.startswith("cuda") else "gloo"


def init_process_group(rank: int, world_size: int, *, address: str = "127.0.0.1", port: int,
                       backend: str = "gloo", timeout_s: float = 1800.0) -> DataParallel:
    """Join (or create, at rank 0) the trainer's process group over TCP.

    Args:
        rank: This process's rank. world_size: Trainer processes (>= 2).
        address, port: Rank 0's rendezvous address (``127.0.0.1``: one machine).
        backend: ``gloo`` (CPU) or ``nccl`` (CUDA). timeout_s: Collective timeout (seconds); a
            peer that died makes the others fail after it rather than hang for ever.

    Raises:
        ValueError: ``world_size`` < 2 or ``rank`` out of range.
        RuntimeError: the rendezvous failed (torch.distributed's error).
    """
    if world_size < 2:
        raise ValueError(f"trainer.world_size: data parallelism needs >= 2 processes, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
    import datetime

    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return DataParallel(rank=rank, world_size=world_size)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks, found by the class names transformers lists in the model's
    ``_no_split_modules`` (``LlamaDecoderLayer``, ``Qwen2DecoderLayer``, ...), in module order; a
    wrapper without that attribute (a critic: a backbone and a value head) is searched through
    its submodules' lists.

    Raises:
        ValueError: the model names no such class, or has none of those modules.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    if not names:
        for m in model.modules():
            names |= set(getattr(m, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(f"trainer.world_size: {type(model).__name__} lists no _no_split_modules (its transformer "
                         "block class), so FSDP2 cannot shard it layer by layer")
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"trainer.world_size: {type(model).__name__} has no module of class {sorted(names)}")
    return layers


class ShardedRoot(torch.nn.Module):
    """FSDP2's root unit around a model whose own ``forward`` conveyor never calls
    (:func:`conveyor.trainer.logprobs.token_logprobs` runs the body and reads the head's weight
    itself). FSDP2's hooks fire on a module's call, so calling this module, ``root(fn, *args)``,
    runs ``fn(model, *args)`` with the root's parameters (embeddings, final norm, head) gathered
    and their gradients reduce-scattered in the backward pass.

    Attributes:
        model: The wrapped model (parameter names unchanged).
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn, *args, **kwargs):
        """``fn(model, *args, **kwargs)``; tensors come back as fresh tensors, not views (FSDP2
        hooks its pre-backward on the outputs, which an in-place op on a view would drop)."""
        out = fn(self.model, *args, **kwargs)
        if isinstance(out, tuple):
            return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)
        return out.clone() if isinstance(out, torch.Tensor) else out


def shard_model(model: torch.nn.Module) -> ShardedRoot:
    """Shard ``model`` in place with FSDP2: each decoder layer its own unit (gathered just before
    it runs, freed after), then a :class:`ShardedRoot` around the model for the rest
    (embeddings, final norm, head; tied weights stay one parameter). Parameters become
    ``DTensor`` shards over the default process group; the model keeps its class and its
    parameter names.

    Returns:
        The root to call the model through (``root(fn, *args)``).

    Raises:
        ValueError: see :func:`decoder_layers`.
    """
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    root = ShardedRoot(model)
    fully_shard(root)
    return root


def assign_micro_batches(tokens: list[int], world_size: int) -> list[list[int]]:
    """Micro-batches per process: the largest first, each to the least-loaded process that still
    has room, every process at most ``ceil(n / W)`` of them (so the number of passes differs by at
    most one, made equal by :func:`padding_batch`).

    Args:
        tokens: The cost of each micro-batch in tokens (the trainer passes its padded size,
            ``input_ids.numel()``: what the forward pass runs on). world_size: Processes.

    Returns:
        ``[W]`` lists of micro-batch indices, each in ascending order; deterministic.
    """
    n = len(tokens)
    cap = max(1, -(-n // world_size))
    load = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for j in sorted(range(n), key=lambda k: (-tokens[k], k)):
        r = min((r for r in range(world_size) if len(out[r]) < cap), key=lambda r: (load[r], r))
        out[r].append(j)
        load[r] += tokens[j]
    return [sorted(x) for x in out]


def padding_batch(mb: PackedBatch) -> PackedBatch:
    """A copy of ``mb`` that contributes nothing: every loss mask, advantage and aggregation
    weight 0, so its forward / backward passes only keep the processes' collectives in step."""
    zero = torch.zeros_like(mb.mask)
    return dataclasses.replace(mb, mask=zero, advantages=torch.zeros_like(mb.advantages))


def all_true(flag: bool) -> bool:
    """Whether ``flag`` holds on every process (collective)."""
    t = torch.tensor([0 if flag else 1], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item()) == 0


def all_sum(x: float) -> float:
    """The sum of ``x`` over every process (collective; float64)."""
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())


def all_gather(obj: Any, world_size: int) -> list[Any]:
    """Every process's ``obj`` (picklable), in rank order (collective)."""
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s full value (an all-gather: collective), any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The sharded model's full state dict on CPU at rank 0 (empty elsewhere); collective.
    Tied parameters (one ``Parameter`` under two names) come back as one tensor under both names."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def gather_params(model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The full values of ``model``'s parameters ``names`` (e.g. a LoRA adapter's, a few MB: not
    the whole model, which :func:`full_model_state` gathers), detached CPU copies at rank 0
    (empty elsewhere). Collective: every process passes the same ``names`` in the same order.

    Raises:
        KeyError: a name that is not a parameter of ``model``.
    """
    leader = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    out = {}
    for name in names:
        t = full_tensor(model.get_parameter(name).detach())
        if leader:
            out[name] = t.to("cpu", copy=True)
    return out


def scatter_params(model: torch.nn.Module, names: list[str], state: dict[str, torch.Tensor]) -> None:
    """Set ``model``'s parameters ``names`` from full tensors read at rank 0 (``state``; ignored
    elsewhere): rank 0 sends, every process keeps its shard (``distribute_tensor`` from rank 0).
    A plain (unsharded) parameter gets rank 0's value by broadcast. Collective, like
    :func:`gather_params`.

    Raises:
        KeyError: a name that is not a parameter of ``model`` (or missing from rank 0's ``state``).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    grouped = dist.is_available() and dist.is_initialized()
    leader = not grouped or dist.get_rank() == 0
    with torch.no_grad():
        for name in names:
            p = model.get_parameter(name)
            full = state[name].to(p.dtype) if leader else torch.empty(p.shape, dtype=p.dtype)
            if isinstance(p, DTensor):  # scattered from the mesh's first rank (rank 0 here)
                full = distribute_tensor(full, p.device_mesh, p.placements)
            elif grouped:
                full = full.to(p.device).contiguous()
                dist.broadcast(full, src=0)
            p.copy_(full)


def load_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full state dict (read at rank 0; ignored elsewhere) into the sharded model: rank 0
    broadcasts, each process keeps its shards. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's full state keyed by parameter names (not ids), on CPU at rank 0; collective.
    The same format loads into a sharded or an unsharded model (:func:`load_full_optimizer_state`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    fresh = not optimizer.state  # before the first step: torch initialises the state with a step at lr 0
    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if fresh:  # which must not count: the first real update would use step 2's bias correction
        optimizer.state.clear()
    return state


def optimizer_state_by_name(state: dict, names: list[str]) -> dict:
    """A torch ``optimizer.state_dict()`` (keyed by parameter position) in the by-name format of
    :func:`full_optimizer_state`.

    Args:
        state: ``{"state": {i: {...}}, "param_groups": [{..., "params": [i, ...]}]}``.
        names: The name of the optimizer's parameter ``i`` at position ``i`` (its order of
            ``model.named_parameters()`` that require grad, as :meth:`Updater.adamw` builds it).

    Raises:
        ValueError: the state holds a position that ``names`` does not.
    """
    def name(i: int) -> str:
        if not 0 <= int(i) < len(names):
            raise ValueError(f"optimizer state: parameter {i} of a model with {len(names)} trained parameters; "
                             "the checkpoint is of another model")
        return names[int(i)]

    return {"state": {name(i): dict(v) for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [name(i) for i in g["params"]]} for g in state["param_groups"]]}


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load :func:`full_optimizer_state` output (read at rank 0; broadcast when distributed)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    distributed = dist.is_available() and dist.is_initialized()
    set_optimizer_state_dict(model, optimizer, state,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed))


# ---------------------------------------------------------------------- leader and followers
# Rank 0 runs the whole job (rollout, logs, checkpoints); ranks 1.. run only :func:`follow`,
# which repeats each collective trainer call rank 0 announces. The trainer's methods that every
# process must run together carry :func:`collective`.

STOP = "__stop__"


class OutOfStepError(RuntimeError):
    """A collective trainer call refused because an earlier one failed at rank 0 (the processes
    may be out of step; :func:`collective`)."""


def collective(light: Any = None):
    """Mark a :class:`~conveyor.trainer.trainer.Trainer` method that every data-parallel process
    runs together: at rank 0 it first announces ``(name, args, kwargs)`` to the followers
    (``DataParallel.announce``; they run it in :func:`follow`), then runs. Without data
    parallelism (``self.dp`` None) or without an announcer it only runs.

    A call that raised at rank 0 (other than a non-finite step, on which the processes agree)
    may have left the followers inside a collective: every later collective call then raises
    :class:`OutOfStepError` at once instead of pairing mismatched collectives (or waiting
    ``trainer.collective_timeout_s``); the last checkpoint on disk is the one to resume.

    Args:
        light: Optional ``(args, kwargs) -> (args, kwargs)`` applied to what is broadcast (e.g.
            a checkpoint's state without its full tensors, which rank 0 broadcasts itself).
    """
    import functools

    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            dp = getattr(self, "dp", None)
            if dp is None or not dp.leader or dp.announce is None:
                return method(self, *args, **kwargs)
            failed = getattr(self, "_out_of_step", None)
            if failed is not None:
                raise OutOfStepError(f"trainer.world_size={dp.world_size}: {method.__name__} refused, the trainer "
                                     f"processes are out of step since {failed}; resume from the last checkpoint")
            a, k = light(args, kwargs) if light is not None else (args, kwargs)
            dp.announce((method.__name__, a, k))
            try:
                return method(self, *args, **kwargs)
            except BaseException as e:
                from conveyor.trainer.trainer import NonFiniteLossError

                if not isinstance(e, NonFiniteLossError):
                    self._out_of_step = f"{method.__name__} failed at rank 0 ({type(e).__name__}: {e})"
                raise

        return run

    return wrap


def follow(trainer, receive) -> int:
    """A follower's loop: run each collective call rank 0 announces on this process's trainer
    until rank 0 announces the stop. A call that raises on a follower also raised on rank 0
    where the processes agree (a non-finite step: logged there); any other error ends the loop.

    Args:
        trainer: This process's trainer.
        receive: ``() -> (name, args, kwargs)``, the next announced call (blocks; the waits
            between calls, e.g. while rank 0 waits for rollouts or evaluates, are not
            collectives and have no timeout); ``name`` :data:`STOP` ends the loop.

    Returns:
        The number of calls run.

    Raises:
        Whatever a call raised other than :class:`~conveyor.trainer.trainer.NonFiniteLossError`.
    """
    from conveyor.trainer.trainer import NonFiniteLossError

    n = 0
    while True:
        name, args, kwargs = receive()
        if name == STOP:
            return n
        try:
            getattr(trainer, name)(*args, **kwargs)
        except NonFiniteLossError:
            pass  # rank 0 raised the same (the processes agreed on it); it decides what follows
        n += 1

