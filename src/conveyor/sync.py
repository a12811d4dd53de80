"""Weight synchronisation trainer -> inference engine(s).

The message is a plain value: named tensors plus a monotonically increasing policy version. It
holds no references to the trainer's live parameters (tensors are detached copies), so it can be
carried unchanged between threads, processes (``torch.save`` / shared memory) or Ray actors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
