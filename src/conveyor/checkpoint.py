"""Checkpoints of a training run: atomic, verified, cleaned up after crashes; and the export.

Layout: ``RUN_DIR/checkpoints/step_<version>/`` holds

- ``trainer.pt``: policy, AdamW state, scheduler, version, proximal-strategy state
  (:meth:`conveyor.trainer.trainer.Trainer.state_dict`);
- ``state.pt``: controller snapshot (data cursor, buffered trajectories, staleness counters),
  RNG states, version;
- ``manifest.json``: size in bytes and SHA-256 of every file above;
- ``DONE``: the version (the completion marker).

A checkpoint is written into ``checkpoints/.tmp_step_<version>_<pid>``, every file is
``fsync``-ed, the manifest and ``DONE`` are written last, and the directory is renamed to
``step_<version>`` (one atomic rename is the commit point). So a crash or ``kill -9`` during the
write leaves only a ``.tmp_*`` directory, which the next resume removes
(:func:`clean_stale_checkpoint_dirs`), and the previous checkpoint is untouched: older ones are
deleted only after the new one is committed. A full disk removes the partial write and raises
:class:`~conveyor.runtime_files.DiskFullError`.

Integrity: :func:`find_resume_checkpoint` verifies the newest complete checkpoint against its
manifest (sizes, then SHA-256; ~1.3 s per GB on one core) and falls back to the next older one,
with a warning, when a file is missing, truncated or corrupt. Only checkpoints still on disk can
be fallen back to: ``run.keep_checkpoints=1`` (the default) keeps one, so a damaged newest
checkpoint is then a clear error; ``run.keep_checkpoints=2`` keeps a fallback at the cost of one
more checkpoint on disk (about 1.6 GB for SmolLM2-135M: fp32 weights 0.54 GB + AdamW moments
1.08 GB).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from conveyor.faults import fault_point
from conveyor.runtime_files import (
    RunFileError,
    atomic_write,
    atomic_write_json,
    describe_os_error,
    pid_alive,
)

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
_TMP_RE = re.compile(r"^\.tmp_(?:step|warmup)_(\d+)_(\d+)$")
_NAME_RE = re.compile(r"(step|warmup)_(\d+)")


class CheckpointError(RunFileError):
    """No usable checkpoint (every complete one failed verification); the message lists why."""


def checkpoint_version(path: Path) -> int:
    """The policy version of ``checkpoints/step_<version>`` (0 for ``warmup_<k>``)."""
    kind, n = _NAME_RE.fullmatch(path.name).groups()
    return int(n) if kind == "step" else 0


def checkpoint_order(path: Path) -> tuple[int, int]:
    """Sort key, oldest first: ``warmup_<k>`` (critic warm-up step ``k``, policy version 0)
    before ``step_<v>`` (``step_0``: a run stopped right after its warm-up)."""
    kind, n = _NAME_RE.fullmatch(path.name).groups()
    return (int(n), 1 << 30) if kind == "step" else (0, int(n))


def checkpoint_name(trainer) -> str:
    """``step_<version>``, or ``warmup_<k>`` while the critic warm-up is not finished
    (``critic.warmup_steps``; the policy version is still 0 there)."""
    if getattr(trainer, "in_critic_warmup", False):
        return f"warmup_{trainer.critic_warmup_done}"
    return f"step_{trainer.version}"


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Committed checkpoints (``step_N`` or ``warmup_K`` with a ``DONE`` marker), oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    cands = [
        p for p in root.iterdir() if _NAME_RE.fullmatch(p.name) and (p / "DONE").is_file()
    ]
    return sorted(cands, key=checkpoint_order)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest committed checkpoint (not verified; see :func:`find_resume_checkpoint`)."""
    cands = complete_checkpoints(run_dir)
    return cands[-1] if cands else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save_checkpoint(run_dir: str | Path, trainer, controller, keep: int = 1) -> Path:
    """Write ``checkpoints/step_<trainer.version>`` (``warmup_<k>`` during the critic warm-up:
    :func:`checkpoint_name`) atomically and keep the newest ``keep``.

    Args:
        run_dir: The run directory.
        trainer: A :class:`~conveyor.trainer.trainer.Trainer` (``state_dict``, ``version``).
        controller: A :class:`~conveyor.rollout.controller.RolloutController` (``snapshot``).
        keep: Committed checkpoints kept on disk (>= 1; older ones are deleted after the new one
            is committed).

    Returns:
        The checkpoint directory (unchanged if this version is already committed).

    Raises:
        DiskFullError / RunFileError: the write failed (no space, read-only, ...); the partial
            write is removed and earlier checkpoints are intact.
    """
    root = Path(run_dir) / CHECKPOINTS
    version = trainer.version
    name = checkpoint_name(trainer)
    final = root / name
    if (final / "DONE").is_file():
        return final
    tmp = root / f".tmp_{name}_{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        torch.save(trainer.state_dict(), tmp / "trainer.pt")
        fault_point("checkpoint_write")  # chaos suite: a kill / full disk half-way through
        torch.save(
            {
                "controller": controller.snapshot(),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                "version": version,
            },
            tmp / "state.pt",
        )
        files = {}
        for name in ("trainer.pt", "state.pt"):
            _fsync(tmp / name)
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
        atomic_write_json(
            tmp / MANIFEST,
            {"version": version, "files": files},
            what=f"checkpoint {name} manifest",
        )
        atomic_write(
            tmp / "DONE",
            lambda p: p.write_text(str(version)),
            what=f"checkpoint {name} marker",
        )
        if final.exists():  # an uncommitted leftover (no DONE) of an earlier crash
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        prev = latest_checkpoint(run_dir)
        err = describe_os_error(e, f"checkpoint {name} under {root}")
        kept = (
            f"the previous checkpoint {prev.name} is intact"
            if prev is not None
            else "no earlier checkpoint exists"
        )
        raise type(err)(err.errno, f"{err.strerror}; {kept}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def verify_checkpoint(path: str | Path, *, hashes: bool = True) -> str | None:
    """Check a committed checkpoint against its manifest.

    Args:
        path: ``checkpoints/step_N``.
        hashes: Also compare SHA-256 digests (reads every byte); sizes are always compared.

    Returns:
        None when it is complete and intact, else a one-line reason (file named). A checkpoint
        written before manifests existed passes when ``trainer.pt`` and ``state.pt`` exist.
    """
    path = Path(path)
    if not (path / "DONE").is_file():
        return "no DONE marker (the write did not finish)"
    mpath = path / MANIFEST
    if not mpath.is_file():
        missing = [n for n in ("trainer.pt", "state.pt") if not (path / n).is_file()]
        return f"{', '.join(missing)} missing" if missing else None
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} unreadable ({e})"
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} missing"
        size = f.stat().st_size
        if size != meta["bytes"]:
            expected = meta["bytes"]
            return f"{name} has {size} bytes, the manifest says {expected} (truncated or altered)"
        if hashes and _sha256(f) != meta["sha256"]:
            return f"{name}: SHA-256 differs from the manifest (corrupt)"
    return None


