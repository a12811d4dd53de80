"""Host-memory controls of the training process.

PyTorch's CPU allocator takes tensor memory from the C library's ``malloc``. glibc serves large
requests with ``mmap`` (returned to the OS on ``free``) only above a *dynamic* threshold that
rises to the size of every mmapped block freed, up to 32 MiB; after a few training steps most
activation and gradient tensors therefore come from the heap arenas, whose freed space is kept and
fragments, and the resident set grows past the live tensors (measured: 4.06 GB peak for a
SmolLM2-135M update whose live tensors need ~2.7 GB; docs/results/performance.md). Fixing the
threshold (``mallopt(M_MMAP_THRESHOLD)``, which also disables the dynamic adjustment) keeps every
large tensor in its own mapping, so freed memory goes back to the OS at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc <malloc.h>
_MAX_THRESHOLD = 32 * 2**20  # glibc's HEAP_MAX / 2 on 64-bit: larger values are refused
_UNSET = object()
_fns: dict[str, object] = {}


def _libc_fn(name: str, argtypes: list):
    """glibc's ``name`` (cached), or None where the C library has no such function."""
    fn = _fns.get(name, _UNSET)
    if fn is _UNSET:
        try:
            fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
            fn.argtypes = argtypes
        except (OSError, AttributeError):
            fn = None
        _fns[name] = fn
    return fn


def set_malloc_mmap_threshold(nbytes: int) -> bool:
    """Serve allocations of ``nbytes`` (bytes) or more with their own ``mmap`` (glibc only).

    Process-wide and irreversible for the process: the fixed threshold replaces glibc's dynamic
    one. Costs page faults on each new large allocation (pages are zeroed by the kernel); buys a
    resident set that follows the live tensors.

    Args:
        nbytes: Threshold in bytes, 1 .. 32 MiB.

    Returns:
        True when set; False on a C library without ``mallopt`` (macOS, musl): a warning is logged
        and nothing changes.

    Raises:
        ValueError: ``nbytes`` outside 1 .. 32 MiB.
    """
    if not 1 <= nbytes <= _MAX_THRESHOLD:
        raise ValueError(f"trainer.malloc_mmap_threshold: {nbytes} bytes is outside 1 .. {_MAX_THRESHOLD} (32 MiB)")
    mallopt = _libc_fn("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        log.warning("trainer.malloc_mmap_threshold: this C library has no mallopt (not glibc); ignored")
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, int(nbytes)))
    if not ok:
        log.warning("trainer.malloc_mmap_threshold: mallopt refused %d bytes; ignored", nbytes)
    return ok


def release_free_memory() -> bool:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim(0)``; a no-op elsewhere).

    Cheap (one pass over the arenas' free lists); called between the phases of a policy update so
    that memory freed by one phase (activations, the previous step's gradients) does not stay
    resident, fragmented, under the next. Returns True when glibc released something.
    """
    trim = _libc_fn("malloc_trim", [ctypes.c_size_t])
    return bool(trim(0)) if trim is not None else False


def active_allocator() -> str:
    """Which malloc serves this process: ``"tcmalloc"``, ``"jemalloc"`` (preloaded, e.g. with
    ``LD_PRELOAD``), or ``"system"``; read from ``/proc/self/maps`` (``"system"`` where that file
    does not exist)."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "system"
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    return "system"
