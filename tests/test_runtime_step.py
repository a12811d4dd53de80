"""The step protocol (conveyor.runtime.step) and the record phase (conveyor.runtime.record) against
fakes: the order of the phases, the version hand-over after the publish, the stop and error paths,
and the per-step metrics computed by hand."""

from __future__ import annotations

import threading

import pytest

from conveyor.rollout.buffer import TrajectoryBuffer
from conveyor.runtime.record import RunClock, StepRecorder, batch_metrics
from conveyor.runtime.step import LocalRollout, RolloutPort, run_step
from conveyor.trainer.trainer import NonFiniteLossError
from conveyor.types import Sample, Trajectory


def traj(n_tokens=3, correct=True, finish="stop", **meta):
    return Trajectory(sample=Sample("s", "q", "1", "t"), group_id="g", prompt_ids=[1, 2],
                      response_ids=list(range(n_tokens)), behaviour_logprobs=[-1.0] * n_tokens,
                      versions=[0] * n_tokens, correct=correct, finish_reason=finish, metadata=dict(meta))


class Calls(list):
    pass


class FakeTrainer:
    def __init__(self, calls, fail=False):
        self.calls, self.version, self.fail = calls, 3, fail

    def train_step(self, batch):
        self.calls.append(("train", self.version, len(batch)))
        if self.fail:
            raise NonFiniteLossError("loss is nan")
        self.version += 1
        return {"time/proximal_s": 0.5, "loss": 1.0}


class FakeRollout:
    def __init__(self, calls, batch):
        self.calls, self.batch = calls, batch

    def next_batch(self, n, version, *, health=None, stop=None):
        self.calls.append(("next_batch", n, version))
        if health is not None:
            health()
        return None if stop is not None and stop.is_set() else self.batch[:n]

    def set_version(self, version):
        self.calls.append(("set_version", version))

    def counters(self):
        return {}

    def take_not_trained(self):
        return []

    def buffered(self):
        return []

    def apply_old_logprobs(self, patches):
        self.calls.append(("patches", len(patches)))

    def training_ended(self):
        self.calls.append(("training_ended",))


class FakePublisher:
    def __init__(self, calls, partial_sync_s=0.0):
        self.calls, self.partial_sync_s = calls, partial_sync_s

    def before_step(self, trainer):
        self.calls.append(("before_step", trainer.version))

    def publish(self, trainer):
        self.calls.append(("publish", trainer.version))
        return {"time/partial_sync_s": self.partial_sync_s} if self.partial_sync_s else {}


def test_run_step_phases_in_order_and_version_handed_over_after_the_publish():
    calls = Calls()
    batch = [traj(), traj(), traj()]
    out = run_step(FakeTrainer(calls), FakeRollout(calls, batch), FakePublisher(calls, partial_sync_s=0.25), 2)
    # before_step first: e.g. the dedicated worker's patches are delivered before the batch leaves
    assert calls == [("before_step", 3), ("next_batch", 2, 3), ("train", 3, 2), ("publish", 4), ("set_version", 4)]
    assert out.batch == batch[:2]
    # partial-sync scoring is proximal time too
    assert out.metrics["time/proximal_s"] == pytest.approx(0.75)
    assert out.metrics["time/weight_sync_s"] >= 0.0 and out.busy_s >= out.metrics["time/weight_sync_s"]


def test_run_step_enters_the_update_context_around_the_update_only_and_adds_its_metrics():
    """``update_context`` (trainer.elastic_threads) spans the update: not the wait for the batch,
    not the publish; it is left before the weights go out, also when the update fails."""
    from contextlib import contextmanager

    calls = Calls()

    @contextmanager
    def span():
        calls.append(("enter",))
        out = {}
        try:
            yield out
        finally:
            calls.append(("exit",))
            out["time/borrowed_threads_s"] = 1.5

    out = run_step(FakeTrainer(calls), FakeRollout(calls, [traj()]), FakePublisher(calls), 1, update_context=span)
    assert [c[0] for c in calls] == ["before_step", "next_batch", "enter", "train", "exit", "publish", "set_version"]
    assert out.metrics["time/borrowed_threads_s"] == 1.5 and out.metrics["loss"] == 1.0
    calls.clear()
    with pytest.raises(NonFiniteLossError):
        run_step(FakeTrainer(calls, fail=True), FakeRollout(calls, [traj()]), FakePublisher(calls), 1, update_context=span)
    assert [c[0] for c in calls] == ["before_step", "next_batch", "enter", "train", "exit"]


