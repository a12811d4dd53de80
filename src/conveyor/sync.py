"""Weight synchronisation trainer -> inference engine(s).

The message is a plain value: named tensors plus a monotonically increasing policy version. It
holds no references to the trainer's live parameters (tensors are detached copies), so it can be
carried unchanged between threads, processes (``torch.save`` / shared memory) or Ray actors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WeightUpdate:
    """New policy weights with their version.

    Attributes:
        version: Policy version these weights correspond to (number of optimiser steps taken).
            Versions must strictly increase from one update to the next.
        tensors: Parameter / buffer name -> tensor (detached, contiguous, on CPU unless the
            caller chose otherwise). Names follow ``model.state_dict()``.
    """

    version: int
    tensors: dict[str, torch.Tensor]

    @property
    def num_bytes(self) -> int:
        """Total payload size in bytes."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

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
        with torch.no_grad():
            for name, t in model.state_dict().items():
                t = t.detach()
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                out[name] = t.to("cpu", copy=True).contiguous()
        return cls(version=version, tensors=out)
