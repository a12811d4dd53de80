"""The configuration presets shipped in the package (issue 44, section 5).

The repository's ``configs/*.yaml`` (``sao``, ``grpo``, ``grpo_dis``, ``vapo_nodis``, ``asyppo``,
``preference_shift``, ``default``) are package data too (``conveyor/configs/``, links to the
repository's files in a checkout, copies in a wheel), so ``conveyor train sao`` and
``conveyor train configs/sao.yaml`` work from any directory, and ``conveyor presets`` lists them.
"""

from __future__ import annotations

from pathlib import Path

PRESET_DIR = Path(__file__).resolve().parent / "configs"
"""Where the presets are installed (``conveyor/configs/*.yaml``)."""

__all__ = ["PRESET_DIR", "find_preset", "list_presets", "preset_description"]


def list_presets() -> dict[str, Path]:
    """The shipped presets: name (the file's stem, e.g. ``sao``) -> path, sorted by name."""
    if not PRESET_DIR.is_dir():
        return {}
    return {p.stem: p for p in sorted(PRESET_DIR.glob("*.yaml")) if p.is_file()}


def find_preset(ref: str | Path) -> Path | None:
    """The shipped preset a ``conveyor train`` argument names, or None.

    ``sao``, ``sao.yaml`` and ``configs/sao.yaml`` (the repository's path, typed outside the
    repository) name the preset ``sao``. Callers look the file up first: an existing file
    always wins over a preset.
    """
    p = Path(ref)
    presets = list_presets()
    if p.suffix.lower() in ("", ".yaml", ".yml") and p.parent in (Path("."), Path("configs")):
        return presets.get(p.stem if p.suffix else p.name)
    return None


def preset_description(path: Path, width: int = 100) -> str:
    """A preset's one-line description: the first sentence of the comment block that opens its
    file (without ``#``), cut to ``width`` characters at a word (``...``)."""
    lines = []
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            text = line.strip()
            if not text.startswith("#"):
                break
            lines.append(text.lstrip("#").strip())
    except OSError:
        return ""
    text = " ".join(lines)
    end = text.find(". ")
    text = text[: end + 1] if end >= 0 else text
    if len(text) > width:
        text = text[: width - 3].rsplit(" ", 1)[0] + "..."
    return text
