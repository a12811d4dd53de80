"""The KL reference's log-probs scored off the update while the engine idles
(``trainer.reference_scoring=idle_engine``, :mod:`conveyor.trainer.reference`, issue 16)."""

from __future__ import annotations

import copy
import math
import threading
import time

import pytest
import torch
from engine_helpers import wait_until as _wait
from test_trainer import make_trajs, reference_logprobs

from conveyor.config import LossConfig, TrainConfig, TrainerConfig
from conveyor.trainer.batch import pack
from conveyor.trainer.reference import (
    ReferenceScorer,
    next_to_score,
    reference_from_attached,
    score_reference,
)
from conveyor.trainer.trainer import Trainer


def _trainer(tiny, kl_coef=0.05, **trainer_kw):
    return Trainer(copy.deepcopy(tiny.model), TrainerConfig(lr=1e-3, warmup_steps=0, bf16=False, **trainer_kw),
                   LossConfig(kl_coef=kl_coef))


def _with_observation(trajs):
    """The first trajectory's second response token becomes an observation (a tool result)."""
    t = trajs[0]
    t.action_mask = [1] * len(t.response_ids)
    t.action_mask[1] = 0
    return trajs


@pytest.mark.parametrize("share_prompts", [True, False])
def test_score_reference_gives_each_action_tokens_log_prob_under_the_reference(tiny, share_prompts):
    tr = _trainer(tiny)
    trajs = _with_observation(make_trajs(8, group=4, shared_prompts=True))
    got = score_reference(tr.scoring_spec(), tr.reference_model, trajs, share_prompts=share_prompts)
    assert [len(v) for v in got] == [len(t.response_ids) for t in trajs]
    for t, vals in zip(trajs, got, strict=True):
        want = reference_logprobs(tiny.model, t)  # one unpacked forward pass of the initial policy
        for k, v in enumerate(vals):
            if t.action_mask is not None and not t.action_mask[k]:
                assert math.isnan(v)  # an observation token: no loss, no KL term
            else:
                assert v == pytest.approx(float(want[k]), abs=1e-5)


def test_reference_from_attached_fills_in_only_the_trajectories_without_values():
    trajs = make_trajs(3)
    vals = [[-1.0 - 0.1 * k for k in range(len(t.response_ids))] for t in trajs]
    for t, v in zip(trajs, vals, strict=True):
        t.metadata["reference_logprobs"] = v
    n_tok = [len(t.response_ids) for t in trajs]
    calls = []

    def missing(seqs):
        calls.append(seqs)
        return [[7.0] * n_tok[s] for s in seqs]

    mb = pack(trajs, torch.zeros(3), [[0, 1, 2]])
    on = mb.mask > 0
    ref, pre = reference_from_attached(mb, missing)
    assert calls == [] and pre == sum(n_tok)  # every value attached: nothing scored
    assert torch.equal(ref[~on], torch.zeros_like(ref[~on]))
    for s in range(3):
        here = (mb.seq_index == s) & on
        assert ref[here].tolist() == pytest.approx([vals[s][k] for k in mb.response_index[here].tolist()])

    del trajs[1].metadata["reference_logprobs"]  # trajectory 1 without: only it is scored
    mb = pack(trajs, torch.zeros(3), [[0, 1, 2]])
    ref, pre = reference_from_attached(mb, missing)
    assert calls == [[1]] and pre == n_tok[0] + n_tok[2]
    assert ref[(mb.seq_index == 1) & (mb.mask > 0)].tolist() == [7.0] * n_tok[1]
    assert ref[(mb.seq_index == 2) & (mb.mask > 0)].tolist() == pytest.approx(vals[2])

    assert reference_from_attached(pack(make_trajs(2), torch.zeros(2), [[0, 1]]), missing) is None  # none attached
    empty = make_trajs(1)  # no action token (every response token an observation): the pass runs
    empty[0].action_mask = [0] * len(empty[0].response_ids)
    empty[0].metadata["reference_logprobs"] = [math.nan] * len(empty[0].response_ids)
    assert reference_from_attached(pack(empty, torch.zeros(1), [[0]]), missing) is None
    assert len(calls) == 1


