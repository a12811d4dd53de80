"""Where the models run: device settings (``trainer.device``, ``rollout.engine_device``) and the
few helpers that move tensors across the host / accelerator boundary.

The seam (issue 15 section 1): conveyor's per-token bookkeeping (packing, advantages, GAE,
losses, staleness accounting, sampled tokens) stays on the host, where the trajectories are; the
models (policy, reference, critics, engine) run on their device. Tensors cross the boundary at
the model's call: a packed micro-batch goes to the device before the forward pass, the per-token
log-probs / values ``[R, L]`` come back (a differentiable copy, so the loss's gradient flows back
to the device). What crosses per forward pass is ``O(tokens)``, not ``O(vocabulary)`` or
``O(parameters)``: the vocabulary projection and the transformer stay on the device.

A setting is ``auto``, ``cpu``, ``cuda`` (the current CUDA device) or ``cuda:N``. ``auto`` picks
CUDA when this process sees a GPU: the trainer takes ``cuda:0``; the engine takes a GPU of its own
(the last one) when there are two or more, else shares ``cuda:0`` with the trainer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

_SETTING = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_setting(value: str, key: str | None = None) -> str:
    """``value`` if it is a device setting (``auto``, ``cpu``, ``cuda``, ``cuda:N``).

    Raises:
        ValueError: anything else, naming ``key`` (when given: the config's own errors name the key
            already) and the accepted values.
    """
    if not isinstance(value, str) or not _SETTING.match(value):
        hint = (f" (settings are lower case: {value.lower()!r})"
                if isinstance(value, str) and _SETTING.match(value.lower()) else "")
        raise ValueError(f"{'' if key is None else key + '='}{value!r}: expected auto, cpu, cuda or cuda:N{hint}")
    return value


def cuda_count() -> int:
    """CUDA devices this process sees (0 without a CUDA build of torch or without a GPU)."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except (RuntimeError, AssertionError):  # a broken driver counts as none
        return 0


def resolve(setting: str, key: str, *, role: str = "trainer", n_cuda: int | None = None) -> torch.device:
    """The device a setting means in this process.

    Args:
        setting: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        key: The config key, for errors (``trainer.device``).
        role: ``trainer`` or ``engine``: ``auto`` gives the trainer ``cuda:0`` and the engine the
            last GPU (``cuda:0`` too when there is one); ``cpu`` without a GPU.
        n_cuda: CUDA devices (default :func:`cuda_count`; tests pass it).

    Raises:
        ValueError: not a device setting, CUDA asked for where this process sees none (the
            message names ``key`` and the installed torch), or ``cuda:N`` beyond the devices.
    """
    check_setting(setting, key)
    n = cuda_count() if n_cuda is None else n_cuda
    if setting == "auto":
        if n == 0:
            return torch.device("cpu")
        return torch.device("cuda", 0 if role == "trainer" else n - 1)
    if setting == "cpu":
        return torch.device("cpu")
    if n == 0:
        raise ValueError(f"{key}={setting}: this process sees no CUDA device (torch {torch.__version__}, "
                         f"torch.cuda.is_available() is False); install a CUDA build of torch on a GPU machine, "
                         f"or set {key}=cpu")
    index = int(setting.split(":")[1]) if ":" in setting else 0
    if index >= n:
        raise ValueError(f"{key}={setting}: this process sees {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return torch.device("cuda", index)


def is_cuda(device: torch.device | str | None) -> bool:
    """Whether ``device`` is a CUDA device."""
    return device is not None and torch.device(device).type == "cuda"


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the work queued on a CUDA ``device`` (timings of asynchronous kernels); nothing on
    the CPU."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter (or buffer); CPU for a module with neither."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def to(x: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``x`` on ``device`` (None stays None; no copy when it is there already). Host-to-device
    copies are asynchronous on CUDA; device-to-host copies synchronise (the values are read next)."""
    if x is None or x.device == device:
        return x
    return x.to(device, non_blocking=device.type == "cuda")


def to_host(xs: Iterable[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
    """Each tensor on the CPU (a differentiable copy: gradients flow back to the device); None stays."""
    return tuple(x if x is None or x.device.type == "cpu" else x.to("cpu") for x in xs)


def autocast(device: torch.device, enabled: bool, *, cache_enabled: bool = True):
    """bf16 autocast on ``device``'s type (``torch.autocast``); a no-op context when not enabled."""
    from contextlib import nullcontext

    if not enabled:
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache_enabled)
