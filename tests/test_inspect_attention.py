"""Attention inspection (issue 13 section 4): the pure link functions on hand-made matrices, and
``conveyor inspect`` end to end on a 1-step tiny training run."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conveyor.cli import app
from conveyor.inspect_attention import (
    InspectError,
    Link,
    format_links,
    inspect_run,
    load_policy,
    plot_attention,
    select_attention,
    top_links,
)

STUB = [[1, 0, 0], [0.25, 0.75, 0], [0.1, 0.3, 0.6]]
LINE = re.compile(r"^Step (\d+): Token (\d+)(?: \".*\")? -> Token (\d+)(?: \".*\")?  (\d+\.\d\d)%$")


def test_issue_stub_matrix():
    links = top_links(STUB, 2, 2)
    assert format_links(links) == ["Step 1: Token 2 -> Token 2  60.00%", "Step 2: Token 1 -> Token 2  30.00%"]
    links = top_links(STUB, 2, 2, exclude_self=True)
    assert format_links(links) == ["Step 1: Token 1 -> Token 2  75.00%", "Step 2: Token 0 -> Token 2  25.00%"]
    # a torch tensor works the same; k larger than the row gives the whole row
    assert [ln.source for ln in top_links(torch.tensor(STUB), 2, 10)] == [2, 1, 0]


def test_normalised_per_target_and_labels():
    # an unnormalised row: weights are shares of the row (sources 0..i only; above the diagonal ignored)
    a = np.array([[2.0, 9.0, 9.0], [1.0, 3.0, 9.0], [0.0, 0.0, 0.0]])
    assert top_links(a, 1, 2) == [Link(1, 1, 0.75), Link(0, 1, 0.25)]
    assert format_links(top_links(a, 1, 1), labels=["a", "b\n", "c"]) == ['Step 1: Token 1 "b\\n" -> Token 1 "b\\n"  75.00%']
    assert top_links(a, 2, 3) == []  # no weight at all: no links


def test_ties_break_by_lower_source():
    a = np.tril(np.ones((4, 4)))
    a[3] = [0.2, 0.3, 0.3, 0.2]
    assert [(ln.source, round(ln.weight, 6)) for ln in top_links(a, 3, 4)] == [(1, 0.3), (2, 0.3), (0, 0.2), (3, 0.2)]
    assert [ln.source for ln in top_links(a, 3, 2, exclude_self=True)] == [1, 2]


def test_exclude_self_on_a_self_only_row_gives_no_links():
    a = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert top_links(a, 1, 3, exclude_self=True) == []
    assert top_links(a, 0, 3, exclude_self=True) == []  # token 0 has only itself
    assert format_links([]) == []
    assert top_links(a, 1, 3) == [Link(1, 1, 1.0)]  # zero-weight sources are not listed


def test_bad_arguments_name_value_and_range():
    with pytest.raises(InspectError, match=r"target token 3 is out of range: there are 3 tokens \(0\.\.2\)"):
        top_links(STUB, 3, 2)
    with pytest.raises(InspectError, match=r"target token -1 is out of range"):
        top_links(STUB, -1, 2)
    with pytest.raises(InspectError, match=r"k must be an integer >= 1, got 0"):
        top_links(STUB, 2, 0)
    with pytest.raises(InspectError, match=r"square"):
        top_links([[1, 0, 0]], 0, 1)
    with pytest.raises(InspectError, match=r"negative or non-finite"):
        top_links([[1, 0], [-0.5, 1.5]], 1, 1)
    att = [torch.softmax(torch.randn(1, 4, 3, 3), -1) for _ in range(2)]  # 2 layers, 4 heads
    with pytest.raises(InspectError, match=r"layer 2 is out of range: there are 2 layers \(0\.\.1\)"):
        select_attention(att, layer=2)
    with pytest.raises(InspectError, match=r"head 4 is out of range: there are 4 heads \(0\.\.3\)"):
        select_attention(att, head=4)
    with pytest.raises(InspectError, match="eager"):
        select_attention(())
    mean, layer = select_attention(att)
    assert layer == 1 and np.allclose(mean, att[1][0].mean(0).numpy())
    assert np.allclose(select_attention(att, 0, 3)[0], att[0][0, 3].numpy())


def test_plot_heat_map(tmp_path):
    out = plot_attention(np.tril(np.ones((5, 5))) / np.arange(1, 6)[:, None], list("ab$\nc"), 2, tmp_path / "x" / "h.png",
                         title="t")
    assert out.is_file() and out.stat().st_size > 1000
    with pytest.raises(InspectError, match="labels"):
        plot_attention(np.eye(3), ["a"], 1, tmp_path / "y.png")


# -- end to end ------------------------------------------------------------------------------

BASE = [
    "model.name=tiny", "trainer.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=10",
    "data.heldout_limit=2", "run.eval_max_new_tokens=6", "run.progress=false", "run.export=false",
    "reward.workers=1", "trainer.lr=1e-3", "rollout.tool=none", "trainer.total_steps=1",
]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 1-step tiny training run (checkpoint step_1, eval_after.json with 2 records)."""
    from conveyor.config import load_config
    from conveyor.train import run_training

    run = tmp_path_factory.mktemp("inspect") / "run"
    run_training(load_config(None, BASE + [f"run.dir={run}"]))
    assert (run / "checkpoints" / "step_1" / "DONE").is_file() and (run / "eval_after.json").is_file()
    return run