def test_the_update_uses_attached_reference_values(tiny):
    """Correct attached values change nothing computed and count as precomputed; wrong ones reach
    the KL term (so they are really the ones used). The second update of each trainer is compared:
    after one update the policy differs from the reference (KL > 0)."""
    first, second = make_trajs(8, group=4, shared_prompts=True), make_trajs(8, group=4, seed=1, shared_prompts=True)

    def second_update(values=None):
        tr = _trainer(tiny)
        tr.train_step(copy.deepcopy(first))
        batch = copy.deepcopy(second)
        if values in ("right", "first half"):
            right = score_reference(tr.scoring_spec(), tr.reference_model, batch)
            values = right if values == "right" else right[:4] + [None] * 4
        for t, v in zip(batch, values, strict=True) if values else ():
            if v is not None:
                t.metadata["reference_logprobs"] = v
        return tr.train_step(batch)

    plain = second_update()
    assert plain["reference/precomputed_frac"] == 0.0
    assert plain["train/kl_ref"] > 1e-6
    got = second_update("right")
    assert got["reference/precomputed_frac"] == 1.0
    assert got["train/kl_ref"] == pytest.approx(plain["train/kl_ref"], rel=1e-4)
    assert got["train/grad_norm"] == pytest.approx(plain["train/grad_norm"], rel=1e-4)
    half = second_update("first half")  # the others are scored in the update
    assert half["reference/precomputed_frac"] == pytest.approx(
        sum(len(t.response_ids) for t in second[:4]) / sum(len(t.response_ids) for t in second))
    assert half["train/kl_ref"] == pytest.approx(plain["train/kl_ref"], rel=1e-4)
    assert half["train/grad_norm"] == pytest.approx(plain["train/grad_norm"], rel=1e-4)
    off = second_update([[-1.0] * len(t.response_ids) for t in second])
    assert off["reference/precomputed_frac"] == 1.0
    assert off["train/kl_ref"] > plain["train/kl_ref"] + 0.1


def test_scorer_scores_buffered_trajectories_only_while_the_engine_idles(tiny):
    tr = _trainer(tiny)
    trajs = make_trajs(8, group=4, shared_prompts=True)
    buffered = list(trajs)
    idle = threading.Event()
    scorer = ReferenceScorer(tr.reference_model, tr.scoring_spec(), source=lambda: list(buffered),
                             idle=idle.is_set, micro_batch_tokens=40, poll_s=0.01)
    scorer.start()
    try:
        time.sleep(0.3)
        assert scorer.stats.scored == 0  # the engine is busy: nothing runs
        idle.set()
        assert _wait(lambda: scorer.stats.scored == len(trajs))
        assert scorer.stats.forwards >= 2  # 40-token micro-batches: more than one pass
        assert scorer.error is None
        batch, buffered[:] = buffered[:5], buffered[5:]  # five handed out
        assert scorer.attach(batch) == 5
        want = score_reference(tr.scoring_spec(), tr.reference_model, trajs)
        for t, w in zip(batch, want[:5], strict=True):
            assert t.metadata["reference_logprobs"] == pytest.approx(w, abs=1e-5)
        assert all("reference_logprobs" not in t.metadata for t in buffered)
        assert scorer.pending() == 3 and scorer.stats.attached == 5
        time.sleep(0.2)
        assert scorer.stats.scored == len(trajs)  # nothing scored twice
    finally:
        scorer.stop()
    assert scorer._thread is None


@pytest.mark.skipif(not hasattr(threading, "get_native_id") or not hasattr(__import__("os"), "setpriority"),
                    reason="per-thread priorities: Linux")
def test_background_scorer_runs_ungated_at_the_lowest_priority_of_its_own_thread(tiny):
    import os

    tr = _trainer(tiny)
    buffered = make_trajs(4)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    scorer = ReferenceScorer(tr.reference_model, tr.scoring_spec(), source=lambda: list(buffered), idle=None,
                             poll_s=0.01, lowest_priority=True)
    scorer.start()
    try:
        assert _wait(lambda: scorer.stats.scored == 4)  # no gate
        assert os.getpriority(os.PRIO_PROCESS, scorer._thread.native_id) == 19
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # this thread keeps its own
    finally:
        scorer.stop()


def test_next_to_score_takes_the_newest_groups_that_fit():
    trajs = make_trajs(8, group=4, shared_prompts=True)  # g0 (oldest): 0-3, g1: 4-7
    size = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
    assert next_to_score(trajs, sum(size[4:])) == trajs[4:]  # the newest group, whole
    assert next_to_score(trajs, sum(size[4:]) + size[0]) == trajs[4:] + trajs[:1]  # then the next newest's first
    assert next_to_score(trajs, sum(size)) == trajs[4:] + trajs[:4]
    assert next_to_score(trajs, 1) == trajs[4:5]  # at least one
    assert next_to_score([], 100) == []


def test_scorer_forgets_results_of_trajectories_that_left_the_buffer(tiny):
    tr = _trainer(tiny)
    buffered = make_trajs(2)
    scorer = ReferenceScorer(tr.reference_model, tr.scoring_spec(), source=lambda: list(buffered),
                             idle=lambda: True, poll_s=0.01, forget_s=0.2)
    scorer.start()
    try:
        assert _wait(lambda: scorer.pending() == 2)
        gone = buffered.pop()  # dropped as stale: never handed out
        assert _wait(lambda: scorer.pending() == 1, timeout=5)
        assert scorer.attach([gone]) == 0
    finally:
        scorer.stop()


