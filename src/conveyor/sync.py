"""Weight synchronisation trainer -> inference engine(s).

The message is a plain value: named tensors plus a monotonically increasing policy version. It
holds no references to the trainer's live parameters (tensors are detached copies), so it can be
carried unchanged between threads, processes (``torch.save`` / shared memory) or Ray actors.
:func:`write_weights` / :func:`read_weights` carry it through a shared disk as safetensors (the
engine server's ``/update_weights_from_disk``, ``conveyor/rollout/engine/server.py``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class WeightUpdate:
    """New policy weights with their version.

    Attributes:
        version: Policy version these weights correspond to (number of optimiser steps taken).
            Versions must strictly increase from one update to the next.
        tensors: Parameter / buffer name -> tensor (detached, contiguous, on CPU unless the
            caller chose otherwise). Names follow ``model.state_dict()``.
        aliases: Name -> name in ``tensors`` for tensors the sender's model shares (tied input
            / output embeddings): sent once, applied to both names by the receiver.
    """

    version: int
    tensors: dict[str, torch.Tensor]
    aliases: dict[str, str] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        """Total payload size in bytes."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor by name, aliases included (the tied tensor under each of its names), for
        ``model.load_state_dict``. No copies: the message's tensors themselves."""
        out = dict(self.tensors)
        out.update({name: self.tensors[src] for name, src in self.aliases.items()})
        return out

    @classmethod
    def from_model(cls, model: torch.nn.Module, version: int, dtype: torch.dtype | None = None) -> WeightUpdate:
        """Snapshot ``model``'s state dict as an update message (copies every tensor).

        Args:
            model: The trainer's policy.
            version: The version to stamp on the message.
            dtype: Optional dtype to cast floating-point tensors to (e.g. ``torch.bfloat16`` to
                halve the bytes sent); None keeps the trainer's dtype.
        """
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
                out[name] = t.to("cpu", copy=True).contiguous()
        return cls(version=version, tensors=out, aliases=aliases)


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
        OSError: the write failed (nothing is left under ``path``'s name; the temporary is removed).
    """
    from safetensors.torch import save_file

    if not isinstance(update, WeightUpdate):
        raise TypeError(f"update must be a WeightUpdate, got {type(update).__name__}")
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