def _groups(output: str) -> dict[int, list[tuple[int, int, float]]]:
    groups: dict[int, list[tuple[int, int, float]]] = {}
    for line in output.splitlines():
        m = LINE.match(line)
        if m:
            s, j, i, w = int(m.group(1)), int(m.group(2)), int(m.group(3)), float(m.group(4))
            groups.setdefault(i, []).append((s, j, w))
    return groups


def test_cli_inspect_end_to_end(tiny_run, tmp_path):
    png = tmp_path / "attn.png"
    r = CliRunner().invoke(app, ["inspect", str(tiny_run), "--sample", "1", "--top", "3", "--plot", str(png), "--all"])
    assert r.exit_code == 0, r.output
    assert "policy: checkpoint step_1 (policy version 1) on tiny" in r.output
    assert "layer 1 of 0..1, mean over heads (4 heads)" in r.output
    m = re.search(r"response tokens (\d+)\.\.(\d+)", r.output)
    first, last = int(m.group(1)), int(m.group(2))
    groups = _groups(r.output)
    assert sorted(groups) == list(range(first, last + 1))  # every response token is a target
    for i, links in groups.items():
        assert [s for s, _, _ in links] == list(range(1, len(links) + 1)) and 1 <= len(links) <= 3
        ws = [w for _, _, w in links]
        assert ws == sorted(ws, reverse=True) and sum(ws) <= 100.0 + 0.02
        assert all(j <= i for _, j, _ in links)
    assert png.is_file() and png.stat().st_size > 1000

    r = CliRunner().invoke(app, ["inspect", str(tiny_run), "--layer", "0", "--head", "2", "--target", str(last),
                                 "--top", "2", "--exclude-self"])
    assert r.exit_code == 0, r.output
    groups = _groups(r.output)
    assert list(groups) == [last] and all(j < last for _, j, _ in groups[last])