def test_scorer_arguments_are_checked(tiny):
    tr = _trainer(tiny)
    for kw, field in (({"threads": 0}, "threads"), ({"micro_batch_tokens": 0}, "micro_batch_tokens"),
                      ({"poll_s": 0}, "poll_s")):
        with pytest.raises(ValueError, match=field):
            ReferenceScorer(tr.reference_model, tr.scoring_spec(), source=list, idle=lambda: True, **kw)


@pytest.mark.parametrize("override, named", [
    ({"runtime": {"name": "ray"}}, "runtime.name=ray"),
    ({"rollout": {"num_engines": 2}}, "rollout.num_engines=2"),
    ({"lora": {"enabled": True}}, "lora.enabled=true"),
])
@pytest.mark.parametrize("mode", ["idle_engine", "background"])
def test_reference_scoring_off_the_update_refuses_what_it_cannot_serve(override, named, mode):
    with pytest.raises(ValueError, match=f"trainer.reference_scoring={mode}") as e:
        TrainConfig.model_validate({"trainer": {"reference_scoring": mode}, **override})
    assert named in str(e.value)
    TrainConfig.model_validate({"trainer": {"reference_scoring": mode}})


def test_reference_scoring_auto_is_background_where_it_can_run_and_update_elsewhere():
    from conveyor.config import resolve_reference_scoring

    def resolve(device="cpu", **over):
        return resolve_reference_scoring(TrainConfig.model_validate({"trainer": {"reference_scoring": "auto"}, **over}),
                                         device)

    assert resolve() == ("background", "trainer.reference_scoring=auto: background (a nice-19 thread beside the engine)")
    for over, named in (({"runtime": {"name": "ray"}}, "runtime.name=ray"),
                        ({"rollout": {"num_engines": 2}}, "rollout.num_engines=2"),
                        ({"lora": {"enabled": True}}, "lora.enabled=true")):
        mode, why = resolve(**over)  # accepted by the config (auto never refuses), resolved to the update
        assert mode == "update" and named in why
    mode, why = resolve("cuda:0")
    assert mode == "update" and "cuda:0" in why
    for explicit in ("update", "idle_engine", "background"):  # an explicit mode is kept as set
        cfg = TrainConfig.model_validate({"trainer": {"reference_scoring": explicit}})
        assert resolve_reference_scoring(cfg, "cuda:0")[0] == explicit


def test_engine_idle_reflects_waiting_and_running_requests(tiny):
    from conveyor.rollout.engine import InferenceEngine, SamplingParams

    engine = InferenceEngine(copy.deepcopy(tiny.model), tiny.tokenizer, max_batch_size=4, seed=0)
    engine.start()
    try:
        assert _wait(lambda: engine.idle, timeout=5)
        engine.pause()
        fut = engine.submit([5, 6, 7], SamplingParams(max_new_tokens=4, temperature=1.0))
        assert not engine.idle  # a waiting request
        engine.resume()
        fut.result(timeout=30)
        assert _wait(lambda: engine.idle, timeout=5)
    finally:
        engine.stop()


@pytest.mark.parametrize("mode", ["idle_engine", "background", "auto"])
def test_a_run_scoring_the_reference_off_the_update_trains_on_precomputed_values(tmp_path, mode, monkeypatch):
    """The inline runtime wires the scorer: it scores buffered trajectories while the engine
    idles, the values reach the updates, and the run ends cleanly (the thread stopped). In
    ``background`` mode the thread asks for the lowest priority; here that request is recorded
    and not applied (the priority itself: the test above), so the run does not depend on the
    machine having spare CPU (a nice-19 thread got none beside two training runs and scored
    nothing in 6 updates)."""
    import json

    from test_train_e2e import BASE

    import conveyor.trainer.reference as reference
    from conveyor.config import load_config
    from conveyor.train import run_training

    asked = []
    monkeypatch.setattr(reference, "_lowest_priority", lambda: asked.append(1) or False)

    run = tmp_path / "r"
    cfg = load_config(None, BASE + ["trainer.total_steps=6", "async.eta=2", "loss.kl_coef=0.05",
                                    f"trainer.reference_scoring={mode}", f"run.dir={run}",
                                    "run.eval_before=false", "run.eval_after=false"])
    res = run_training(cfg)
    assert res.steps == 6 and not res.interrupted
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["reference/precomputed_frac"] <= 1.0 for r in rows)
    last = rows[-1]
    assert last["reference/attached_trajectories"] <= last["reference/scored_trajectories"]
    assert last["reference/attached_trajectories"] > 0
    assert any(r["reference/precomputed_frac"] > 0 for r in rows)
    assert not [t for t in threading.enumerate() if t.name == "conveyor-reference"]
    assert asked == ([1] if mode in ("background", "auto") else [])  # auto on the CPU: background
