"""Evaluation with the user's reward (issue 44, section 1): ``conveyor eval --reward module:fn``
and a run's held-out evaluation graded by its own ``reward.fn`` report the mean reward and a pass
rate with its definition (reward >= a threshold, or the function's own ``correct`` metric), the
JSON names the grader of each figure, and the export's conveyor.json carries the reward so
``conveyor eval RUN`` reproduces the run's figure."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from conveyor.cli import app
from conveyor.config import load_config
from conveyor.data import load_dataset
from conveyor.eval import (
    BUILTIN_CHECKER,
    evaluate,
    load_export_settings,
    reward_grader,
    run_grader_kwargs,
)
from conveyor.rollout.engine import InferenceEngine

MODULE = textwrap.dedent('''
    def score(response, sample):
        """A reward of a task that is not a number answer: 1.0 for an even length, else 0.5."""
        return 1.0 if len(response) % 2 == 0 else 0.5

    def graded(response, sample):
        return len(response) / 10

    def is_right(response, sample):
        return 1.0 if len(response) % 3 == 0 else 0.0

    graded.correct = is_right  # the function's own correct metric

    def broken(response, sample):
        raise RuntimeError("broken reward")
''')


@pytest.fixture(scope="module")
def reward_module(tmp_path_factory):
    """``evalrewards`` importable here and in the reward workers (PYTHONPATH)."""
    d = tmp_path_factory.mktemp("evalrewards")
    (d / "evalrewards.py").write_text(MODULE)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(d))
        mp.setenv("PYTHONPATH", f"{d}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        sys.modules.pop("evalrewards", None)
        yield "evalrewards"


@pytest.fixture(scope="module")
def engine(tiny):
    eng = InferenceEngine(tiny.model, tiny.tokenizer, max_batch_size=8, seed=0)
    eng.start()
    yield eng, tiny.tokenizer
    eng.stop()


@pytest.fixture(scope="module")
def samples():
    return load_dataset("mawps:singleop:heldout", limit=4)


def _run(engine, samples, **kw):
    eng, tok = engine
    return evaluate(eng, tok, samples, max_new_tokens=8, progress=False, instruction="Answer:", **kw)


def test_eval_with_a_reward_reports_the_mean_reward_and_the_threshold_pass_rate(reward_module, engine, samples):
    res = _run(engine, samples, reward_fn=f"{reward_module}:score")
    texts = [r["responses"][0] for r in res.records]
    want = [1.0 if len(t) % 2 == 0 else 0.5 for t in texts]
    assert [r["rewards"] for r in res.records] == [[w] for w in want]
    assert res.reward_mean == pytest.approx(sum(want) / len(want))
    assert res.pass_at_1 == pytest.approx(sum(w >= 1.0 for w in want) / len(want))
    assert res.pass_definition == "reward >= 1 (evalrewards:score)" and res.pass_threshold == 1.0
    assert res.graders["pass_at_1"] == res.pass_definition and res.graders["reward_mean"] == "evalrewards:score"
    assert res.graders["format_rate"].startswith("conveyor.rewards.math:format_reward")
    summary = res.summary()  # the JSON keeps the mean reward and the graders
    assert summary["reward_mean"] == res.reward_mean and summary["reward_fn"] == "evalrewards:score"
    assert summary["reward_failures"] == 0
    lower = _run(engine, samples, reward_fn=f"{reward_module}:score", pass_threshold=0.5)
    assert lower.pass_at_1 == 1.0 and lower.pass_definition == "reward >= 0.5 (evalrewards:score)"


def test_the_functions_own_correct_metric_decides_the_pass_rate(reward_module, engine, samples):
    res = _run(engine, samples, reward_fn=f"{reward_module}:graded", pass_threshold=0.0)
    texts = [r["responses"][0] for r in res.records]
    assert [r["correct"] for r in res.records] == [[len(t) % 3 == 0] for t in texts]
    assert res.reward_mean == pytest.approx(sum(len(t) / 10 for t in texts) / len(texts))
    assert res.pass_definition == ("evalrewards:graded.correct >= 1.0 (the reward function's own correct "
                                   "metric)")
    assert res.pass_threshold is None  # not used


def test_failed_rewards_are_unknown_and_not_averaged(reward_module, engine, samples):
    res = _run(engine, samples, reward_fn=f"{reward_module}:broken")
    assert (res.reward_failures, res.correct_unknown, res.reward_mean, res.pass_at_1) == (4, 4, None, 0.0)


def test_without_a_reward_the_builtin_checker_is_named_and_no_reward_mean(engine, samples):
    res = _run(engine, samples)
    assert res.reward_fn is None and res.reward_mean is None
    assert res.pass_definition == f"correct >= 1.0: {BUILTIN_CHECKER}"
    assert res.graders["reward_mean"] is None and "reward_mean" not in res.summary()


def test_run_grader_only_for_a_users_reward() -> None:
    assert run_grader_kwargs(load_config(None, [])) == {}  # reward.fn=correctness: the built-in checker
    assert run_grader_kwargs(load_config(None, ["reward.fn=format"])) == {}
    got = run_grader_kwargs(load_config(None, ["reward.fn=my.mod:score", "reward.pass_threshold=0.7"]))
    assert got == {"reward_fn": "my.mod:score", "pass_threshold": 0.7, "check_timeout_s": 10.0}
    assert run_grader_kwargs(load_config(None, ["reward.fn=my.mod:score", "env.name=math_python",
                                                "rollout.tool=none"])) == {}  # the episodes grade themselves
    with pytest.raises(ValueError, match="finite"):
        reward_grader("math", float("nan"))


@pytest.fixture(scope="module")
def reward_run(reward_module, tmp_path_factory):
    """A tiny run trained and evaluated with reward.fn=evalrewards:score (a non-math reward)."""
    from conveyor.train import run_training

    run = tmp_path_factory.mktemp("reward_run") / "r"
    cfg = load_config(None, [
        "model.name=tiny", "trainer.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
        "data.heldout_limit=3", "run.eval_max_new_tokens=6", "run.progress=false", "run.export=true",
        "run.eval_before=false", "reward.workers=1", "trainer.total_steps=2", "run.eval_every=1", "rollout.tool=none",
        "trainer.num_threads=1", "rollout.engine_threads=1", f"reward.fn={reward_module}:score",
        "reward.pass_threshold=0.75", f"run.dir={run}"])
    run_training(cfg)
    return run


def test_a_runs_heldout_evaluation_grades_with_its_reward_and_eval_run_reproduces_it(reward_run, tmp_path):
    run = reward_run
    own = json.loads((run / "eval_after.json").read_text())
    assert own["reward_fn"] == "evalrewards:score" and own["pass_definition"] == "reward >= 0.75 (evalrewards:score)"
    rewards = [x for r in own["records"] for x in r["rewards"]]
    assert own["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert own["pass_at_1"] == pytest.approx(sum(x >= 0.75 for x in rewards) / len(rewards))
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    ev_after = next(e for e in events if e["event"] == "eval" and e["label"] == "after")
    assert ev_after["reward_mean"] == own["reward_mean"]
    settings = load_export_settings(run / "export")
    assert settings["reward"] == {"fn": "evalrewards:score", "pass_threshold": 0.75,
                                  "heldout_grader": "evalrewards:score"}
    out = tmp_path / "e.json"
    r = CliRunner().invoke(app, ["eval", "--model", str(run), "--no-progress", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "grading with reward evalrewards:score (the run's reward.fn" in " ".join(r.output.split())
    ev = json.loads(out.read_text())
    for key in ("pass_at_1", "reward_mean", "pass_definition", "graders", "reward_fn", "pass_threshold"):
        assert ev[key] == own[key], key
    assert [r["responses"] for r in ev["records"]] == [r["responses"] for r in own["records"]]


def test_eval_reward_flag_overrides_and_is_checked_before_the_model_loads(reward_run, tmp_path, monkeypatch):
    out = tmp_path / "e.json"
    r = CliRunner().invoke(app, ["eval", "--model", str(reward_run), "--no-progress", "-o", str(out),
                                 "--reward", "evalrewards:score", "--pass-threshold", "0.5"])
    assert r.exit_code == 0, r.output
    ev = json.loads(out.read_text())
    assert ev["pass_at_1"] == 1.0 and ev["pass_definition"] == "reward >= 0.5 (evalrewards:score)"
    import conveyor.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    r = CliRunner().invoke(app, ["eval", "--model", "tiny", "--reward", "nosuchmodule_xyz:fn", "--n", "1"])
    assert r.exit_code == 2 and "--reward nosuchmodule_xyz:fn" in r.output and "not found" in r.output, r.output
    r = CliRunner().invoke(app, ["eval", "--model", "tiny", "--pass-threshold", "0.5", "--n", "1"])
    assert r.exit_code == 2 and "--pass-threshold needs --reward" in r.output, r.output


def test_the_mid_run_heldout_curve_has_the_mean_reward(reward_run):
    """run.eval_every with a user's reward.fn: the held-out point at version 1 records the mean
    reward beside pass@1 (TensorBoard heldout/reward_mean) and its file names the grader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    mid = json.loads((reward_run / "eval_step_1.json").read_text())
    assert mid["reward_fn"] == "evalrewards:score" and mid["reward_mean"] is not None
    acc = EventAccumulator(str(reward_run / "tb"))
    acc.Reload()
    points = {e.step: e.value for e in acc.Scalars("heldout/reward_mean")}
    assert points[1] == pytest.approx(mid["reward_mean"])