def test_cli_inspect_says_what_the_fields_mean_and_summarises_first(tiny_run):
    """Issue 44, section 5: a header says what 'Step', 'Token j' and w% mean; by default a short
    summary (the most attended tokens, the strongest links) instead of every response token's
    links, which --all prints."""
    r = CliRunner().invoke(app, ["inspect", str(tiny_run), "--top", "3"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "how to read a link 'Step s: Token j \"a\" -> Token i \"b\" w%': target token i" in out, out
    assert "i's s-th strongest link (s = 1..3)" in out and "positions count from the first prompt token" in out
    assert not _groups(r.output)  # no per-target lines by default
    m = re.search(r"response tokens (\d+)\.\.(\d+)", r.output)
    first, last = int(m.group(1)), int(m.group(2))
    assert f"summary over the response's {last - first + 1} tokens" in out
    strongest = r.output.split("strongest links:")[1].splitlines()[1:]
    pairs = [re.match(r"^\s+Token (\d+) \".*\" -> Token (\d+) \".*\"  (\d+\.\d\d)%$", line) for line in strongest]
    pairs = [p for p in pairs if p]
    assert 1 <= len(pairs) <= 10
    ws = [float(p.group(3)) for p in pairs]
    assert ws == sorted(ws, reverse=True) and all(first <= int(p.group(2)) <= last for p in pairs)
    full = CliRunner().invoke(app, ["inspect", str(tiny_run), "--top", "3", "--all"])
    groups = _groups(full.output)
    assert max(w for links in groups.values() for _, _, w in links) == ws[0]  # the summary's first is the strongest
    assert "--all" in out and len(r.output.splitlines()) < len(full.output.splitlines())


def test_cli_bad_arguments(tiny_run):
    def fails(*args: str) -> str:
        r = CliRunner().invoke(app, ["inspect", *args])
        assert r.exit_code == 2, r.output
        return " ".join(r.output.split())  # the error line may be wrapped

    assert "--sample 2 is out of range: there are 2 records in eval_after.json (0..1)" in fails(str(tiny_run), "--sample", "2")
    assert "layer 2 is out of range: there are 2 layers (0..1)" in fails(str(tiny_run), "--layer", "2")
    assert "is not a conveyor run directory (no config.json)" in fails(str(tiny_run.parent / "nope"))
    # a file type matplotlib cannot write: refused before the forward pass, no traceback (fresh-user finding)
    out = fails(str(tiny_run), "--plot", str(tiny_run.parent / "x.txt"))
    assert "--plot" in out and ".txt is not an image type" in out and ".png" in out and "Traceback" not in out
    assert "no file type" in fails(str(tiny_run), "--plot", str(tiny_run.parent / "heatmap"))


def test_policy_sources(tiny_run, tmp_path):
    from conveyor.checkpoint import export_policy

    ck = load_policy(tiny_run)
    saved = torch.load(tiny_run / "checkpoints" / "step_1" / "trainer.pt", weights_only=False)["model"]
    for name, p in ck.model.state_dict().items():
        assert torch.equal(p, saved[name]), name  # the trained weights, not the initial ones
    assert ck.trained and ck.model.config._attn_implementation == "eager"
    res = inspect_run(tiny_run, top=2, head=1, policy=ck)
    with pytest.raises(InspectError, match=r"head 4 is out of range: there are 4 heads \(0\.\.3\)"):
        inspect_run(tiny_run, head=4, policy=ck)
    with pytest.raises(InspectError, match=r"--target 999 is out of range"):
        inspect_run(tiny_run, target=999, policy=ck)

    # a copy with only config + evaluation, and a damaged newer checkpoint: skipped (not moved),
    # then the base model, said so
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "eval_after.json"):
        shutil.copy(tiny_run / name, bare / name)
    bad = bare / "checkpoints" / "step_2"
    bad.mkdir(parents=True)
    (bad / "DONE").write_text("2")
    (bad / "manifest.json").write_text(json.dumps({"files": {"trainer.pt": {"bytes": 5, "sha256": "0"}}}))
    notes: list[str] = []
    base = load_policy(bare, warn=notes.append)
    assert not base.trained and "untrained" in base.source and bad.is_dir()
    assert any("step_2 skipped: trainer.pt missing" in n for n in notes)
    assert any("not the run's policy" in n for n in notes)

    # an export of the checkpoint's policy is preferred and gives the same attention
    export_policy(ck.model, ck.tokenizer, bare / "export")
    ex = load_policy(bare)
    assert "export" in ex.source and ex.trained
    res2 = inspect_run(bare, top=2, head=1, policy=ex)
    assert res2.lines == res.lines and np.allclose(res2.matrix, res.matrix, atol=1e-6)


def _inspect_output(run) -> str:
    r = CliRunner().invoke(app, ["inspect", str(run), "--target", "3", "--top", "1"])
    assert r.exit_code == 0, (r.output, r.exception)
    return " ".join(r.output.split())  # rich may wrap the lines


def test_cli_inspect_says_which_policy_version_the_record_came_from(tiny_run, tmp_path):
    """The evaluation files record the policy version they measured; `conveyor inspect` names it
    and warns when it is not the version of the policy it loads (files without the field, from
    an older conveyor, still load)."""
    assert json.loads((tiny_run / "eval_after.json").read_text())["policy_version"] == 1
    out = _inspect_output(tiny_run)
    assert f"of {tiny_run / 'eval_after.json'} (" in out and "generated by policy version 1;" in out
    assert "warning:" not in out

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("run.lock"))
    ev = json.loads((run / "eval_after.json").read_text())
    (run / "eval_after.json").write_text(json.dumps({**ev, "policy_version": 0}))
    out = _inspect_output(run)
    assert ("warning: version mismatch: record 0 of eval_after.json was generated by policy version 0, but the "
            "policy loaded is version 1 (checkpoint step_1 (policy version 1) on tiny)") in out

    old = {k: v for k, v in ev.items() if k != "policy_version"}
    (run / "eval_after.json").write_text(json.dumps(old))
    out = _inspect_output(run)  # an old eval_after.json: the version of its eval event
    assert "generated by policy version 1 (from its eval event in events.jsonl);" in out and "warning:" not in out
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    (run / "events.jsonl").write_text("".join(json.dumps({**e, "superseded": True} if e["event"] == "eval" else e) + "\n"
                                              for e in events))  # a resume superseded it: unknown
    out = _inspect_output(run)
    assert "generated by an unknown policy version;" in out
    assert ("warning: cannot check that record 0 of eval_after.json was generated by the policy loaded (version 1): "
            "eval_after.json records no policy_version (an older conveyor wrote it)") in out

    (run / "eval_after.json").rename(run / "eval_step_1.json")  # an old file's version is in its name
    out = _inspect_output(run)
    assert f"of {run / 'eval_step_1.json'} (" in out and "generated by policy version 1 (from the file name);" in out
    assert "warning:" not in out


