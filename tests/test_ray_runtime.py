"""The Ray runtime (``runtime.name=ray``, conveyor/runtime/ray.py) on real Ray clusters: a run
that starts its own local cluster, equivalence with the inline runtime at eta = 0, partial-sync
scoring and a resume across the actor boundary, errors and death of the rollout actor, and a
cluster started by ``ray start --head`` joined by address (a separate process).

Every cluster a test starts is stopped by it: the runtime's own (``ray.shutdown`` at the end of
the run), this module's shared one (``ray.shutdown`` when the module ends), and the
``ray start --head --block`` process (SIGTERM to that process only; never ``ray stop``, which
would stop every Ray cluster on the machine).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

ray = pytest.importorskip("ray", reason="the Ray runtime needs Ray: pip install 'conveyor[ray]'")

from conveyor.config import load_config  # noqa: E402
from conveyor.train import _latest_checkpoint, load_run_config, run_training  # noqa: E402
from conveyor.trainer.trainer import Trainer  # noqa: E402

BASE = [
    "model.name=tiny", "trainer.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=10",
    "data.heldout_limit=3", "run.eval_max_new_tokens=6", "run.progress=false", "run.export=false",
    "reward.workers=1", "trainer.lr=1e-3", "rollout.tool=none",
]
RAY = ["runtime.name=ray", "runtime.num_cpus=2"]
NO_EVAL = ["run.eval_before=false", "run.eval_after=false"]


def rows_of(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def _module_cluster():
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def cluster(_module_cluster):
    """A local Ray cluster of 2 CPUs shared by the tests that use it (the runtime joins it)."""
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    return ray


def wait_cpus_free(n: float = 2.0, timeout: float = 30.0) -> float:
    """The cluster's free CPUs once the killed actors released theirs (at most ``timeout`` s)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        free = ray.available_resources().get("CPU", 0)
        if free >= n:
            return free
        time.sleep(0.5)
    return ray.available_resources().get("CPU", 0)


def test_ray_run_starts_its_own_cluster_trains_evaluates_and_checkpoints(tmp_path):
    if ray.is_initialized():  # this run must start (and stop) a cluster of its own
        ray.shutdown()
    run = tmp_path / "r"
    cfg = load_config(None, BASE + RAY + ["trainer.total_steps=3", "async.eta=1", f"run.dir={run}",
                                          "rollout.engine_dtype=auto", "trainer.bf16=true",
                                          "rollout.priority=oldest_first", "async.wait_for_expiring=true"])
    res = run_training(cfg)
    assert res.steps == 3 and not res.interrupted
    # engine_dtype=auto follows the trainer's bf16 autocast, resolved before the actor builds its engine
    assert json.loads((run / "engine_stats.json").read_text())["dtype"] == "bfloat16"
    assert not ray.is_initialized()  # the local cluster the run started is gone
    rows = rows_of(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["staleness/max"] <= 1 and r["train/tokens"] > 0 for r in rows)
    assert all(0.0 <= r["busy/engine"] <= 1.0 and r["rollout/episodes_accepted"] >= 2 for r in rows)
    # the runtime's own overhead per step: the actor calls besides the batch wait, and their time
    assert all(r["runtime/actor_calls"] >= 3 and 0 < r["runtime/actor_call_s"] < r["time/step_wall_s"] for r in rows), [
        (r["runtime/actor_calls"], r["runtime/actor_call_s"], r["time/step_wall_s"]) for r in rows]
    for name in ("config.json", "summary.json", "eval_before.json", "eval_after.json", "engine_stats.json",
                 "trained.jsonl", "report.png"):
        assert (run / name).is_file(), name
    assert _latest_checkpoint(run).name == "step_3"
    events = rows_of(run / "events.jsonl")
    rt = [e for e in events if e["event"] == "runtime"]
    assert len(rt) == 1 and rt[0]["name"] == "ray" and rt[0]["actor_pid"] != os.getpid()
    assert [(e["label"], e["version"]) for e in events if e["event"] == "eval"] == [("before", 0), ("after", 3)]
    assert json.loads((run / "eval_after.json").read_text())["num_problems"] == 3
    groups = [g["group"] for r in rows_of(run / "trained.jsonl") for g in r["groups"]]
    assert len(groups) == len(set(groups)) == 3 * 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["heldout_before"] is not None
    assert summary["controller"]["rollout/episodes_accepted"] >= 6
    engine_stats = json.loads((run / "engine_stats.json").read_text())
    assert engine_stats["generated_tokens"] > 0 and engine_stats["dtype"] == "bfloat16"


