"""The user guide: the MkDocs site builds with --strict (a broken link, a missing anchor or a page
left out of the nav fails), the configuration reference matches the code, and the README stays
short with links that resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    # NO_MKDOCS_2_WARNING: mkdocs-material's banner about MkDocs 2.0 (printed, not a build warning)
    return {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def test_mkdocs_strict_build_passes(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed (pip install -e '.[docs]' if mkdocs is missing):\n{out[-6000:]}"
    assert (site / "index.html").is_file() and (site / "configuration" / "index.html").is_file()


def test_configuration_reference_is_generated_from_the_code(tmp_path):
    out = tmp_path / "configuration.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_config_reference.py"), "-o", str(out)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert out.read_text(encoding="utf-8") == committed, (
        "docs/configuration.md is out of date with src/conveyor/config.py: run python scripts/gen_config_reference.py"
    )


def test_configuration_reference_lists_every_key():
    from conveyor.config import TrainConfig

    def keys(model, prefix=""):
        for name, field in type(model).model_fields.items():
            key = f"{prefix}{field.alias or name}"
            value = getattr(model, name)
            if hasattr(type(value), "model_fields"):
                yield from keys(value, key + ".")
            else:
                yield key

    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.M))
    missing = [k for k in keys(TrainConfig()) if k not in listed]
    assert not missing, f"keys missing from docs/configuration.md: {missing}"
    assert "`rollout.group_size`" in text and "[§1](MISSION.md)" in text


def _relative_links(md: str) -> list[str]:
    md = re.sub(r"```.*?```", "", md, flags=re.S)  # not inside code blocks
    links = re.findall(r"\]\(([^)\s]+)\)", md)
    return [x for x in links if not re.match(r"[a-z][a-z0-9+.-]*:", x) and not x.startswith("#")]


def test_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) < 200, "README.md is for a newcomer to scan: keep it under 200 lines, details go to docs/"
    links = _relative_links(text)
    assert links, "README.md links to the user guide"
    broken = [x for x in links if not (ROOT / x.split("#", 1)[0]).exists()]
    assert not broken, f"README.md links to missing files: {broken}"


def test_readme_set_up_commands_are_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for cmd in ("bash scripts/install.sh --vllm", ".venv/bin/python -m pytest -q"):
        assert f"\n{cmd}\n" in readme, f"README.md's set-up block runs `{cmd}` on a line of its own"
    assert "bash scripts/install.sh --vllm && .venv/bin/python -m pytest -q" in ci
