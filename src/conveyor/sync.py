"""Weight synchronisation trainer -> inference engine(s).

The message is a plain value: named tensors plus a monotonically increasing policy version. It
holds no references to the trainer's live parameters (tensors are detached copies), so it can be
carried unchanged between threads, processes (``torch.save`` / shared memory) or Ray actors.
:func:`write_weights` / :func:`read_weights` carry it through a shared disk as safetensors (the
engine server's ``/update_weights_from_disk``, ``conveyor/rollout/engine/server.py``).

With LoRA (``lora.sync=adapter``, :mod:`conveyor.trainer.lora`) a message carries
:class:`LoraFactors` instead of weight matrices; the receiver merges them onto its own base
weights with :meth:`LoraFactors.merge` (:func:`apply_update`), never onto the previous version.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class LoraFactors:
    """The LoRA adapter of one linear weight ``W0`` (``[out, in]``): the adapted weight is
    ``W = W0 + scale * B @ A`` (Hu et al. 2021, arXiv 2106.09685, eq. 3, scaled by
    ``scale = alpha / r`` as in its section 4.1).

    Attributes:
        A: ``[r, in]`` (peft's ``lora_A``; detached CPU copy).
        B: ``[out, r]`` (peft's ``lora_B``; zero at initialisation).
        scale: ``alpha / r`` (peft's ``scaling``), a float.
    """

    A: torch.Tensor
    B: torch.Tensor
    scale: float

    @property
    def num_bytes(self) -> int:
        """Payload size of ``A`` and ``B`` in bytes."""
        return self.A.numel() * self.A.element_size() + self.B.numel() * self.B.element_size()

    def merge(self, base: torch.Tensor) -> torch.Tensor:
        """``base + scale * B @ A`` in float32 (one ``addmm``), ``[out, in]``; a new tensor
        (``base`` is untouched). Trainer (``lora.sync=merged``) and engine (``adapter``) both merge
        with this function, so the two modes give the engine the same weights.

        Raises:
            ValueError: ``base`` is not ``[B.shape[0], A.shape[1]]`` or ``A`` / ``B`` disagree on r.
        """
        if self.A.dim() != 2 or self.B.dim() != 2 or self.A.shape[0] != self.B.shape[1]:
            raise ValueError(f"LoRA factors must be A [r, in] and B [out, r], got A {tuple(self.A.shape)}, "
                             f"B {tuple(self.B.shape)}")
        if tuple(base.shape) != (self.B.shape[0], self.A.shape[1]):
            raise ValueError(f"LoRA factors A {tuple(self.A.shape)}, B {tuple(self.B.shape)} do not fit a "
                             f"weight of shape {tuple(base.shape)} ([out, in])")
        dev = base.device  # (the factors travel on the host; the receiver's W0 may be on its GPU)
        return torch.addmm(base.float(), self.B.to(dev).float(), self.A.to(dev).float(), alpha=float(self.scale))


@dataclass(frozen=True)
class WeightUpdate:
    """New policy weights with their version.

    Attributes:
        version: Policy version these weights correspond to (number of optimiser steps taken).
            Versions must strictly increase from one update to the next.
        tensors: Parameter / buffer name -> tensor (detached, contiguous, on CPU unless the
            caller chose otherwise: :meth:`from_model`'s ``device``; pinned host memory from a
            trainer on a GPU). Names follow ``model.state_dict()``.
        aliases: Name -> name in ``tensors`` for tensors the sender's model shares (tied input
            / output embeddings): sent once, applied to both names by the receiver.
        lora: Parameter name -> :class:`LoraFactors` (``lora.sync=adapter``): the receiver sets
            that parameter to ``factors.merge(W0)`` with ``W0`` its own copy of the base weight
            (:func:`apply_update`); empty otherwise.
    """

    version: int
    tensors: dict[str, torch.Tensor]
    aliases: dict[str, str] = field(default_factory=dict)
    lora: dict[str, LoraFactors] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        """Total payload size in bytes (tensors and LoRA factors)."""
        return (sum(t.numel() * t.element_size() for t in self.tensors.values())
                + sum(f.num_bytes for f in self.lora.values()))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor by name, aliases included (the tied tensor under each of its names), for
        ``model.load_state_dict``. No copies: the message's tensors themselves.

        Raises:
            ValueError: the message carries LoRA factors (they need base weights to merge onto:
                :func:`apply_update`).
        """
        if self.lora:
            raise ValueError(f"WeightUpdate version {self.version} carries LoRA factors for {len(self.lora)} "
                             "weights, not the weights themselves: merge them with apply_update(targets, update, "
                             "lora_base)")
        out = dict(self.tensors)
        out.update({name: self.tensors[src] for name, src in self.aliases.items()})
        return out

    def non_finite(self) -> list[str]:
        """Names of the floating-point tensors (and LoRA factors, as ``name.A`` / ``name.B``)
        holding a NaN or an infinity; empty when every value is finite. A receiver that did not
        produce the weights itself (``conveyor serve``'s ``/update_weights_from_disk``) refuses
        such an update: every request would then sample from NaN logits."""
        factors = {f"{k}.{n}": t for k, f in self.lora.items() for n, t in (("A", f.A), ("B", f.B))}
        return non_finite_names(self.tensors) + non_finite_names(factors)

    def cast(self, dtype: torch.dtype) -> WeightUpdate:
        """A copy with every floating-point tensor of :attr:`tensors` cast to ``dtype`` (e.g.
        ``torch.bfloat16`` for a bf16 engine: half the bytes on the wire, and exactly what the
        engine stores, since :func:`apply_update` casts with the same round-to-nearest-even).
        Integer tensors, aliases and LoRA factors are kept as they are (factors are merged by
        the receiver in its own precision)."""
        tensors = {k: t.to(dtype) if t.is_floating_point() else t for k, t in self.tensors.items()}
        return WeightUpdate(version=self.version, tensors=tensors, aliases=dict(self.aliases), lora=dict(self.lora))

    @classmethod
    def from_model(cls, model: torch.nn.Module, version: int, dtype: torch.dtype | None = None, *,
                   device: torch.device | str = "cpu", pin_memory: bool = False) -> WeightUpdate:
        """Snapshot ``model``'s state dict as an update message (copies every tensor).

        Args:
            model: The trainer's policy.
            version: The version to stamp on the message.
            dtype: Optional dtype to cast floating-point tensors to (e.g. ``torch.bfloat16`` to
                halve the bytes sent); None keeps the trainer's dtype.
            device: Where the copies go: the host (default: the message can cross threads,
                processes and Ray), or a GPU (a trainer and an engine in one process, each on a
                GPU: the engine then copies device to device, nothing crosses the host).
            pin_memory: Host copies in page-locked memory (a trainer on a GPU: the device-to-host
                copies run asynchronously at full bus speed, and so does the receiver's copy onto
                its GPU); this call waits until they are done. Ignored for a GPU ``device``.
        """
        device = torch.device(device)
        pin = pin_memory and device.type == "cpu" and torch.cuda.is_available()
        async_from: set[torch.device] = set()  # GPUs with device-to-host copies in flight
        out: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
        with torch.no_grad():
            for name, t in model.state_dict(keep_vars=True).items():
                t = t.detach()
                key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
                if t.numel() and key in seen:  # tied weights: one copy, one alias
                    aliases[name] = seen[key]
                    continue
                seen[key] = name
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                if pin and t.device.type == "cuda":
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    out[name] = buf.copy_(t, non_blocking=True)
                    async_from.add(t.device)
                else:
                    out[name] = t.to(device, copy=True).contiguous()
        for dev in async_from:  # the copies are complete before anyone reads the message
            torch.cuda.synchronize(dev)
        return cls(version=version, tensors=out, aliases=aliases)


def non_finite_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors of ``tensors`` holding a NaN or an infinity, in
    order (e.g. a model's ``state_dict()``); integer tensors are never flagged."""
    return [k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def apply_update(targets: dict[str, torch.Tensor], update: WeightUpdate,
                 lora_base: dict[str, torch.Tensor] | None = None) -> None:
    """Copy ``update`` into a receiver's tensors, in place (cast to each target's dtype): every
    tensor, every alias (skipped where the receiver ties the two names itself), and each LoRA
    factor pair merged onto the receiver's base weight, ``W = W0 + scale * B @ A``
    (:meth:`LoraFactors.merge`). Merging always starts from ``lora_base``, never from the current
    weight, so deltas never accumulate across versions.

    Args:
        targets: Name -> the receiver's tensor (e.g. ``dict(model.state_dict())``).
        update: The message (names already validated by the caller).
        lora_base: Name -> ``W0`` (``[out, in]``) for every name in ``update.lora``.

    Raises:
        KeyError: a name of ``update.lora`` without a base weight in ``lora_base``.
    """
    with torch.no_grad():
        for name, t in update.tensors.items():
            targets[name].copy_(t)
        for name, src in update.aliases.items():
            target = targets[name]
            if target.data_ptr() != targets[src].data_ptr():  # not tied here
                target.copy_(update.tensors[src])
        for name, factors in update.lora.items():
            if lora_base is None or name not in lora_base:
                raise KeyError(f"WeightUpdate LoRA factors for {name!r}, but the receiver keeps no base weight "
                               "for it (an engine that receives adapters needs lora_base)")
            targets[name].copy_(factors.merge(lora_base[name]))


WEIGHTS_FILE = "model.safetensors"
_META_VERSION = "conveyor_version"
_META_ALIASES = "conveyor_aliases"


def write_weights(path: str | os.PathLike, update: WeightUpdate) -> Path:
    """Write ``update`` as safetensors, atomically, for a server's ``/update_weights_from_disk``.

    ``path`` is either a file name ending in ``.safetensors`` or a directory (then the weights go
    to ``path/model.safetensors``, a Hugging Face style weight directory, which is what SGLang's
    ``/update_weights_from_disk {model_path}`` reads and :func:`read_weights` too). Everything is
    written under a temporary sibling name (``.<name>.tmp.<pid>``), ``fsync``-ed and then renamed
    to ``path``, so a reader sees the previous complete file / directory or the new complete one,
    never a partial file (replacing an existing *directory* takes two renames: in between,
    ``path`` is briefly absent). Tensor names are ``model.state_dict()`` names, so the file is
    also what SGLang loads; the version and the tied-weight aliases go into the safetensors
    metadata (``conveyor_version``, ``conveyor_aliases`` as JSON).

    Args:
        path: Target file (``*.safetensors``) or directory; its parent must exist.
        update: The weights (CPU or not; written as they are, dtype kept).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        TypeError: ``update`` is not a :class:`WeightUpdate`.
        ValueError: ``update`` carries LoRA factors (``lora.sync=adapter``).
        OSError: the write failed (nothing is left under ``path``'s name; the temporary is removed).
    """
    from safetensors.torch import save_file

    if not isinstance(update, WeightUpdate):
        raise TypeError(f"update must be a WeightUpdate, got {type(update).__name__}")
    if update.lora:
        raise ValueError("write_weights: the update carries LoRA factors (lora.sync=adapter), which a weights "
                         "file does not hold; send merged weights (lora.sync=merged)")
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, t in update.tensors.items():
        t = t.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # safetensors refuses tensors that share or view a larger storage
        seen.add((t.untyped_storage().data_ptr(), t.storage_offset()))
        tensors[name] = t
    meta = {_META_VERSION: str(update.version), _META_ALIASES: json.dumps(update.aliases),
            "format": "pt"}
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    is_file = path.suffix == ".safetensors"
    try:
        if tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        target = tmp if is_file else tmp / WEIGHTS_FILE
        if not is_file:
            tmp.mkdir()
        save_file(tensors, str(target), metadata=meta)
        with open(target, "rb+") as f:
            os.fsync(f.fileno())
        if is_file or not path.exists():
            os.replace(tmp, path)
        else:
            old = path.with_name(f".{path.name}.old.{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise
    return path


def read_weights(path: str | os.PathLike, version: int | None = None) -> WeightUpdate:
    """Load a :class:`WeightUpdate` from safetensors written by :func:`write_weights`, or from
    a Hugging Face model directory (every ``*.safetensors`` file in it, e.g. an ``export/``).

    Args:
        path: A ``*.safetensors`` file or a directory holding one or more of them.
        version: The version to stamp; None: the ``conveyor_version`` metadata of the file.

    Returns:
        The update (CPU tensors as stored; aliases from the ``conveyor_aliases`` metadata,
        none for a plain Hugging Face directory, whose tied weights are saved once).

    Raises:
        FileNotFoundError: ``path`` does not exist or the directory holds no safetensors file.
        ValueError: no ``version`` given and none in the metadata, or unreadable metadata / the
            same tensor name in two files (the message names the file).
    """
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("."))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {path}")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"no such weights file or directory: {path}")
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    meta_version: int | None = None
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            try:
                if _META_VERSION in meta:
                    meta_version = int(meta[_META_VERSION])
                aliases.update(json.loads(meta.get(_META_ALIASES, "{}")))
            except ValueError as e:
                raise ValueError(f"{file}: unreadable conveyor metadata ({e})") from e
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name in tensors:
                    raise ValueError(f"{file}: tensor {name!r} is also in another file")
                tensors[name] = f.get_tensor(name)
    if version is None:
        if meta_version is None:
            raise ValueError(f"{path}: no version given and no {_META_VERSION} metadata")
        version = meta_version
    return WeightUpdate(version=version, tensors=tensors, aliases=aliases)