def test_eta_zero_ray_trains_on_the_same_batches_with_the_same_loss_as_inline(tmp_path, cluster, monkeypatch):
    # fp32 (trainer.bf16=false) and a dense reward (non-zero advantages and gradient). Exact
    # equality is not possible, not even between two inline runs: the engine's continuous batching
    # forms each prefill / decode batch from the requests present at that moment (thread timing),
    # and matrix products of other batch shapes round differently in the last bits, so behaviour
    # log-probs differ by ~1e-6 (measured 9.5e-7) and the loss by as much. The tokens themselves
    # come from per-request seeded generators and are the same.
    seen: dict[str, list] = {}
    orig = Trainer.train_step

    def recording(self, batch):
        m = orig(self, batch)
        # in sample order: which of the admitted groups finishes first (the batch's order) is
        # thread timing; the batch's content is what must agree
        ts = sorted(batch, key=lambda t: (t.sample.id, t.response_ids))
        seen.setdefault(runtime, []).append((
            [(t.sample.id, t.prompt_ids, t.response_ids, t.versions, t.reward) for t in ts],
            [t.behaviour_logprobs for t in ts], m["loss/loss"], m["train/grad_norm"]))
        return m

    monkeypatch.setattr(Trainer, "train_step", recording)
    for runtime in ("inline", "ray"):
        cfg = load_config(None, BASE + NO_EVAL + [
            "trainer.total_steps=2", "async.eta=0", "trainer.bf16=false", f"runtime.name={runtime}",
            "reward.fn=conveyor.rewards.faults:response_length_reward", f"run.dir={tmp_path / runtime}"])
        run_training(cfg)
    for step in (0, 1):  # the first batch, and the one after a weight update through the object store
        (b_in, lp_in, loss_in, g_in), (b_ray, lp_ray, loss_ray, g_ray) = seen["inline"][step], seen["ray"][step]
        assert b_in == b_ray  # the same samples, prompts, tokens, versions and rewards
        assert max(abs(x - y) for u, v in zip(lp_in, lp_ray) for x, y in zip(u, v)) < 1e-5
        assert loss_ray == pytest.approx(loss_in, abs=1e-5)
        assert g_in > 0 and g_ray == pytest.approx(g_in, rel=1e-3)


def test_partial_sync_under_ray_covers_every_stale_token_and_resumes(tmp_path, cluster):
    # two engines: engine 0 in the rollout actor, engine 1 an engine actor; the partial requests of
    # both are gathered at each publish and scored on both
    run = tmp_path / "r"
    cfg = load_config(None, BASE + RAY + NO_EVAL + [
        "trainer.total_steps=3", "async.eta=2", f"run.dir={run}", "proximal.method=partial_sync",
        "loss.name=two_ratio", "run.checkpoint_every=2", "run.keep_checkpoints=2", "rollout.num_engines=2"])
    run_training(cfg)
    rows = rows_of(run / "metrics.jsonl")
    assert len(rows) == 3
    stats = json.loads((run / "engine_stats.json").read_text())
    assert stats["num_engines"] == 2 and min(e["generated_tokens"] for e in stats["engines"]) > 0
    # every token older than the trainer's version was scored when its version was retired
    assert all(r["proximal/partial_sync_missing_frac"] == 0.0 for r in rows)
    assert sum(r["proximal/partial_sync_tokens"] for r in rows) > 0
    # --resume from the Ray run's step_2 (its buffered trajectories and patches in the checkpoint)
    import shutil

    shutil.rmtree(run / "checkpoints" / "step_3")
    res = run_training(load_run_config(run, ["trainer.total_steps=4"]), resume_dir=run)
    assert res.steps == 4
    rows = rows_of(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["proximal/partial_sync_missing_frac"] == 0.0 for r in rows)
    trained = rows_of(run / "trained.jsonl")
    assert [r["step"] for r in trained] == [1, 2, 3, 4]
    groups = [g["group"] for r in trained for g in r["groups"]]
    assert len(groups) == len(set(groups)) == 4 * 2  # none trained twice across the resume
    assert _latest_checkpoint(run).name == "step_4"


