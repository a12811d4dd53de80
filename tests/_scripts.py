"""Import a repository script (``benchmarks/*.py``, ``scripts/*.py``) as a module, so tests call its
functions in-process."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str) -> ModuleType:
    """The file ``ROOT / relpath`` (e.g. ``"scripts/length_table.py"``) executed as a fresh module."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(f"script_{path.parent.name}_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
