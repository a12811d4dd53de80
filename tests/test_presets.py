"""The presets ship in the package (issue 44, section 5): ``conveyor train sao`` (and
``conveyor train configs/sao.yaml``) work from any directory, ``conveyor presets`` lists them."""

from __future__ import annotations

import tomllib
from pathlib import Path

from typer.testing import CliRunner

from conveyor.cli import app
from conveyor.presets import PRESET_DIR, find_preset, list_presets, preset_description

ROOT = Path(__file__).resolve().parents[1]


def test_every_config_of_the_repository_is_a_shipped_preset() -> None:
    repo = {p.stem: p.read_bytes() for p in (ROOT / "configs").glob("*.yaml")}
    shipped = {name: p.read_bytes() for name, p in list_presets().items()}
    assert shipped == repo  # the same files (links in a checkout, copies in a wheel): never out of date
    assert {"sao", "grpo", "default"} <= set(shipped)
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["conveyor"]
    assert "configs/*.yaml" in data  # in the wheel
    assert PRESET_DIR == ROOT / "src" / "conveyor" / "configs"


def test_find_preset_names() -> None:
    for ref in ("sao", "sao.yaml", "configs/sao.yaml", Path("configs") / "sao.yaml"):
        assert find_preset(ref) == PRESET_DIR / "sao.yaml", ref
    for ref in ("nosuch", "other/sao.yaml", "sao.json", "/abs/sao.yaml"):
        assert find_preset(ref) is None, ref
    assert preset_description(PRESET_DIR / "sao.yaml").startswith("SAO: single-rollout asynchronous optimisation")


def test_train_takes_a_preset_from_any_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # no configs/ here
    for ref in ("sao", "configs/sao.yaml"):
        # an invalid override: the preset was found and read, and the run stops before loading anything
        r = CliRunner().invoke(app, ["train", ref, "trainer.batch_size=0"])
        out = " ".join(r.output.split())
        assert r.exit_code == 2, r.output
        assert f"preset sao: {PRESET_DIR / 'sao.yaml'}" in out and "trainer.batch_size" in out, out
        assert "does not exist" not in out
    r = CliRunner().invoke(app, ["train", "nosuch.yaml"])
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and "config file nosuch.yaml does not exist" in out and "sao" in out, out
    (tmp_path / "sao.yaml").write_text("trainer:\n  batch_size: 0\n")  # a file of the user's wins
    r = CliRunner().invoke(app, ["train", "sao.yaml"])
    assert r.exit_code == 2 and "preset" not in r.output and "sao.yaml" in r.output, r.output


def test_presets_command_lists_them(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["presets"])
    assert r.exit_code == 0, r.output
    names = [line.split()[0] for line in r.output.splitlines() if line.strip() and not line.startswith("conveyor")]
    assert names == sorted(list_presets()), r.output
    assert "conveyor train NAME" in r.output


def test_the_default_preset_keeps_the_data_sources_own_instruction(tmp_path) -> None:
    """configs/default.yaml showed the numeric sets' instruction as a fixed value, so a run of it on
    your own file: data was told "as a number" while the same run without the file was not
    (issue 44, section 5): it is null there, resolved from data.train as without a file."""
    from conveyor.config import load_config
    from conveyor.data.registry import INSTRUCTION_MATH, INSTRUCTION_NUMBER

    data = tmp_path / "mydata.jsonl"
    data.write_text('{"question": "What is 2 plus 3?", "answer": "5"}\n')
    for path in (PRESET_DIR / "default.yaml", None):
        assert load_config(path, [f"data.train={data}"]).data.instruction == INSTRUCTION_MATH, path
        assert load_config(path, []).data.instruction == INSTRUCTION_NUMBER, path