def test_an_actor_that_cannot_build_is_reported_with_its_message(tmp_path, cluster):
    from conveyor.runtime.ray import RolloutActorError

    # the reward module imports in the driver, but not on the Ray worker (tests/ray_reward_helpers.py)
    cfg = load_config(None, BASE + RAY + NO_EVAL + ["trainer.total_steps=2", f"run.dir={tmp_path / 'r'}",
                                                    "reward.fn=ray_reward_helpers:score"])
    with pytest.raises(RolloutActorError, match="setup.*ray_reward_helpers.*importable in the actor's process"):
        run_training(cfg)
    assert wait_cpus_free() >= 2  # the actor is gone


def test_a_trainer_actor_trains_like_the_driver_and_its_checkpoints_resume_under_either_placement(tmp_path, cluster,
                                                                                                  monkeypatch):
    # runtime.trainer=actor: the policy, optimizer and updates in a Ray actor of their own, the
    # weights from it to the rollout actor through the object store; at eta = 0 with a dense
    # reward both placements train on the same batches with the same loss (tolerance: see the
    # test above). The module's cluster has 2 CPUs: the rollout actor's and the trainer actor's.
    common = BASE + NO_EVAL + ["async.eta=0", "trainer.bf16=false", "run.checkpoint_every=1",
                               "reward.fn=conveyor.rewards.faults:response_length_reward"]
    runs = {}

    def no_weights_here(*a, **k):
        raise AssertionError("the driver loaded the model's weights although the trainer is an actor")

    for placement in ("driver", "actor"):
        runs[placement] = tmp_path / placement
        cfg = load_config(None, common + RAY + ["trainer.total_steps=2", f"runtime.trainer={placement}",
                                                f"run.dir={runs[placement]}"])
        if placement == "actor":  # the weights live in the actor only (the config and tokenizer here)
            monkeypatch.setattr("conveyor.train.load_model", no_weights_here)
        run_training(cfg)
    monkeypatch.undo()
    rt = next(e for e in rows_of(runs["actor"] / "events.jsonl") if e["event"] == "runtime")
    assert rt["trainer"] == "actor" and rt["trainer_pid"] not in (os.getpid(), rt["actor_pid"])
    m = {p: rows_of(runs[p] / "metrics.jsonl") for p in runs}
    assert [r["step"] for r in m["actor"]] == [1, 2]
    for a, b in zip(m["driver"], m["actor"], strict=True):  # the first batch, and the one after an update
        assert b["loss/loss"] == pytest.approx(a["loss/loss"], abs=1e-5)
        assert a["train/grad_norm"] > 0 and b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-3)
    trained = {p: [sorted((g["group"].split("#")[0], g["lengths"]) for g in r["groups"])  # (#: a group's own id)
                   for r in rows_of(runs[p] / "trained.jsonl")] for p in runs}
    assert trained["actor"] == trained["driver"]
    assert _latest_checkpoint(runs["actor"]).name == "step_2"
    # its checkpoint resumes with the trainer in the driver (the same trainer.pt; the other way
    # round: the next test resumes an actor run under the actor)
    run_training(load_config(None, common + RAY + ["trainer.total_steps=3", "runtime.trainer=driver",
                                                   f"run.dir={runs['actor']}"]), resume_dir=runs["actor"])
    assert [r["step"] for r in rows_of(runs["actor"] / "metrics.jsonl")] == [1, 2, 3]
    assert _latest_checkpoint(runs["actor"]).name == "step_3"
    assert wait_cpus_free() >= 2  # the trainer actor was killed with the run


