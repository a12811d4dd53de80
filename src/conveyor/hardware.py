"""What the machine does fast: the precision choice behind ``trainer.bf16=auto``.

bf16 autocast halves the cost of a matrix product only where the hardware has bf16 arithmetic
(x86 CPUs with AVX512-BF16 or AMX, recent GPUs). Elsewhere PyTorch emulates it: measured on a
2-core AMD EPYC with AVX2 only, a ``[2048, 576] @ [576, 1536]`` product ran at 60 GFLOP/s in fp32
and 1.2 GFLOP/s in bf16, and one SmolLM2 policy update took 545 s under bf16 autocast against
37 s in fp32 (docs/results/performance.md, "Precision on CPUs without bf16"). The choice is
therefore measured, not assumed: :func:`bf16_speedup` times one product both ways.
"""

from __future__ import annotations

import functools
import logging
import threading
import time

import torch

log = logging.getLogger(__name__)

BF16_MIN_SPEEDUP = 1.1
"""``trainer.bf16=auto`` uses bf16 autocast when it makes a matrix product at least this much
faster than fp32."""


@functools.cache
def bf16_speedup(device: str = "cpu") -> float:
    """fp32 time / bf16 time of one ``[256, 512] @ [512, 512]`` matrix product under
    ``torch.autocast(device, bfloat16)`` (best of 3 after a warm-up; ~5 ms where bf16 is native,
    ~0.3 s where it is emulated). Cached per process.

    Args:
        device: ``"cpu"`` or ``"cuda"``.

    Returns:
        The speed-up factor (> 1: bf16 faster); 0.0 where bf16 autocast is unavailable.
    """
    try:
        a = torch.randn(256, 512, device=device)
        b = torch.randn(512, 512, device=device)

        def best(bf16: bool) -> float:
            times = []
            for i in range(4):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
                    (a @ b).sum().item()
                if i:  # the first call warms up
                    times.append(time.perf_counter() - t0)
            return min(times)

        return best(False) / max(best(True), 1e-9)
    except (RuntimeError, AssertionError):  # no such device / no bf16 autocast there
        return 0.0


def resolve_bf16(setting: bool | str, device: str = "cpu", recorded: bool | None = None) -> tuple[bool, str]:
    """The precision ``trainer.bf16`` means on this machine.

    Args:
        setting: ``True`` / ``False`` (as asked), or ``"auto"``: bf16 when
            :func:`bf16_speedup` >= :data:`BF16_MIN_SPEEDUP`.
        device: The trainer's device type (``"cpu"`` or ``"cuda"``; on CUDA ``auto`` means bf16
            wherever the GPU supports it, without a measurement).
        recorded: ``"auto"``'s choice made earlier in the same run (a resume:
            :func:`conveyor.rundir.recorded_bf16`), used as it is instead of measuring again (the
            measured speed-up is noisy, 1.48-3.48x on one machine, so a new measurement could flip
            the precision between the segments of a run). Ignored for ``True`` / ``False``.

    Returns:
        ``(use_bf16, reason)``; ``reason`` is a one-line explanation for the run's log.

    Raises:
        ValueError: ``setting`` is neither a bool nor ``"auto"``.
    """
    if isinstance(setting, bool):
        return setting, f"trainer.bf16={str(setting).lower()}"
    if setting != "auto":
        raise ValueError(f"trainer.bf16 must be true, false or auto, got {setting!r}")
    if recorded is not None:
        return bool(recorded), (f"trainer.bf16=auto: bf16 autocast {'on' if recorded else 'off'}, the choice "
                                "made at the run's start (its precision event), kept on resume without measuring")
    if device == "cuda":  # bf16 tensor cores (Ampere and later); a timed small product says nothing on a GPU
        use = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
        return use, (f"trainer.bf16=auto: bf16 autocast {'on' if use else 'off'} ({name} "
                     f"{'supports' if use else 'does not support'} bf16)")
    s = bf16_speedup(device)
    use = s >= BF16_MIN_SPEEDUP
    return use, (f"trainer.bf16=auto: bf16 autocast {'on' if use else 'off'} (a bf16 matrix "
                 f"product runs {s:.2f}x the speed of fp32 on this {device})")


def restore_default_thread_count(n: int) -> None:
    """Set torch's process-wide default intra-op thread count to ``n`` from a short-lived helper
    thread, so the calling thread keeps its own count (:func:`set_own_thread_count`)."""
    helper = threading.Thread(target=torch.set_num_threads, args=(n,))
    helper.start()
    helper.join()


def set_own_thread_count(n: int) -> int:
    """Set the calling thread's intra-op thread count to ``n``, leaving torch's process-wide
    default as it was. ``torch.set_num_threads`` sets both the caller's OpenMP / MKL count and a
    default that threads read lazily on their first ATen op, so a worker thread calling it would
    change the count of every thread started later (the evaluation's, a test's); the default is
    put back from a short-lived helper thread (the engine's decode thread, the dedicated
    old-logit worker, the reference scorer). Call it first in the thread it is for.

    Args:
        n: Intra-op threads (>= 1).

    Returns:
        The process-wide default (to put back after later changes of this thread's count:
        :func:`restore_default_thread_count`).

    Raises:
        ValueError: ``n`` < 1.
    """
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    default = torch.get_num_threads()  # this thread's lazy initialisation reads the default
    if n != default:
        torch.set_num_threads(n)
        restore_default_thread_count(default)
    return default
