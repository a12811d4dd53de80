"""Agents end to end (issue 14): `conveyor train` with env.name=guess, math_python and a user
environment by import path (tiny model, 2 steps) writes the agent metrics; the held-out
evaluation and `conveyor eval --env` run the environment's episodes; an export remembers its
environment."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conveyor.cli import app
from conveyor.config import load_config
from conveyor.envs.sandbox import BWRAP_INSTALL_HINT, bwrap_path
from conveyor.train import run_training

BASE = [
    "model.name=tiny", "trainer.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=6",
    "run.eval_max_new_tokens=6", "run.progress=false", "reward.workers=1", "trainer.lr=1e-3",
    "trainer.total_steps=2", "run.final_checkpoint=none", "env.max_turns=3", "env.max_episode_tokens=40",
]
AGENT_KEYS = ("agent/turns_mean", "agent/tool_calls_mean", "agent/tool_call_rate", "agent/tool_call_success_rate",
              "agent/episodes_cut_share", "agent/sandbox_incidents")


def rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_guess_env_evaluates_episodes_and_exports_the_env(tmp_path):
    run = tmp_path / "r"
    cfg = load_config(None, BASE + ["env.name=guess", "env.options.high=10", "env.options.max_guesses=3",
                                    "data.train=guess:train?size=20&high=10", "data.heldout=guess:heldout?size=8&high=10",
                                    "data.heldout_limit=2", f"run.dir={run}"])
    res = run_training(cfg)
    assert res.steps == 2
    saved = json.loads((run / "config.json").read_text())
    assert saved["env"]["name"] == "guess" and saved["rollout"]["tool"] == "none"  # resolved, recorded
    for r in rows(run):
        assert all(k in r for k in AGENT_KEYS)
        assert 1 <= r["agent/turns_mean"] <= 3 and r["agent/tool_calls_mean"] == 0
        assert r["agent/sandbox_incidents"] == 0 and "agent/incidents/timeout" not in r  # no sandboxed tool
    before = json.loads((run / "eval_before.json").read_text())
    assert before["env"] == "guess" and before["num_problems"] == 2 and 1 <= before["turns_mean"] <= 3
    assert all(len(r["turns"]) == 1 for r in before["records"])
    exported = json.loads((run / "export" / "conveyor.json").read_text())
    assert exported["env"]["name"] == "guess" and exported["env"]["options"] == {"high": 10, "max_guesses": 3}
    # `conveyor eval --model RUN/export` runs the run's environment on its held-out games by default
    out = tmp_path / "again.json"
    r = CliRunner().invoke(app, ["eval", "--model", str(run / "export"), "--no-progress", "-o", str(out)])
    assert r.exit_code == 0, r.output
    again = json.loads(out.read_text())
    assert again["env"] == "guess" and again["dataset"].startswith("guess:heldout") and again["num_problems"] == 2
    assert again["pass_at_1"] == pytest.approx(json.loads((run / "eval_after.json").read_text())["pass_at_1"])


@pytest.mark.skipif(bwrap_path() is None, reason=f"skipped: {BWRAP_INSTALL_HINT}")
def test_train_math_python_env_writes_sandbox_metrics(tmp_path):
    run = tmp_path / "r"
    cfg = load_config(None, BASE + ["env.name=math_python", "run.eval_before=false", "run.eval_after=false",
                                    "run.export=false", "env.sandbox.wall_s=3", f"run.dir={run}"])
    res = run_training(cfg)
    assert res.steps == 2
    for r in rows(run):
        assert all(k in r for k in AGENT_KEYS)
        # every incident kind is a column for a sandboxed tool, even at 0
        assert all(f"agent/incidents/{k}" in r for k in ("timeout", "memory", "fork_limit", "output_limit"))
        assert r["agent/turns_mean"] >= 1 and 0 <= r["rollout/accuracy"] <= 1
    groups = [json.loads(x) for x in (run / "trained.jsonl").read_text().splitlines()]
    assert sum(len(g["groups"]) for g in groups) == 4


def test_train_user_env_by_import_path(tmp_path):
    run = tmp_path / "r"
    cfg = load_config(None, BASE + ["env.name=agent_env_helpers:TwoStepEnv", "env.options.per_turn=0.5",
                                    "data.heldout=", "run.export=false", "rollout.max_new_tokens=4",
                                    f"run.dir={run}"])
    run_training(cfg)
    for r in rows(run):
        # two turns of 0.5 each, whatever the model says: the user's environment ran every episode
        assert r["agent/turns_mean"] == 2 and r["reward/mean"] == pytest.approx(1.0)
        assert r["rollout/accuracy"] == 1.0 and r["agent/episodes_cut_share"] == 0


def test_eval_cli_runs_an_environment(tmp_path):
    out = tmp_path / "guess.json"
    r = CliRunner().invoke(app, ["eval", "--model", "tiny", "--env", "guess", "--n", "3", "--max-turns", "2",
                                 "--max-new-tokens", "6", "--env-option", "high=10", "--no-progress", "-o", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    # --env-option high=10 is the range the games play (it was silently 100), recorded in the spec
    assert res["env"] == "guess" and res["dataset"] == "guess:heldout?high=10" and res["num_problems"] == 3
    assert all(1 <= int(rec["answer"]) <= 10 for rec in res["records"])
    assert 1 <= res["turns_mean"] <= 2 and res["max_turns"] == 2 and res["tool_call_rate"] == 0
    assert res["env_options"] == {"high": 10} and res["tool_format"] == "auto"  # the episodes' settings recorded
    # an episode cut at --max-turns 2 (6 guesses allowed) ended without an answer: wrong, not unknown
    assert res["correct_unknown"] == 0 and all(v in (True, False) for rec in res["records"] for v in rec["correct"])
    assert res["instruction"] == "" and all(1 <= t <= 2 for rec in res["records"] for t in rec["turns"])
    assert '"turns_mean"' in r.output  # the summary printed
    for args, message in [
        (["--env", "guess", "--tool", "calculator"], "--tool calculator is the single-turn calculator"),
        (["--max-turns", "2"], "need --env"),
        (["--env", "guess", "--env-option", "size=3"], "env.options {'high': 10, 'size': 3} do not fit"),
        (["--env", "guess", "--env-option", "high=abc"],
         "env.options.high='abc' (str): the guess environment expects an integer >= 1"),
        (["--env", "guess", "--dataset", "guess:heldout?high=100"],
         "--dataset=guess:heldout?high=100 plays numbers up to high=100 but --env-option high=10"),
        (["--env", "shell"], "env.name must be none, guess, math_python, 'package.module:factory' (a user "
                             "environment) or 'openai:package.module:function'"),
    ]:
        r = CliRunner().invoke(app, ["eval", "--model", "tiny", "--n", "1", "--env-option", "high=10", *args])
        assert r.exit_code == 2 and message in " ".join(r.output.split()), r.output
    # the value is quoted once, not "got 'shell' (got 'shell')" (fresh-user finding)
    r = CliRunner().invoke(app, ["eval", "--model", "tiny", "--env", "shell"])
    assert r.exit_code == 2 and " ".join(r.output.split()).count("'shell'") == 1, r.output


def test_eval_names_an_exports_guess_range_as_its_origin(tmp_path):
    """Fresh-user finding: with a run's export whose env.options.high is 10, `--dataset
    guess:heldout?high=100` was refused as disagreeing with "env.options.high=10", which the user
    never wrote: the message now names the export's settings file (and a flag as the flag)."""
    from conveyor.eval import EXPORT_SETTINGS_FILE

    export = tmp_path / "export"
    export.mkdir()
    (export / EXPORT_SETTINGS_FILE).write_text(json.dumps({
        "format": 1, "dataset": "guess:heldout?high=10", "env": {"name": "guess", "options": {"high": 10}}}))
    from conveyor.models import load_model

    m = load_model("tiny")
    m.model.save_pretrained(export)
    m.tokenizer.save_pretrained(export)
    r = CliRunner().invoke(app, ["eval", "--model", str(export), "--n", "1", "--dataset", "guess:heldout?high=100"])
    out = "".join(r.output.split())  # (a long path wraps anywhere)
    assert r.exit_code == 2 and f"butenv.options.high=10(from{export / EXPORT_SETTINGS_FILE})" in out, r.output
    r = CliRunner().invoke(app, ["eval", "--model", str(export), "--n", "1", "--env-option", "high=20",
                                 "--dataset", "guess:heldout?high=100"])
    assert r.exit_code == 2 and "but --env-option high=20" in " ".join(r.output.split()), r.output


def test_inspect_takes_an_episodes_exact_tokens(tmp_path):
    """Fresh-user finding: `conveyor inspect` of an environment run rebuilt the single-turn prompt
    (a different token sequence from the episode's). The evaluation now records the first episode's
    ids and inspect uses them as they are; a record from before, without them, is refused."""
    from conveyor.inspect_attention import InspectError, inspect_run, load_trajectory
    from conveyor.models import load_model
    from conveyor.runtime_files import atomic_write_json

    run = tmp_path / "run"
    run.mkdir()
    atomic_write_json(run / "config.json", load_config(None, [*BASE, "env.name=guess", "env.options.high=10",
                                                              "data.heldout=guess:heldout?high=10"]).to_dict())
    r = CliRunner().invoke(app, ["eval", "--model", "tiny", "--env", "guess", "--n", "2", "--max-turns", "2",
                                 "--max-new-tokens", "6", "--env-option", "high=10", "--no-progress",
                                 "-o", str(run / "eval_after.json")])
    assert r.exit_code == 0, r.output
    ev = json.loads((run / "eval_after.json").read_text())
    ids = ev["records"][1]["episode_ids"]
    assert len(ids["response"]) == len(ids["action_mask"]) and 0 in ids["action_mask"]  # an observation inside
    tok = load_model("tiny").tokenizer
    tr = load_trajectory(run, tok, sample=1)
    assert tr.exact_ids and tr.prompt_ids == ids["prompt"] and tr.response_ids == ids["response"]
    res = inspect_run(run, sample=1, top=1)
    assert res.prompt_len == len(ids["prompt"]) and len(res.trajectory.ids) == len(ids["prompt"]) + len(ids["response"])
    r = CliRunner().invoke(app, ["inspect", str(run), "--sample", "1", "--top", "1"])
    assert r.exit_code == 0 and "the episode exactly as generated" in " ".join(r.output.split()), r.output
    for rec in ev["records"]:
        del rec["episode_ids"]
    (run / "eval_after.json").write_text(json.dumps(ev))
    with pytest.raises(InspectError, match="episode of env guess written without its token ids"):
        load_trajectory(run, tok, sample=0)