def test_policy_version_of_an_export_and_the_check(tiny, tmp_path):
    from conveyor.checkpoint import export_policy
    from conveyor.config import load_config
    from conveyor.eval import write_export_settings
    from conveyor.inspect_attention import Policy, Trajectory, eval_file_version, version_check
    from conveyor.runtime_files import atomic_write_json

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(None, ["model.name=tiny"])
    atomic_write_json(run / "config.json", cfg.to_dict())
    export_policy(tiny.model, tiny.tokenizer, run / "export")
    notes: list[str] = []
    assert load_policy(run, warn=notes.append).version is None  # no conveyor.json: unknown, said so
    assert any("the export's policy version is unknown" in n for n in notes)
    write_export_settings(run / "export", cfg, policy_version=3)
    policy = load_policy(run)
    assert policy.version == 3 and "policy version 3" in policy.source

    assert eval_file_version(run / "eval_after.json", {"policy_version": 2}) == (2, "recorded")
    assert eval_file_version(run / "eval_step_4.json", {})[0] == 4
    assert eval_file_version(run / "eval_before.json", {})[0] == 0
    assert eval_file_version(run / "eval_after.json", {})[0] is None  # no events.jsonl either
    traj = Trajectory([1], [2], "s", run / "eval_step_2.json", 0, True, 2, "recorded")
    assert "was generated by policy version 2, but the policy loaded is version 3" in version_check(traj, policy)
    assert version_check(Trajectory([1], [2], "s", run / "eval_after.json", 0, None, 3), policy) is None
    unknown = Policy(None, None, "the run's export (x, policy version unknown)", True, [], None)
    assert "its version is unknown" in version_check(traj, unknown)


def test_a_run_being_trained_is_inspected_at_its_newest_checkpoint_and_refused_by_eval(tiny_run, tmp_path,
                                                                                       monkeypatch):
    """Fresh-user trial 4, findings 4-5: on a run being trained (its run.lock held), `conveyor
    inspect` failed on a checkpoint rotated away mid-read, and inspect / eval took the export of
    an earlier finish as "the run's final policy". Now inspect takes the newest checkpoint (a
    vanished one skipped, the list read again) and eval refuses, naming the holder."""
    from conveyor.checkpoint import export_policy
    from conveyor.eval import resolve_eval_model
    from conveyor.runtime_files import RunLock, lock_holder

    live = tmp_path / "live"
    live.mkdir()
    for name in ("config.json", "eval_after.json"):
        shutil.copy(tiny_run / name, live / name)
    for step in ("step_1", "step_2"):
        shutil.copytree(tiny_run / "checkpoints" / "step_1", live / "checkpoints" / step)
    base = load_policy(tiny_run)
    export_policy(base.model, base.tokenizer, live / "export")
    (live / "export" / "conveyor.json").write_text(json.dumps({"policy_version": 0}))
    assert lock_holder(live) is None  # no lock file yet
    real_load = torch.load

    def rotating_load(path, *a, **k):  # the trainer's rotation removes step_2 as it is read
        if "step_2" in str(path):
            shutil.rmtree(live / "checkpoints" / "step_2")
            raise FileNotFoundError(path)
        return real_load(path, *a, **k)

    with RunLock(live):
        assert lock_holder(live)["pid"] == os.getpid()
        with pytest.raises(ValueError, match=r"the run is being trained now by process \d+ .*its export "
                                             r".*holds policy version 0 from before; wait for it to finish"):
            resolve_eval_model(str(live))
        monkeypatch.setattr(torch, "load", rotating_load)
        notes: list[str] = []
        p = load_policy(live, warn=notes.append)
        monkeypatch.setattr(torch, "load", real_load)
    assert "checkpoint step_1" in p.source and p.version == 1
    assert any("being trained now" in n and "export (policy version 0) is from before" in n for n in notes)
    assert any("step_2 was removed while being read" in n for n in notes)
    assert lock_holder(live) is None
    assert "export" in load_policy(live).source  # finished (no holder): the export again
    assert resolve_eval_model(str(live))[0] == str(live / "export")