def find_resume_checkpoint(
    run_dir: str | Path, warn: Callable[[str], None] | None = None
) -> Path | None:
    """The newest committed checkpoint that passes :func:`verify_checkpoint`.

    A damaged newer checkpoint is skipped with a warning (``warn``, and the log) naming the
    file and the checkpoint resumed from instead.

    Returns:
        The checkpoint directory, or None when no committed checkpoint exists.

    Raises:
        CheckpointError: committed checkpoints exist but none is intact (the message lists each
            one's problem).
    """
    problems = []
    damaged = []
    for ckpt in reversed(complete_checkpoints(run_dir)):
        reason = verify_checkpoint(ckpt)
        if reason is None:
            for bad, msg in zip(damaged, problems, strict=True):
                # set aside (not deleted) so the resumed run writes this version afresh
                aside = bad.with_name(f"damaged_{bad.name}")
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(bad, aside)
                text = f"{msg}; moved to {aside.name}, resuming from the older {ckpt.name}"
                log.warning(text)
                if warn is not None:
                    warn(text)
            return ckpt
        damaged.append(ckpt)
        problems.append(f"checkpoint {ckpt.name} is damaged: {reason}")
    if problems:
        raise CheckpointError(
            errno.EIO,
            "no intact checkpoint to resume from: "
            + "; ".join(problems)
            + " (run.keep_checkpoints=2 keeps an older checkpoint to fall back to)",
        )
    return None


def clean_stale_checkpoint_dirs(run_dir: str | Path) -> list[str]:
    """Remove what interrupted checkpoint writes left behind: ``.tmp_step_N_<pid>`` directories
    of processes no longer alive (or of this process), and ``step_N`` directories without a
    ``DONE`` marker. Call it while holding the run directory's lock (then no live process is
    writing there).

    Returns:
        One line per directory removed (for the log / events).
    """
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    removed = []
    for p in sorted(root.iterdir()):
        m = _TMP_RE.match(p.name)
        if m is not None:
            pid = int(m.group(2))
            if pid != os.getpid() and pid_alive(pid):
                continue  # not ours and its writer may still be running (a pre-lock version)
            shutil.rmtree(p, ignore_errors=True)
            removed.append(f"{p.name} (an unfinished checkpoint write of process {pid})")
        elif _NAME_RE.fullmatch(p.name) and p.is_dir() and not (p / "DONE").is_file():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(f"{p.name} (no DONE marker: never committed)")
    return removed


def export_policy(policy, tokenizer, export_dir: str | Path, dtype: str = "float32") -> Path:
    """Save the policy and tokenizer as a Hugging Face directory (safetensors), usable as
    ``--model``.

    Args:
        policy: The trained ``PreTrainedModel`` (fp32 parameters; left unchanged).
        tokenizer: Its tokenizer.
        export_dir: Target directory.
        dtype: ``"float32"`` (exact) or ``"bfloat16"`` (half the bytes: 0.27 GB instead of 0.54 GB
            for SmolLM2-135M; every weight rounded to bf16, so the exported policy differs from
            the trained one by that rounding; ``conveyor.models.load_model`` loads it back as
            fp32). Tied weights stay tied (one tensor per storage).

    Returns:
        ``export_dir``.

    Raises:
        ValueError: unknown ``dtype``. RunFileError: the write failed (e.g. a full disk).
    """
    export_dir = Path(export_dir)
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"run.export_dtype must be float32 or bfloat16, got {dtype!r}")
    try:
        if dtype == "float32":
            policy.save_pretrained(str(export_dir))
        else:
            cast: dict[tuple, torch.Tensor] = {}
            state = {}
            for name, t in policy.state_dict().items():
                key = (t.data_ptr(), tuple(t.shape), t.dtype)  # tied weights share one storage
                if key not in cast:
                    cast[key] = (
                        t.detach().to(torch.bfloat16) if t.is_floating_point() else t.detach()
                    )
                state[name] = cast[key]
            policy.save_pretrained(str(export_dir), state_dict=state)
            cfg_path = export_dir / "config.json"
            conf = json.loads(cfg_path.read_text())
            conf["dtype"] = "bfloat16"
            atomic_write_json(cfg_path, conf, what=f"{cfg_path}")
        tokenizer.save_pretrained(str(export_dir))
    except OSError as e:
        raise describe_os_error(e, f"the export {export_dir}") from e
    return export_dir