def test_a_dead_trainer_actor_stops_the_run_and_its_last_checkpoint_resumes(tmp_path, cluster, monkeypatch):
    from conveyor.runtime.ray_trainer import TrainerActorError

    monkeypatch.setenv("CONVEYOR_TRAINER_ACTOR_FAULTS", "kill@train_step#3")  # SIGKILL in the 3rd update
    run = tmp_path / "r"
    common = BASE + RAY + NO_EVAL + ["async.eta=1", "run.checkpoint_every=1", "runtime.trainer=actor",
                                     f"run.dir={run}"]
    t0 = time.time()
    with pytest.raises(TrainerActorError, match="trainer actor died during train_step"):
        run_training(load_config(None, common + ["trainer.total_steps=5"]))
    assert time.time() - t0 < 120
    events = rows_of(run / "events.jsonl")
    assert next(e for e in events if e["event"] == "error")["version"] == 2
    assert _latest_checkpoint(run).name == "step_2"  # the last periodic checkpoint, intact
    assert wait_cpus_free() >= 2
    monkeypatch.delenv("CONVEYOR_TRAINER_ACTOR_FAULTS")
    res = run_training(load_config(None, common + ["trainer.total_steps=5"]), resume_dir=run)
    assert res.steps == 5
    assert [r["step"] for r in rows_of(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]


def test_a_non_finite_step_in_the_trainer_actor_is_logged_and_checkpointed_at_its_own_version(tmp_path, cluster,
                                                                                              monkeypatch):
    # the step still counts (the trainer's version moved before it raised): the driver's proxy
    # must see the version the failure left, or it logs and checkpoints the step before
    from conveyor.trainer.trainer import NonFiniteLossError

    monkeypatch.setenv("CONVEYOR_TRAINER_ACTOR_FAULTS", "nonfinite@loss#1")
    run = tmp_path / "r"
    cfg = load_config(None, BASE + RAY + NO_EVAL + ["async.eta=1", "runtime.trainer=actor", f"run.dir={run}",
                                                    "trainer.total_steps=5", "trainer.max_nonfinite_in_a_row=1"])
    with pytest.raises(NonFiniteLossError):
        run_training(cfg)
    events = rows_of(run / "events.jsonl")
    assert [e["version"] for e in events if e["event"] == "skipped_nonfinite"] == [1]
    assert [r["step"] for r in rows_of(run / "metrics.jsonl")] == [1]
    ckpt = _latest_checkpoint(run)
    assert ckpt.name == "step_1"
    assert torch.load(ckpt / "trainer.pt", weights_only=False)["version"] == 1


def test_a_weight_update_that_hangs_is_reported_and_retried_never_applied_twice(tmp_path, cluster, monkeypatch):
    # the actor's engine stalls 4 s while applying an update; the driver gives each attempt 1.5 s
    # (runtime.sync_timeout_s): the first attempt times out, is reported, and the retry joins it
    monkeypatch.setenv("CONVEYOR_ACTOR_FAULTS", "stall@weight_sync#2")
    monkeypatch.setenv("CONVEYOR_FAULTS_STALL_S", "4")
    run = tmp_path / "r"
    cfg = load_config(None, BASE + RAY + NO_EVAL + ["trainer.total_steps=3", "async.eta=1", f"run.dir={run}",
                                                    "runtime.sync_timeout_s=1.5", "runtime.sync_retries=8"])
    res = run_training(cfg)
    assert res.steps == 3
    events = rows_of(run / "events.jsonl")
    retries = [e for e in events if e["event"] == "weight_sync_retry"]
    # (8 retries: 13.5 s of attempts for a 4-s stall, room for a loaded machine)
    assert retries and all(e["timeout_s"] == 1.5 for e in retries) and len(retries) <= 8
    assert "error" not in [e["event"] for e in events]
    stats = json.loads((run / "engine_stats.json").read_text())
    assert stats["num_weight_updates"] == 3 and stats["version"] == 3  # each version applied once
    assert "joining the attempt under way" in (run / "train.log").read_text()


def test_a_weight_update_that_never_completes_stops_the_run_after_its_retries(tmp_path, cluster, monkeypatch):
    from conveyor.runtime.ray import RolloutActorTimeout

    monkeypatch.setenv("CONVEYOR_ACTOR_FAULTS", "stall@weight_sync#2")
    monkeypatch.setenv("CONVEYOR_FAULTS_STALL_S", "8")
    run = tmp_path / "r"
    cfg = load_config(None, BASE + RAY + NO_EVAL + ["trainer.total_steps=3", "async.eta=1", f"run.dir={run}",
                                                    "runtime.sync_timeout_s=1", "runtime.sync_retries=1"])
    with pytest.raises(RolloutActorTimeout, match=r"not applied after 2 attempt\(s\) of 1 s \(runtime.sync_timeout_s"):
        run_training(cfg)
    events = rows_of(run / "events.jsonl")
    assert [e["attempt"] for e in events if e["event"] == "weight_sync_retry"] == [1]
    # the update before the failed publish was taken: its step is logged, and the final
    # checkpoint holds it (nothing computed is lost; a resume continues after it)
    failed = [e["version"] for e in events if e["event"] == "publish_failed"]
    ckpt = _latest_checkpoint(run)
    assert len(failed) == 1 and ckpt.name == f"step_{failed[0]}"
    assert [r["step"] for r in rows_of(run / "metrics.jsonl")] == list(range(1, failed[0] + 1))
    assert [r["step"] for r in rows_of(run / "trained.jsonl")] == list(range(1, failed[0] + 1))


def test_a_crash_inside_the_actor_stops_the_run_with_its_message_and_a_final_checkpoint(tmp_path, cluster,
                                                                                       monkeypatch):
    # the actor's engine fails at its 40th decode step (CONVEYOR_ACTOR_FAULTS: the actor only)
    monkeypatch.setenv("CONVEYOR_ACTOR_FAULTS", "enospc@generate#40")
    run = tmp_path / "r"
    cfg = load_config(None, BASE + RAY + NO_EVAL + ["trainer.total_steps=50", "async.eta=1", f"run.dir={run}"])
    with pytest.raises(RuntimeError, match=r"episodes in a row failed \(groups of rollout.group_size=2 .*\); the last: "):
        run_training(cfg)
    ckpt = _latest_checkpoint(run)  # the final checkpoint: the actor is alive, its snapshot taken
    assert ckpt is not None and int(ckpt.name.split("_")[1]) >= 1
    events = [e["event"] for e in rows_of(run / "events.jsonl")]
    assert "error" in events and "checkpoint" in events
    log = (run / "train.log").read_text()
    assert "[rollout actor]" in log and "No space left on device" in log  # the actor's traceback
    assert wait_cpus_free() >= 2


def test_a_dead_actor_is_a_clear_error_not_a_hang(tmp_path, cluster, monkeypatch):
    from conveyor.runtime.ray import RolloutActorError

    monkeypatch.setenv("CONVEYOR_ACTOR_FAULTS", "kill@generate#40")  # SIGKILL the actor's process
    run = tmp_path / "r"
    cfg = load_config(None, BASE + RAY + NO_EVAL + ["trainer.total_steps=50", "async.eta=1", f"run.dir={run}",
                                                    "run.checkpoint_every=1", "runtime.max_actor_restarts=0"])
    t0 = time.time()
    with pytest.raises(RolloutActorError, match="rollout actor died"):
        run_training(cfg)
    assert time.time() - t0 < 120
    # the final checkpoint needs the actor's snapshot: it fails, logged; the periodic one is intact.
    # When the death is found right after a periodic checkpoint of the same version, that one
    # already is the final one (save_checkpoint returns it unchanged): nothing to fail.
    rows = rows_of(run / "events.jsonl")
    events = [e["event"] for e in rows]
    assert "error" in events
    ckpt = _latest_checkpoint(run)
    assert ckpt is not None
    error_version = int(next(e for e in rows if e["event"] == "error")["version"])
    assert "checkpoint_failed" in events or int(ckpt.name.split("_")[1]) == error_version, (events, ckpt)
    assert wait_cpus_free() >= 2


def test_a_dead_actor_is_restarted_and_the_run_finishes_without_losing_or_repeating_a_sample(tmp_path, cluster,
                                                                                            monkeypatch):
    # the fault drill (issue 12, section 4): SIGKILL the actor mid-run; the first actor only
    # gets the fault, so the restarted one runs to the end
    monkeypatch.setenv("CONVEYOR_ACTOR_FAULTS", "kill@generate#40")
    run = tmp_path / "r"
    cfg = load_config(None, BASE + RAY + NO_EVAL + ["trainer.total_steps=8", "async.eta=1", f"run.dir={run}",
                                                    "run.checkpoint_every=1000"])
    run_training(cfg)
    rows = rows_of(run / "events.jsonl")
    restarts = [e for e in rows if e["event"] == "actor_restarted"]
    assert len(restarts) == 1, [e["event"] for e in rows]
    assert restarts[0]["restarts"] == 1 and "died" in restarts[0]["reason"]
    assert 0 < restarts[0]["version"] < 8  # mid-run
    assert "error" not in [e["event"] for e in rows]
    trained = rows_of(run / "trained.jsonl")
    assert [r["step"] for r in trained] == list(range(1, 9))  # every step trained, once
    groups = [g["group"] for r in trained for g in r["groups"]]
    samples = [g["sample"] for r in trained for g in r["groups"]]
    assert len(groups) == 16 and len(set(groups)) == 16  # no trajectory trained twice
    assert len(set(samples)) == 16  # one epoch is 300+ samples: a repeated sample would be a duplicate
    # the engine's counters continue over the restart (busy seconds never go backwards)
    steps = rows_of(run / "metrics.jsonl")
    assert len(steps) == 8 and all(0 <= m["busy/engine"] <= 1 and m["throughput/generated_tokens_per_s"] >= 0
                                   for m in steps)
    assert wait_cpus_free() >= 2


def test_two_engines_share_the_rollouts_and_a_killed_engine_actor_is_replaced(tmp_path, cluster, monkeypatch):
    # rollout.num_engines=2: engine 0 in the rollout actor, engine 1 an engine actor (1 CPU each:
    # the module's 2-CPU cluster is full); the engine actor is SIGKILLed at its 12th decode step
    # (the first one only), replaced at the newest weights, and its requests run again elsewhere.
    # (At its 30th step, on a loaded machine, the run could end first: the death was found only by
    # the final stats() call, with nothing left to resubmit; clean-clone CI of bdda0ff.)
    monkeypatch.setenv("CONVEYOR_ENGINE_ACTOR_FAULTS", "kill@generate#12")
    run = tmp_path / "r"
    cfg = load_config(None, BASE + RAY + NO_EVAL + ["trainer.total_steps=4", "async.eta=1", f"run.dir={run}",
                                                    "rollout.num_engines=2", "rollout.group_size=4",
                                                    "run.checkpoint_every=1000"])
    run_training(cfg)
    events = rows_of(run / "events.jsonl")
    assert "error" not in [e["event"] for e in events]
    runtime = next(e for e in events if e["event"] == "runtime")
    assert len(set(runtime["engine_pids"])) == 2  # two processes
    stats = json.loads((run / "engine_stats.json").read_text())
    assert stats["num_engines"] == 2 and stats["engine_restarts"] == 1 and stats["router_resubmitted"] >= 1
    assert stats["engines"][0]["generated_tokens"] > 0
    # the killed actor's requests ran again on engine 0 at once; its replacement (seconds to
    # start) may still have been starting when the statistics were read; once live, it follows
    # the weights (test_engine_router covers the newest weights at install)
    assert stats["engines"][1]["state"] in ("live", "replacing")
    if stats["engines"][1]["state"] == "live":
        assert stats["engines"][1]["version"] == 4
    # the run's end waited for it: installed (stopped) at the newest weights, then killed
    assert re.search(r"engine 1: replacement installed at version 4\b", (run / "train.log").read_text())
    trained = rows_of(run / "trained.jsonl")
    assert [r["step"] for r in trained] == list(range(1, 5))
    groups = [g["group"] for r in trained for g in r["groups"]]
    assert len(groups) == len(set(groups)) == 8  # nothing lost or trained twice
    assert all(len(g["lengths"]) == 4 for r in trained for g in r["groups"])  # whole groups
    metrics = rows_of(run / "metrics.jsonl")
    for m in metrics:
        assert m["staleness/max"] <= 1 and 0 <= m["busy/engine"] <= 1
    assert metrics[-1]["engine/restarts"] == 1 and metrics[-1]["engine/resubmitted"] >= 1
    assert wait_cpus_free() >= 2  # the engine actors were killed with the run


def test_ray_engine_is_an_engine_that_generates_and_evaluates_from_the_driver(cluster, tiny):
    from conveyor.data import load_dataset
    from conveyor.eval import evaluate
    from conveyor.rollout.engine import Engine, InferenceEngine, SamplingParams
    from conveyor.runtime.ray import RayEngine, start_rollout_actor
    from conveyor.sync import WeightUpdate

    cfg = load_config(None, BASE + RAY)
    samples = load_dataset("mawps:singleop:train")[:4]
    actor, handle = start_rollout_actor(cfg.runtime)
    try:
        handle.call("setup", cfg, samples, ray.put(WeightUpdate.from_model(tiny.model, 0)), engine_threads=1,
                    track_partials=False)
        eng = RayEngine(handle)
        assert isinstance(eng, Engine) and eng.version == 0
        prompt = tiny.tokenizer("What is 2 + 3?")["input_ids"]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=5)
        out = asyncio.run(eng.generate(prompt, greedy))
        with InferenceEngine(tiny.model, tiny.tokenizer) as local:  # the same weights in this process
            assert out.token_ids == local.generate_batch([prompt], greedy)[0].token_ids
        with pytest.raises(ValueError):  # the engine's own error for an invalid prompt
            asyncio.run(eng.generate([], greedy))
        with pytest.raises(ValueError, match="must increase"):  # versions only increase
            eng.update_weights(WeightUpdate.from_model(tiny.model, 0))
        eng.update_weights(WeightUpdate.from_model(tiny.model, 1))
        assert eng.version == 1 and eng.stats()["num_weight_updates"] == 1
        res = evaluate(eng, tiny.tokenizer, samples[:2], max_new_tokens=4, progress=False)
        assert res.num_problems == 2 and res.mean_response_tokens > 0
    finally:
        handle.call("close")
        ray.kill(actor)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_joins_a_cluster_started_with_ray_start(tmp_path):
    # ray start --head in its own process (token authentication on, a token of this test's own),
    # conveyor train in another process joining it by address; the head is stopped by SIGTERM to
    # the `ray start --block` process (never `ray stop`, which stops every cluster on the machine)
    port = _free_port()
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    run = tmp_path / "r"
    with open(tmp_path / "head.log", "w") as head_log:
        head = subprocess.Popen([ray_bin, "start", "--head", "--block", "--num-cpus=2", f"--port={port}",
                                 "--include-dashboard=false", "--disable-usage-stats"],
                                env=env, stdout=head_log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 90
        while "Ray runtime started" not in (tmp_path / "head.log").read_text():
            assert head.poll() is None and time.time() < deadline, (tmp_path / "head.log").read_text()[-3000:]
            time.sleep(0.5)
        cmd = [sys.executable, "-m", "conveyor.cli", "train", *BASE, *NO_EVAL, "runtime.name=ray",
               f"runtime.address=127.0.0.1:{port}", "trainer.total_steps=2", "async.eta=1", f"run.dir={run}"]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
    rt = [e for e in rows_of(run / "events.jsonl") if e["event"] == "runtime"]
    assert rt and rt[0]["address"] == f"127.0.0.1:{port}"
    assert [r["step"] for r in rows_of(run / "metrics.jsonl")] == [1, 2]


def test_a_local_cluster_smaller_than_the_actors_is_refused_up_front(tmp_path, monkeypatch):
    from conveyor.runtime.ray import connect_ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh `conveyor train` process

    cfg = load_config(None, BASE + ["runtime.name=ray", "runtime.num_cpus=2", "runtime.trainer=actor",
                                    "runtime.trainer_num_cpus=8"])
    with pytest.raises(ValueError, match=r"runtime.num_cpus=2 is fewer than the 9 CPUs"):
        connect_ray(cfg.runtime, min_cpus=9)


def test_without_ray_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    cfg = load_config(None, BASE + RAY + [f"run.dir={tmp_path / 'r'}"])
    with pytest.raises(ImportError, match=r"runtime.name=ray needs Ray.*pip install 'conveyor\[ray\]'"):
        run_training(cfg)
    assert not (tmp_path / "r").exists()  # refused before anything was loaded or written


def test_an_address_where_nothing_answers_is_refused_before_the_run_dir(tmp_path, monkeypatch):
    """Fresh-user trial 3, finding 3: runtime.address=127.0.0.1:1 hung in ray.init with no word,
    after the run directory was made; now `conveyor train` fails at once (exit 1) naming the key,
    and nothing is written. A malformed address is a ValueError naming the forms."""
    from typer.testing import CliRunner

    from conveyor.cli import app
    from conveyor.runtime.ray import RayConnectError, check_ray_address

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh `conveyor train` process
    port = _free_port()  # nothing listens there
    t0 = time.time()
    r = CliRunner().invoke(app, ["train", *BASE, *NO_EVAL, "runtime.name=ray", f"runtime.address=127.0.0.1:{port}",
                                 f"run.dir={tmp_path / 'r'}"])
    assert r.exit_code == 1 and time.time() - t0 < 30, r.output
    out = " ".join(r.output.split())
    assert f"runtime.address=127.0.0.1:{port}: no Ray cluster answers at 127.0.0.1:{port}" in out
    assert "ray start --head" in out and not (tmp_path / "r").exists()
    with pytest.raises(RayConnectError, match=f"ray://127.0.0.1:{port}: no Ray cluster answers"):
        check_ray_address(f"ray://127.0.0.1:{port}")
    for bad in ("127.0.0.1", "host:port", ":6379", "h:70000"):
        with pytest.raises(ValueError, match=r"expected auto, host:port or ray://host:port"):
            check_ray_address(bad)
    check_ray_address(None), check_ray_address("auto")  # not probed
