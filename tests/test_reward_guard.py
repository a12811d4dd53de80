"""A reward function that always fails (issue 44, section 2): refused at start-up, before the
model loads, naming the function; during a run, ``reward.max_failed_steps`` steps in a row with
every reward failed stop the run with a checkpoint and a non-zero exit code."""

from __future__ import annotations

import json
import sys
import textwrap
from types import SimpleNamespace

import pytest

from conveyor.config import load_config
from conveyor.rewards.guard import (
    FailedRewardSteps,
    RewardProbeError,
    RewardsFailedError,
    probe_reward_fn,
    well_formed_response,
)
from conveyor.types import Sample

FAST = [
    "model.name=tiny", "trainer.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
    "run.progress=false", "run.export=false", "reward.workers=1", "rollout.tool=none",
    "trainer.num_threads=1", "rollout.engine_threads=1", "run.eval_before=false", "run.eval_after=false",
    "data.heldout=", "reward.timeout_s=2",
]

MODULE = textwrap.dedent('''
    import math

    def raises(response, sample):
        raise RuntimeError("my reward is broken")

    def nan(response, sample):
        return math.nan

    def string(response, sample):
        return "1.0"

    def none(response, sample):
        return None

    def good(response, sample):
        return 1.0 if response.strip().endswith(sample.answer) else 0.0

    def only_well_formed(response, sample):
        # passes the start-up probe, fails on anything the tiny model writes
        if response.startswith("Answer: "):
            return 1.0
        raise ValueError("cannot parse " + response[:20])
''')


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    """``guardrewards``: reward functions that fail in each way, importable by the workers."""
    (tmp_path / "guardrewards.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}")
    sys.modules.pop("guardrewards", None)
    return "guardrewards"


SAMPLE = Sample("s/0", "What is 3 plus 4?", "7", "test")


def test_well_formed_response_is_the_answer_after_the_mark() -> None:
    assert well_formed_response(SAMPLE) == "Answer: 7"
    assert well_formed_response(Sample("s/1", "q", "", "test")) == "Answer: 42"


@pytest.mark.parametrize(("fn", "error"), [
    ("raises", "RuntimeError: my reward is broken"),
    ("nan", "non-finite"),
    ("string", "returned str '1.0', not a number"),
    ("none", "returned NoneType None, not a number"),
])
def test_probe_refuses_a_reward_that_fails_naming_the_function(rewards_module, fn, error) -> None:
    with pytest.raises(RewardProbeError) as e:
        probe_reward_fn(f"{rewards_module}:{fn}", SAMPLE, timeout_s=5)
    msg = str(e.value)
    assert f"reward.fn='{rewards_module}:{fn}': {fn}(response, sample) failed at start-up" in msg, msg
    assert "sample 's/0'" in msg and "'Answer: 7'" in msg and error in msg, msg


def test_probe_passes_a_working_reward_and_skips_the_builtins(rewards_module) -> None:
    assert probe_reward_fn(f"{rewards_module}:good", SAMPLE, timeout_s=5) == 1.0
    assert probe_reward_fn("math", SAMPLE) is None  # built-ins are not probed (no worker started)


def test_a_failing_reward_is_refused_before_the_model_loads(rewards_module, tmp_path, monkeypatch) -> None:
    import conveyor.train as train_mod

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the reward was checked")

    monkeypatch.setattr(train_mod, "load_model", no_model)
    monkeypatch.setattr(train_mod, "load_tokenizer", no_model)
    cfg = load_config(None, FAST + [f"reward.fn={rewards_module}:raises", f"run.dir={tmp_path / 'r'}"])
    with pytest.raises(RewardProbeError, match=r"reward.fn='guardrewards:raises': raises\(response, sample\) "
                                               r"failed at start-up.*my reward is broken"):
        train_mod.run_training(cfg)
    assert not (tmp_path / "r").exists()  # nothing written


def test_check_at_start_false_skips_the_probe(rewards_module, monkeypatch) -> None:
    import conveyor.train as train_mod

    cfg = load_config(None, FAST + [f"reward.fn={rewards_module}:raises", "reward.check_at_start=false"])
    assert cfg.reward.check_at_start is False and load_config(None, []).reward.check_at_start is True
    monkeypatch.setattr(train_mod, "probe_reward_fn", lambda *a, **k: pytest.fail("probed"))
    monkeypatch.setattr(train_mod, "load_model", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("model")))
    with pytest.raises(RuntimeError, match="model"):  # went past the probe to the model load
        train_mod.run_training(cfg)


def _traj(failed: bool, error: str | None = None):
    return SimpleNamespace(metadata={"reward_failed": failed, "reward_error": error})


def test_failed_reward_steps_counts_only_steps_whose_every_reward_failed() -> None:
    guard = FailedRewardSteps(3, "m:f")
    all_failed = [_traj(True, "ValueError: x"), _traj(True, "ValueError: y")]
    guard.after_step(1, all_failed)
    guard.after_step(2, all_failed)
    guard.after_step(3, [_traj(True), _traj(False)])  # one reward worked: the count starts again
    assert guard.in_a_row == 0
    guard.after_step(4, all_failed)
    guard.after_step(5, all_failed)
    with pytest.raises(RewardsFailedError, match=r"reward.fn=m:f: every reward failed in 3 training steps in a "
                                                 r"row \(reward.max_failed_steps=3\), up to version 6; the last "
                                                 r"error: ValueError: y"):
        guard.after_step(6, all_failed)
    never = FailedRewardSteps(None, "m:f")  # reward.max_failed_steps=null: never stops
    for v in range(10):
        never.after_step(v, all_failed)
    assert load_config(None, []).reward.max_failed_steps == 3
    assert load_config(None, ["reward.max_failed_steps=null"]).reward.max_failed_steps is None


def test_a_run_whose_every_reward_fails_stops_with_a_checkpoint_and_exit_code_1(rewards_module, tmp_path) -> None:
    """The function passes the start-up probe (a well-formed response) but fails on every response
    the model writes: the run stops after reward.max_failed_steps=2 steps, not at total_steps=6,
    with a checkpoint at version 2 and exit code 1."""
    from typer.testing import CliRunner

    from conveyor.cli import app

    run = tmp_path / "r"
    r = CliRunner().invoke(app, ["train", *FAST, f"reward.fn={rewards_module}:only_well_formed",
                                 "trainer.total_steps=6", "reward.max_failed_steps=2", "run.checkpoint_every=100",
                                 f"run.dir={run}"])
    assert r.exit_code == 1, r.output
    out = " ".join(r.output.split())
    assert (f"reward.fn={rewards_module}:only_well_formed: every reward failed in 2 training steps in a row "
            "(reward.max_failed_steps=2)") in out, out
    assert "ValueError: cannot parse" in out and "The last state was checkpointed" in out, out
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["rollout/reward_failed_share"] == 1.0 for row in rows)
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")] == ["step_2"]
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "error" and "RewardsFailedError" in e["error"] for e in events)
