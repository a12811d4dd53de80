"""Config parsing (unknown keys, overrides, errors) and the pass@k estimator."""

from __future__ import annotations

import math
import re
from itertools import combinations

import pytest

from conveyor.config import ConfigError, TrainConfig, load_config
from conveyor.eval import pass_at_k


def test_defaults_are_async_smollm2_on_mawps():
    cfg = load_config()
    assert cfg.model.name == "smollm2-135m-instruct"
    assert cfg.data.train.startswith("mawps:")
    assert cfg.asynchronous.eta is not None and cfg.asynchronous.eta >= 1
    assert cfg.to_dict()["async"]["eta"] == cfg.asynchronous.eta


def test_overrides_and_files(tmp_path):
    cfg = load_config(None, ["async.eta=0", "trainer.lr=1e-5", "rollout.stop_never_mind=1"][:2])
    assert cfg.asynchronous.eta == 0 and cfg.trainer.lr == 1e-5
    p = tmp_path / "c.yaml"
    p.write_text("trainer:\n  batch_size: 3\nasync:\n  eta: null\n")
    cfg = load_config(p, ["rollout.group_size=2"])
    assert cfg.trainer.batch_size == 3 and cfg.asynchronous.eta is None and cfg.rollout.group_size == 2
    # a saved run config (JSON, alias spelling) loads back identically
    j = tmp_path / "c.json"
    import json

    j.write_text(json.dumps(cfg.to_dict()))
    assert load_config(j) == cfg


@pytest.mark.parametrize("item, needle", [
    ("trainer.lr=-1", "trainer.lr"),
    ("trainer.nope=1", "trainer.nope"),
    ("async.eta=-1", "async.eta"),
    ("noequals", "key=value"),
])
def test_bad_overrides_name_the_key(item, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, [item])