def test_run_step_returns_none_when_stopped_and_trains_nothing():
    calls = Calls()
    stop = threading.Event()
    stop.set()
    assert run_step(FakeTrainer(calls), FakeRollout(calls, [traj()]), FakePublisher(calls), 1, stop=stop) is None
    assert [c[0] for c in calls] == ["before_step", "next_batch"]


def test_run_step_health_error_propagates():
    def health():
        raise RuntimeError("rollout controller crashed")

    calls = Calls()
    with pytest.raises(RuntimeError, match="crashed"):
        run_step(FakeTrainer(calls), FakeRollout(calls, [traj()]), FakePublisher(calls), 1, health=health)
    assert [c[0] for c in calls] == ["before_step", "next_batch"]


def test_run_step_nonfinite_loss_carries_its_batch_and_publishes_nothing():
    calls = Calls()
    batch = [traj(), traj()]
    with pytest.raises(NonFiniteLossError) as e:
        run_step(FakeTrainer(calls, fail=True), FakeRollout(calls, batch), FakePublisher(calls), 2)
    assert e.value.batch == batch
    assert [c[0] for c in calls] == ["before_step", "next_batch", "train"]


def test_local_rollout_is_a_rollout_port_over_the_buffer():
    class Controller:
        def __init__(self):
            self.versions = []

        def set_version(self, v):
            self.versions.append(v)

        def counters(self):
            return {"rollout/dropped_stale": 0}

        def take_not_trained(self):
            return [{"reason": "stale"}]

        def hand_out(self, batch):
            self.handed = list(batch)
            return batch

        def apply_old_logprobs(self, patches):
            self.patches = patches

        def take_batch(self, n, version):  # the controller's buffer, here the one below
            return buf.get_batch(n, version)

    buf = TrajectoryBuffer(1)
    buf.put([traj(), traj()])
    c = Controller()
    port = LocalRollout(c, buf)
    assert isinstance(port, RolloutPort) and isinstance(FakeRollout([], []), RolloutPort)
    buf.put([traj(), traj()])
    assert len(port.buffered()) == 4  # read-only view, nothing taken
    got = port.next_batch(2, 0)
    assert len(got) == 2 and buf.size() == 2 and c.handed == got  # old log-probs attached on the way out
    port.apply_old_logprobs(["p"])
    assert c.patches == ["p"]
    port.next_batch(2, 0)
    stop = threading.Event()
    stop.set()
    assert port.next_batch(1, 0, stop=stop) is None  # nothing buffered: the stop wins
    port.set_version(1)
    assert c.versions == [1] and port.take_not_trained() == [{"reason": "stale"}]


def test_batch_metrics_by_hand():
    batch = [traj(2, True, "stop", format_ok=True), traj(4, False, "length"),
             traj(6, None, "stop", format_ok=True, reward_failed=True), traj(8, True, "length")]
    m = batch_metrics(batch)
    assert m["rollout/accuracy"] == 0.5  # unknown counts as wrong
    assert m["rollout/format_rate"] == 0.5
    assert m["rollout/correct_unknown_share"] == 0.25
    assert m["rollout/reward_failed_share"] == 0.25
    assert m["rollout/truncated_share"] == 0.5
    assert m["response/length_mean"] == 5.0 and m["response/length_max"] == 8.0