def test_bad_file_named(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_group_size_vs_concurrency_checked():
    with pytest.raises(Exception, match="max_concurrent"):
        TrainConfig.model_validate({"rollout": {"group_size": 8, "max_concurrent": 4}})


def brute_pass_at_k(n, c, k):
    """Probability that a random k-subset of n samples (c correct) holds a correct one."""
    items = [1] * c + [0] * (n - c)
    subsets = list(combinations(range(n), k))
    return sum(any(items[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n, c, k, expected", [
    (1, 0, 1, 0.0), (1, 1, 1, 1.0),
    (4, 1, 1, 0.25),          # c / n
    (4, 1, 2, 0.5),           # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 2, 0.7),           # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
    (4, 3, 2, 1.0),           # n - c < k
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert math.isclose(pass_at_k(n, c, k), expected, abs_tol=1e-12)
    assert math.isclose(pass_at_k(n, c, k), brute_pass_at_k(n, c, k), abs_tol=1e-12)


def test_pass_at_k_rejects_bad_arguments():
    for args in [(0, 0, 1), (3, 4, 1), (3, 1, 4), (3, 1, 0)]:
        with pytest.raises(ValueError, match="pass_at_k"):
            pass_at_k(*args)


def test_shipped_default_config_file_matches_the_code_defaults():
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
    assert load_config(path) == TrainConfig()


def test_shipped_default_config_file_lists_every_key():
    """configs/default.yaml lists every config key (README: "lists every default"); a key missing
    there still loads (its default fills in), so the equality test above cannot see it."""
    from pathlib import Path

    import yaml
    from pydantic import BaseModel

    def missing(model: type[BaseModel], data, prefix: str = "") -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            key = field.alias or name  # async
            if not isinstance(data, dict) or key not in data:
                out.append(prefix + key)
            elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                out += missing(field.annotation, data[key], f"{prefix}{key}.")
        return out

    path = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
    assert missing(TrainConfig, yaml.safe_load(path.read_text())) == []


def test_runtime_proximal_methods_accept_tool_episodes():
    # old log-probs follow trajectory token spans (issue 12): tool episodes are no longer refused
    for method in ("partial_sync", "dedicated"):
        cfg = load_config(None, [f"proximal.method={method}", "rollout.tool=calculator"])
        assert cfg.proximal.method == method and cfg.rollout.tool == "calculator"


def test_settings_that_can_never_learn_are_refused():
    # greedy groups: identical responses, equal rewards, every advantage 0
    with pytest.raises(ConfigError,
                       match=r"rollout\.temperature=0 \(greedy\) with rollout\.group_size=8"):
        load_config(None, ["rollout.temperature=0"])
    # a group of one under GRPO is its own mean: advantage 0 at any temperature
    with pytest.raises(ConfigError, match=r"loss\.advantage=dr_grpo with rollout\.group_size=1"):
        load_config(None, ["rollout.group_size=1", "loss.advantage=dr_grpo"])
    # one greedy response per prompt with the batch-mean baseline can still learn: allowed, warned
    cfg = load_config(None, ["rollout.temperature=0", "rollout.group_size=1",
                             "loss.advantage=reinforce"])
    from conveyor.preflight import config_warnings

    assert any("greedy" in w for w in config_warnings(cfg))
    assert load_config(None, ["rollout.temperature=0.01"]).rollout.temperature == 0.01


def test_none_words_in_overrides_mean_the_literal_none():
    # `run.final_checkpoint=none` parses as null on the command line; it means the word
    assert load_config(None, ["run.final_checkpoint=none"]).run.final_checkpoint == "none"
    assert load_config(None, ["run.final_checkpoint=full"]).run.final_checkpoint == "full"


def test_total_steps_zero_is_refused():
    """trainer.total_steps=0 was accepted: a run that trains nothing (no test or doc gives 0 a
    meaning; an evaluation alone is `conveyor eval`)."""
    with pytest.raises(ConfigError, match=r"trainer\.total_steps: Input should be greater than or equal to 1 \(got 0\)"):
        load_config(None, ["trainer.total_steps=0"])
    assert load_config(None, ["trainer.total_steps=1"]).trainer.total_steps == 1


def _cli_fails(*args: str) -> str:
    """``conveyor ARGS`` exits 2 with one clear error (no traceback); the output, unwrapped."""
    from typer.testing import CliRunner

    from conveyor.cli import app

    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 2, (r.output, r.exception)
    assert "Traceback" not in r.output and r.output.startswith("error: "), r.output
    return " ".join(r.output.split())  # rich wraps the line


def test_config_file_after_an_override_says_it_must_come_first():
    """A fresh-user trial: `conveyor train model.name=tiny runs/bad.yaml` said "override
    'runs/bad.yaml' must look like key=value"."""
    with pytest.raises(ConfigError, match=r"'runs/bad\.yaml' looks like a config file, not a key=value override: the "
                                          r"config file must come before the overrides \(conveyor train runs/bad\.yaml "
                                          r"model\.name=tiny\)"):
        load_config(None, ["model.name=tiny", "runs/bad.yaml"])
    out = _cli_fails("train", "model.name=tiny", "runs/bad.yml")
    assert "must come before the overrides (conveyor train runs/bad.yml model.name=tiny)" in out
    # with --resume the saved config is used: a file is refused as such, wherever it stands
    out = _cli_fails("train", "--resume", "runs/none", "trainer.total_steps=3", "c.json")
    assert "--resume uses the run's saved config" in out and "(c.json)" in out
    with pytest.raises(ConfigError, match=r"override 'noequals' must look like key=value"):
        load_config(None, ["noequals"])  # not a file name: the plain message


@pytest.mark.parametrize("item, needle", [
    ("=3", "override '=3' has an empty key"),
    (" =3", "override ' =3' has an empty key"),
    ("trainer..lr=1", "the key 'trainer..lr' has an empty part"),
    ("trainer.=1", "the key 'trainer.' has an empty part"),
])
def test_override_with_an_empty_key_says_so(item, needle):
    """A fresh-user trial: `conveyor train model.name=tiny =3` said only "Extra inputs are not
    permitted", naming no key."""
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, ["model.name=tiny", item])
    assert needle in _cli_fails("train", "model.name=tiny", item)


def test_unknown_key_is_named_as_such():
    with pytest.raises(ConfigError, match=r"^invalid config \(defaults \+ foo\.bar=3\):\n  foo: unknown key "
                                          r"\(got \{'bar': 3\}\)$"):
        load_config(None, ["foo.bar=3"])


def test_a_message_that_quotes_the_value_does_not_repeat_it():
    """Fresh-user finding: "L an integer >= 1; got 'policy:x' (got 'policy:x')"; a message that
    does not quote the value still gets it once (a bound of 10 does not hide a value of 1)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["critic.backbone=policy:x"])
    assert str(e.value).endswith("L an integer >= 1; got 'policy:x'")
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.group_size=0"])
    assert str(e.value).endswith("rollout.group_size: Input should be greater than or equal to 1 (got 0)")
    with pytest.raises(ConfigError) as e:
        load_config(None, ["critic.backbone=head:x"])
    assert str(e.value).count("'head:x'") == 1


@pytest.mark.parametrize("args, needle", [
    (["--k", "0"], "--k must be an integer >= 1 (the k of pass@k), got 0"),
    (["--k", "-2"], "--k must be an integer >= 1 (the k of pass@k), got -2"),
    (["--k", "4", "--samples", "2"], "--samples must be >= --k (n responses per problem for pass@k, default: --k); "
                                     "got --samples 2 with --k 4"),
])
def test_eval_k_and_samples_errors_say_what_is_allowed(args, needle):
    """A fresh-user trial: `conveyor eval --k 0` said "got --k 0, --samples None"; checked before
    any model or data set is loaded."""
    out = _cli_fails("eval", "--model", "no/such/model", *args)
    assert needle in out and "None" not in out


def test_eval_environment_flag_errors_are_formatted():
    out = _cli_fails("eval", "--model", "tiny", "--env", "guess", "--max-turns", "0")
    assert "invalid environment settings (" in out and "max_turns: Input should be greater than or equal to 1 (got 0)" in out
    assert "errors.pydantic.dev" not in out and "validation error for" not in out


def test_yaml_duplicate_keys_refused_and_value_errors_name_the_line(tmp_path):
    """Fresh-user findings: a second `trainer:` block silently replaced the first; a value error
    from a file named the key but not where it is; a syntax error said "<unicode string>"."""
    dup = tmp_path / "dup.yaml"
    dup.write_text("model:\n  name: tiny\ntrainer:\n  lr: 1.0e-5\n  total_steps: 5\ntrainer:\n  batch_size: 2\n")
    with pytest.raises(ConfigError, match=re.escape(f"config file {dup} line 6: the key 'trainer' is given twice "
                                                    "(first at line 3)")):
        load_config(dup)
    inner = tmp_path / "inner.yaml"
    inner.write_text("async:\n  eta: 1\n  eta: 2\n")
    with pytest.raises(ConfigError, match=re.escape("line 3: the key 'async.eta' is given twice (first at line 2)")):
        load_config(inner)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: tiny\ntrainer:\n  lr: 1.0e-5\n  betas: [2, 0.9]\nasync:\n  eta: two\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert f"trainer.betas.0: Input should be less than 1 (got 2) [{bad} line 5]" in str(e.value)
    assert f"(got 'two') [{bad} line 7]" in str(e.value)
    with pytest.raises(ConfigError) as e:  # a key the command line set is not the file's
        load_config(bad, ["async.eta=x"])
    assert "(got 'x')\n" in str(e.value) + "\n" and f"[{bad} line 7]" not in str(e.value)
    syn = tmp_path / "syn.yaml"
    syn.write_text("model:\n  name: tiny\n trainer: 3\n")
    with pytest.raises(ConfigError, match=re.escape(f'in "{syn}", line 3')):
        load_config(syn)


@pytest.mark.parametrize("item, needle", [
    ("loss.eps_low=2", "loss.eps_low: Input should be less than 1 (got 2)"),
    ("loss.behaviour_weight_cap=0.5", "loss.behaviour_weight_cap: Input should be greater than 1 (got 0.5)"),
    ("trainer.betas=[2,0.9]", "trainer.betas.0: Input should be less than 1 (got 2)"),
    ("critic.betas=[0.9,1.0]", "critic.betas.1: Input should be less than 1 (got 1.0)"),
])
def test_values_the_trainer_would_refuse_late_are_refused_when_the_config_loads(item, needle):
    """Fresh-user finding: these passed validation, then failed after the model load and the
    held-out evaluation with a traceback that named no key."""
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, [item])


@pytest.mark.parametrize("items, needle", [
    (["data.train=mawps:singleop:heldout"], "data.heldout=mawps:singleop:heldout is the training set itself"),
    (["async.eta_max=8", "async.ratio_base=0.3"], "async.eta_max, async.ratio_base set, but async.adaptive=false"),
    (["lora.rank=32", "lora.sync=adapter"], "lora.rank, lora.sync set, but lora.enabled=false"),
    (["proximal.interpolation=linear"], "proximal.interpolation set, but proximal.method=recompute"),
    (["proximal.ewma_beta=0.5"], "proximal.ewma_beta set, but proximal.method=recompute"),
    (["log.wandb_project=foo", "log.wandb_mode=online"], "log.wandb_project, log.wandb_mode set, but log.wandb=false"),
    (["runtime.address=auto", "runtime.num_cpus=4"], "runtime.address, runtime.num_cpus set, but runtime.name=inline"),
])
def test_settings_that_another_setting_turns_off_are_warned(items, needle):
    """Fresh-user findings: these were ignored without a word (critic.* and env.* were warned),
    and training on the held-out set itself was met with advice about the default held-out set."""
    from conveyor.preflight import config_warnings

    warnings = config_warnings(load_config(None, items))
    assert any(needle in w for w in warnings), warnings
    assert not any("still the default" in w for w in warnings)
    # the same keys where they take effect: no warning
    on = {"async": ["async.adaptive=true"], "lora.": ["lora.enabled=true"], "proximal.interpolation": [
        "proximal.method=interpolate"], "proximal.ewma": ["proximal.method=ewma"], "log.": ["log.wandb=true"],
        "runtime.": ["runtime.name=ray"]}
    for prefix, extra in on.items():
        if items[0].startswith(prefix):
            assert config_warnings(load_config(None, [*items, *extra])) == []


def test_a_staleness_pinned_action_without_a_bound_is_refused():
    with pytest.raises(ConfigError, match="staleness_pinned=lower_eta can never fire"):
        load_config(None, ["monitor.actions.staleness_pinned=lower_eta", "async.eta=0"])
    load_config(None, ["monitor.actions.staleness_pinned=lower_eta", "async.eta=2"])
    load_config(None, ["monitor.actions.staleness_pinned=lower_eta", "async.eta=0", "async.adaptive=true"])


@pytest.mark.parametrize("args, needle", [
    (["--n", "0"], "--n must be >= 1 (the first N problems), got 0"),
    (["--tool", "bogus"], "--tool must be none or calculator, got 'bogus'"),
    (["-o", "{tmp}"], "--output {tmp} is a directory: give a file path"),
    (["-o", "{tmp}/afile/x.json"], "--output {tmp}/afile/x.json: {tmp}/afile is a regular file"),
])
def test_eval_output_n_and_tool_errors_come_before_the_model_loads(args, needle, tmp_path, monkeypatch):
    """Fresh-user trial 5: `conveyor eval -o DIR` failed with a traceback after the evaluation (the
    results lost); --n 0 and --tool bogus were refused only after the model had loaded."""
    import conveyor.models

    def no_load(*a, **kw):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(conveyor.models, "load_model", no_load)
    (tmp_path / "afile").write_text("x")
    out = _cli_fails("eval", "--model", "tiny", *[a.format(tmp=tmp_path) for a in args])
    assert needle.format(tmp=tmp_path) in out


def test_eval_output_that_fails_to_write_keeps_the_summary(tmp_path, monkeypatch):
    """A write that fails after the evaluation (a full disk, /proc) is one error line, exit 1,
    after the summary is printed; no half-written file is left."""
    from typer.testing import CliRunner

    from conveyor.cli import app
    from conveyor.runtime_files import RunFileError

    def failing(path, text, what=None):
        raise RunFileError(28, f"no space left writing {path}")

    monkeypatch.setattr("conveyor.runtime_files.atomic_write_text", failing)
    out_path = tmp_path / "e.json"
    r = CliRunner().invoke(app, ["eval", "--no-progress", "--model", "tiny", "--n", "1", "--max-new-tokens", "2",
                                 "-o", str(out_path)])
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert '"pass_at_1"' in text and f"no space left writing {out_path}" in text
    assert "the summary above is the result" in text and not out_path.exists()


def test_an_override_through_a_scalar_section_names_where_the_file_set_it(tmp_path):
    """Fresh-user trial 5: with `trainer: 5` in a config file, `trainer.total_steps=1` said only
    "'trainer' is not a section", with no file or line."""
    p = tmp_path / "scal.yaml"
    p.write_text("model:\n  name: tiny\ntrainer: 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, ["trainer.total_steps=1"])
    assert str(e.value) == f"override 'trainer.total_steps': 'trainer' is not a section (it is 5, set at {p} line 3)"
    with pytest.raises(ConfigError, match=r"'model.name' is not a section \(it is 'tiny', set at .* line 2\)"):
        load_config(p, ["model.name.x=1"])


def test_answer_graded_rewards_on_a_set_without_answers_are_refused_and_a_style_schedule_needs_its_reward():
    """Fresh-user trial 5: configs/preference_shift.yaml with reward.fn=correctness trained on
    prompts whose answers are all "" (every reward 0) without a word."""
    from conveyor.data import DatasetError, load_dataset
    from conveyor.preflight import config_warnings, require_answers

    styles = load_dataset("styles:train")
    with pytest.raises(DatasetError, match=r"data.train=styles:train: every sample's answer is empty, and "
                                           r"reward.fn=correctness grades the answer.*reward.fn=style"):
        require_answers(styles, "styles:train", "correctness")
    require_answers(styles, "styles:train", "style")  # the style judge reads no answer
    require_answers(load_dataset("mawps:singleop:train"), "mawps:singleop:train", "math")
    base = ["data.train=styles:train", "data.heldout=styles:heldout", "data.style_schedule=[cute]"]
    assert any("does not judge styles" in w for w in config_warnings(load_config(None, [*base, "reward.fn=format"])))
    assert not any("does not judge styles" in w for w in config_warnings(load_config(None, [*base, "reward.fn=style"])))