def test_run_clock_throughput_and_busy_fractions(monkeypatch):
    import conveyor.runtime.record as rec

    now, cpu = [100.0], [7.0]
    monkeypatch.setattr(rec.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(rec.time, "process_time", lambda: cpu[0])
    monkeypatch.setattr(rec.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    stats = [{"busy_seconds": 5.0, "generated_tokens": 1000}]
    clock = RunClock(lambda: stats[0])
    assert clock.cores == 2
    now[0], stats[0], cpu[0] = 110.0, {"busy_seconds": 13.0, "generated_tokens": 1500, "pause_seconds_total": 1.5}, 22.0
    clock.add_busy(4.0)
    m = clock.tick()
    assert m["throughput/generated_tokens_per_s"] == pytest.approx(50.0)  # 500 tokens in 10 s
    assert m["busy/trainer"] == pytest.approx(0.4) and m["busy/engine"] == pytest.approx(0.8)
    assert m["busy/cpu"] == pytest.approx(0.75)  # 15 CPU seconds in 10 s on 2 cores
    assert m["time/step_wall_s"] == pytest.approx(10.0) and m["engine/pause_seconds_total"] == 1.5
    now[0], stats[0] = 130.0, {"busy_seconds": 23.0, "generated_tokens": 1600}
    m = clock.tick()  # the second tick measures from the first
    assert m["throughput/generated_tokens_per_s"] == pytest.approx(5.0)
    assert m["time/step_wall_s"] == pytest.approx(20.0) and m["time/elapsed_s"] == pytest.approx(30.0)
    cpu[0] = 55.0
    assert clock.busy(6.0) == {"time/elapsed_s": 30.0, "busy/trainer": 0.2, "busy/engine": pytest.approx(0.6),
                               "busy/cpu": pytest.approx(0.8)}  # 48 CPU seconds in 30 s on 2 cores


def test_run_clock_counts_an_engine_servers_cpu_and_survives_an_engine_without_counters(monkeypatch):
    """rollout.engine=vllm: the server's processes' CPU seconds (server_cpu_seconds in the engine's
    stats) count in busy/cpu; a remote engine reporting no busy time / tokens (SGLang's server)
    reads as idle instead of breaking the loop's bookkeeping with a KeyError."""
    import conveyor.runtime.record as rec

    now, cpu = [100.0], [7.0]
    monkeypatch.setattr(rec.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(rec.time, "process_time", lambda: cpu[0])
    monkeypatch.setattr(rec.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    stats = [{"busy_seconds": 0.0, "generated_tokens": 0, "server_cpu_seconds": 50.0}]
    clock = RunClock(lambda: stats[0])
    now[0], cpu[0] = 110.0, 12.0
    stats[0] = {"busy_seconds": 8.0, "generated_tokens": 400, "server_cpu_seconds": 62.0}
    m = clock.tick()
    assert m["busy/cpu"] == pytest.approx(0.85)  # (5 + 12) CPU seconds in 10 s on 2 cores
    assert m["busy/engine"] == pytest.approx(0.8)
    bare = RunClock(lambda: {"version": 3, "base_url": "http://sglang"})
    now[0] = 120.0
    m = bare.tick()
    assert m["busy/engine"] == 0.0 and m["throughput/generated_tokens_per_s"] == 0.0


def test_step_recorder_logs_row_batch_and_named_events():
    class Logger:
        def __init__(self):
            self.rows, self.trained_rows, self.events = [], [], []

        def log(self, v, m):
            self.rows.append((v, dict(m)))

        def trained(self, v, batch, not_trained):
            self.trained_rows.append((v, len(batch), not_trained))

        def event(self, name, **kw):
            self.events.append((name, kw))

    class Bar:
        def update(self, *a, **k):
            self.info = k["info"]

    class Controller:
        class stats:  # noqa: N801 - attribute bag
            reward_failures = 0
            episodes_failed = 0

    printed = []

    class Console:
        def print(self, s, **k):
            printed.append(s)

    lg = Logger()
    Controller.stats.reward_failures = 12  # restored from a checkpoint: not this process's news
    r = StepRecorder(lg, Controller(), Console(), Bar(), 0, total=10, progress=False)
    assert r.failures.update({"reward failures": 12, "failed episodes": 0}) is None
    m = {"train/skipped_nonfinite": 1.0, "reward/mean": 0.5, "rollout/accuracy": 0.25, "staleness/mean": 1.0,
         "staleness/max": 2.0, "throughput/generated_tokens_per_s": 40.0, "busy/trainer": 0.5, "busy/engine": 0.9,
         "time/elapsed_s": 12.0, "time/proximal_s": 0.2, "time/train_step_s": 3.0}
    r.step(5, m, [traj()], [{"why": "stale"}], [{"event": "ewma_reset", "version": 5}, {"keep_rate": 0.9}])
    assert lg.rows == [(5, m)] and lg.trained_rows == [(5, 1, [{"why": "stale"}])]
    assert lg.events == [("skipped_nonfinite", {"version": 5}), ("ewma_reset", {"version": 5}),
                         ("proximal", {"keep_rate": 0.9})]
    assert printed and printed[0].startswith("step 5/10 reward 0.500 acc 0.250")  # every 5th step
    assert r.mean_seconds() == (0.2, 3.0)


def test_both_rollout_sides_implement_every_method_of_the_port():
    """The training loop calls the port's methods on whichever runtime's rollout it has (e.g.
    ``training_ended`` when the loop ends), so the Ray side must have each of them too."""
    from conveyor.runtime.ray import RayRollout

    members = [m for m in vars(RolloutPort) if not m.startswith("_")]
    assert "training_ended" in members and "next_batch" in members
    for cls in (LocalRollout, RayRollout):
        assert [m for m in members if not callable(getattr(cls, m, None))] == [], cls.__name__
