"""Rollout scheduling (issue 16): with ``rollout.priority=oldest_first`` every engine request of an
episode carries the episode's admission sequence, so the engine serves older groups first; the
share of accepted trajectories dropped as stale is counted."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from conveyor.rollout.buffer import TrajectoryBuffer
from conveyor.rollout.controller import DataStream, RolloutController, wait_for_batch
from conveyor.rollout.staleness import StalenessManager
from conveyor.types import Sample, Trajectory


class RecordingEngine:
    """Records ``(prompt, priority)`` of every generate call; ``None`` when none was passed."""

    def __init__(self, supports_priority: bool) -> None:
        self.supports_priority = supports_priority
        self.version = 0
        self.calls: list[tuple[list[int], int | None]] = []

    async def generate(self, prompt_ids, params=None, **kw):
        self.calls.append((list(prompt_ids), kw.get("priority")))
        await asyncio.sleep(0)
        return list(prompt_ids)


class TwoTurnWorkflow:
    """Two generate calls per episode (a tool episode's two turns); prompts ``[k]`` and
    ``[k, 1]`` for the k-th episode started (the data stream repeats samples)."""

    def __init__(self) -> None:
        self.started = 0

    async def run_episode(self, engine, sample):
        n = self.started
        self.started += 1
        await engine.generate([n], None)
        assert engine.version == 0  # everything but generate is the engine itself
        await engine.generate([n, 1], None)
        return [Trajectory(sample=sample, group_id=f"{sample.id}#{n}#{i}", prompt_ids=[1], response_ids=[2],
                           behaviour_logprobs=[0.0], versions=[0]) for i in range(2)]


def run(engine, priority: str, episodes: int = 6):
    samples = [Sample(str(i), "q", "1", "t") for i in range(episodes)]
    staleness = StalenessManager(batch_size=2, eta=None, max_concurrent=2 * episodes)
    buf = TrajectoryBuffer(None, on_drop=staleness.on_drop)
    c = RolloutController(engine, TwoTurnWorkflow(), DataStream(samples, seed=0),
                          staleness, buf, group_size=2, priority=priority)
    c.start()
    try:
        for _ in range(episodes):
            assert wait_for_batch(buf, 2, lambda: 0, stop=threading.Event()) is not None
    finally:
        c.stop()
    return c


def test_oldest_first_tags_every_turn_with_the_episode_admission_sequence():
    eng = RecordingEngine(supports_priority=True)
    c = run(eng, "oldest_first")
    assert c.priority == "oldest_first"
    by_prompt: dict[int, set] = {}
    for prompt, prio in eng.calls:
        by_prompt.setdefault(prompt[0], set()).add(prio)
    firsts = [prio for prompt, prio in eng.calls if len(prompt) == 1]
    # both turns of an episode carry one priority; episodes admitted later carry larger ones
    assert all(len(p) == 1 for p in by_prompt.values())
    assert firsts == sorted(firsts) and len(set(firsts)) == len(firsts)
    assert firsts[:6] == list(range(6))


def test_fifo_and_engines_without_priority_get_plain_calls():
    eng = RecordingEngine(supports_priority=True)
    run(eng, "fifo")
    assert eng.calls and all(prio is None for _, prio in eng.calls)
    plain = RecordingEngine(supports_priority=False)
    c = run(plain, "oldest_first")
    assert c.priority == "fifo" and all(prio is None for _, prio in plain.calls)
    with pytest.raises(ValueError, match="priority must be 'oldest_first' or 'fifo'"):
        RolloutController(plain, TwoTurnWorkflow(), DataStream([Sample("0", "q", "1", "t")]),
                          StalenessManager(batch_size=2, eta=None, max_concurrent=2),
                          TrajectoryBuffer(None), group_size=2, priority="lifo")


def test_dropped_stale_share_counts_dropped_over_accepted_trajectories():
    staleness = StalenessManager(batch_size=2, eta=1, max_concurrent=8)
    buf = TrajectoryBuffer(1, on_drop=staleness.on_drop)
    c = RolloutController(RecordingEngine(False), TwoTurnWorkflow(), DataStream([Sample("0", "q", "1", "t")]),
                          staleness, buf, group_size=2)
    assert c.counters()["rollout/dropped_stale_share"] == 0.0  # nothing accepted yet: 0, not NaN

    def group(name, version):
        return [Trajectory(sample=Sample(name, "q", "1", "t"), group_id=f"{name}#{i}", prompt_ids=[1],
                           response_ids=[2, 3], behaviour_logprobs=[0.0, 0.0], versions=[version, version + 1])
                for i in range(2)]

    for name, v in (("a", 0), ("b", 1), ("c", 3), ("d", 3)):
        staleness.on_start(2)
        staleness.on_accept(2)
        buf.put(group(name, v))
    assert len(buf.get_batch(2, current_version=3)) == 2  # a (age 0) and b (age 1) are older than 3 - 1
    counters = c.counters()
    assert counters["rollout/dropped_stale"] == 4 and counters["rollout/dropped_stale_share"] == 4 / 8


def test_elastic_threads_lend_the_trainers_threads_for_the_wait_only():
    from conveyor.runtime.step import LocalRollout

    class Eng:
        def __init__(self):
            self.calls = []

        def set_num_threads(self, n):
            self.calls.append(n)

    class Ctl:
        def hand_out(self, batch):
            return batch

        def take_batch(self, n, version):
            return buf.get_batch(n, version)

    eng = Eng()
    buf = TrajectoryBuffer(None)
    buf.put([Trajectory(sample=Sample("a", "q", "1", "t"), group_id=f"a#{i}", prompt_ids=[1], response_ids=[2],
                        behaviour_logprobs=[0.0], versions=[0]) for i in range(2)])
    port = LocalRollout(Ctl(), buf, elastic=(eng, 1, 3))
    assert len(port.next_batch(2, 0)) == 2
    assert eng.calls == [3, 1]  # lent for the wait, given back before the update
    stop = threading.Event()
    stop.set()
    assert port.next_batch(2, 0, stop=stop) is None and eng.calls == [3, 1, 3, 1]  # given back on a stop too
    fixed = LocalRollout(Ctl(), buf)
    assert fixed.elastic is None


def test_elastic_threads_are_refused_outside_the_inline_runtime():
    from conveyor.config import load_config

    assert load_config(None, ["rollout.elastic_threads=true"]).rollout.elastic_threads is True
    with pytest.raises(ValueError, match="rollout.elastic_threads=true needs runtime.name=inline"):
        load_config(None, ["rollout.elastic_threads=true", "runtime.name=ray"])


class QueueingEngine:
    """An engine whose running batch is full: every request joins the waiting queue until the
    test releases the episodes; ``stats()["waiting"]`` counts them."""

    def __init__(self, waiting: int = 0) -> None:
        self.waiting = waiting
        self.release = threading.Event()

    def stats(self):
        return {"waiting": self.waiting}

    async def generate(self, prompt_ids, params=None):
        self.waiting += 1
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        return list(prompt_ids)


class OneTurnWorkflow:
    async def run_episode(self, engine, sample):
        await engine.generate([1], None)
        return [Trajectory(sample=sample, group_id=f"{sample.id}#{id(engine)}#{i}", prompt_ids=[1], response_ids=[2],
                           behaviour_logprobs=[0.0], versions=[0]) for i in range(2)]


@pytest.mark.parametrize("max_engine_waiting, started", [(None, 4), (0, 1), (2, 3)])
def test_engine_aware_admission_starts_episodes_only_while_the_engine_queue_is_short(max_engine_waiting, started):
    import time

    eng = QueueingEngine(waiting=5)  # busy: nothing may start under the knob
    staleness = StalenessManager(batch_size=2, eta=None, max_concurrent=8)  # the capacity rule: 4 episodes
    c = RolloutController(eng, OneTurnWorkflow(), DataStream([Sample(str(i), "q", "1", "t") for i in range(8)]),
                          staleness, TrajectoryBuffer(None), group_size=2, max_engine_waiting=max_engine_waiting)
    c.start()
    try:
        time.sleep(0.6)
        assert c.stats.episodes_started == (4 if max_engine_waiting is None else 0)
        eng.waiting = 0  # a free slot: each started episode's request now waits in the engine
        time.sleep(1.2)
        assert c.stats.episodes_started == started
    finally:
        eng.release.set()
        c.stop()
    with pytest.raises(ValueError, match="max_engine_waiting must be None or an int >= 0"):
        RolloutController(eng, OneTurnWorkflow(), DataStream([Sample("0", "q", "1", "t")]), staleness,
                          TrajectoryBuffer(None), group_size=2, max_engine_waiting=-1)


# ---------------------------------------------------------------- deadline-aware hand-out
def test_buffer_holds_a_batch_back_only_for_expiring_groups_that_fit():
    def group(name, age):
        return [Trajectory(sample=Sample(name, "q", "1", "t"), group_id=f"{name}{i}", prompt_ids=[1],
                           response_ids=[2], behaviour_logprobs=[0.0], versions=[age]) for i in range(2)]

    buf = TrajectoryBuffer(eta=2)
    for name, age in (("a", 3), ("b", 4), ("c", 5)):
        buf.put(group(name, age))
    # at v = 5 groups of age 3 (= 5 - eta) expire after this batch: "a" (2 buffered)
    assert buf.get_batch(4, 5, pending_expiring=2) is None  # 2 buffered + 2 in flight fit in 4: wait
    assert buf.size() == 6  # nothing removed
    assert buf.get_batch(4, 5, pending_expiring=4) is not None  # 2 + 4 > 4: waiting cannot save them all
    buf.put(group("a", 3)), buf.put(group("b", 4))
    assert [t.group_id for t in buf.get_batch(4, 5)] == ["a0", "a1", "b0", "b1"]  # none pending: as before
    with pytest.raises(ValueError, match="pending_expiring"):
        buf.get_batch(2, 5, pending_expiring=-1)
    assert TrajectoryBuffer(eta=None).get_batch(1, 0, pending_expiring=1) is None  # empty, no error


class VersionedWorkflow:
    """Each episode's trajectories carry the policy version at its start; the first episode
    started (the straggler) finishes only when ``gate`` is set."""

    def __init__(self, controller_ref: list, gate: threading.Event) -> None:
        self.ref, self.gate, self.started = controller_ref, gate, 0

    async def run_episode(self, engine, sample):
        n, version = self.started, self.ref[0].version
        self.started += 1
        while n == 0 and not self.gate.is_set():
            await asyncio.sleep(0.01)
        return [Trajectory(sample=sample, group_id=f"e{n}#{i}", prompt_ids=[1], response_ids=[2],
                           behaviour_logprobs=[0.0], versions=[version]) for i in range(2)]


@pytest.mark.parametrize("wait", [False, True])
def test_wait_for_expiring_trains_the_straggler_instead_of_dropping_it(wait):
    """eta = 1, one group of 2 per batch. Episode 0 (admitted at version 0) is slow. Without
    waiting, the batch at version 1 takes a younger group and episode 0 is dropped at version 2;
    with ``wait_for_expiring`` the batch at version 1 waits for it and nothing is dropped."""
    samples = [Sample(str(i), "q", "1", "t") for i in range(8)]
    staleness = StalenessManager(batch_size=2, eta=1, max_concurrent=64)
    buf = TrajectoryBuffer(1, on_drop=staleness.on_drop)
    gate, ref = threading.Event(), []
    c = RolloutController(RecordingEngine(False), VersionedWorkflow(ref, gate), DataStream(samples, seed=0),
                          staleness, buf, group_size=2, wait_for_expiring=wait)
    ref.append(c)
    stop = threading.Event()
    take = lambda v: wait_for_batch(buf, 2, lambda: v, stop=stop, take=c.take_batch, poll_s=0.05)  # noqa: E731
    c.start()
    try:
        groups = []
        assert c.expiring_inflight(0) == 0  # admitted at 0 > 0 - eta: not expiring yet
        groups.append(take(0)[0].group_id)  # episode 1 (episode 0 is still running)
        c.set_version(1)
        assert c.expiring_inflight(1) == 2  # episode 0: admitted at 0 <= 1 - 1
        if wait:
            timer = threading.Timer(0.5, gate.set)
            timer.start()
            t0 = __import__("time").monotonic()
            groups.append(take(1)[0].group_id)
            assert __import__("time").monotonic() - t0 >= 0.4  # it waited for the straggler
        else:
            groups.append(take(1)[0].group_id)  # a younger group, at once
            gate.set()
            deadline = __import__("time").monotonic() + 30
            while c.expiring_inflight(1) and __import__("time").monotonic() < deadline:
                __import__("time").sleep(0.01)  # the straggler is in the buffer before version 2
        c.set_version(2)
        groups.append(take(2)[0].group_id)
    finally:
        stop.set()
        c.stop()
    if wait:
        assert groups[:2] == ["e1#0", "e0#0"] and buf.stats()["dropped_stale"] == 0
        assert c.counters()["rollout/expiring_waits"] == 1 and c.counters()["rollout/expiring_wait_timeouts"] == 0
    else:
        assert groups[:2] == ["e1#0", "e2#0"] and buf.stats()["dropped_stale"] == 2
        assert [r["group"] for r in c.take_not_trained()] == ["e0#0"]


def test_engine_dtype_auto_follows_the_trainers_bf16_autocast():
    from conveyor.config import load_config
    from conveyor.runtime.inline import resolve_engine_dtype

    auto = load_config(None, ["rollout.engine_dtype=auto"])
    assert resolve_engine_dtype(auto, True).rollout.engine_dtype == "bfloat16"
    assert resolve_engine_dtype(auto, False).rollout.engine_dtype == "float32"
    assert auto.rollout.engine_dtype == "auto"  # a copy: the run's config is unchanged
    fixed = load_config(None, ["rollout.engine_dtype=float32"])
    assert resolve_engine_dtype(fixed, True) is fixed  # an explicit dtype is kept


def test_heldout_evaluation_of_a_bf16_engine_run_runs_the_policy_in_float32(tmp_path, tiny):
    """``run.eval_dtype=float32`` (default): with a bf16 engine the held-out evaluation runs the
    trainer's policy in a float32 engine of its own (never the rollout engine), with the same
    result as evaluating the policy in float32 directly."""
    import copy
    from types import SimpleNamespace

    from conveyor.config import load_config
    from conveyor.data import load_dataset
    from conveyor.eval import evaluate
    from conveyor.rollout.engine import InferenceEngine
    from conveyor.runlog import MetricsLogger
    from conveyor.runtime.inline import eval_policy, heldout_eval

    base = ["model.name=tiny", "run.eval_max_new_tokens=6", "rollout.tool=none"]
    cfg = load_config(None, [*base, "rollout.engine_dtype=bfloat16"])
    trainer = SimpleNamespace(model=tiny.model, bf16=False, inference_policy=lambda: tiny.model)
    assert eval_policy(cfg, trainer) is tiny.model
    assert eval_policy(load_config(None, [*base, "rollout.engine_dtype=bfloat16", "run.eval_dtype=engine"]), trainer) is None
    assert eval_policy(load_config(None, [*base, "rollout.engine_dtype=float32"]), trainer) is None
    auto = load_config(None, [*base, "rollout.engine_dtype=auto"])
    assert eval_policy(auto, SimpleNamespace(model=tiny.model, bf16=True, inference_policy=lambda: tiny.model)) is tiny.model
    assert eval_policy(auto, trainer) is None  # auto with a float32 trainer: a float32 engine

    class RolloutEngine:  # the run's (bf16) engine: must not be used
        async def generate(self, *a, **kw):
            raise AssertionError("evaluated with the rollout engine")

    samples = load_dataset("mawps:singleop:heldout")[:4]
    logger = MetricsLogger(tmp_path, tensorboard=False)
    try:
        res = heldout_eval(RolloutEngine(), tiny.tokenizer, cfg, samples, "after", logger, tmp_path, False,
                           policy=tiny.model)
    finally:
        logger.close()
    model = copy.deepcopy(tiny.model).float().eval()
    with InferenceEngine(model, tiny.tokenizer, dtype=torch.float32) as eng:
        ref = evaluate(eng, tiny.tokenizer, samples, k=1, temperature=0.0, max_new_tokens=6,
                       instruction=cfg.data.instruction, tool="none")
    assert [r["responses"] for r in res.records] == [r["responses"] for r in ref.records]
    assert res.num_problems == 4 and (tmp_path / "eval_after.json").is_file()
    assert all(p.requires_grad for p in tiny.model.parameters())  # the policy itself untouched


def test_a_batch_waits_for_an_expiring_group_at_most_expiring_wait_s():
    """A straggler that never ends does not stop training: after ``expiring_wait_s`` the batch
    forms as usual (counted); an episode admitted before ``v - eta`` is not waited for."""
    import time

    samples = [Sample(str(i), "q", "1", "t") for i in range(8)]
    staleness = StalenessManager(batch_size=2, eta=1, max_concurrent=64)
    buf = TrajectoryBuffer(1, on_drop=staleness.on_drop)
    gate, ref = threading.Event(), []  # never set: episode 0 never ends
    c = RolloutController(RecordingEngine(False), VersionedWorkflow(ref, gate), DataStream(samples, seed=0),
                          staleness, buf, group_size=2, wait_for_expiring=True, expiring_wait_s=0.3)
    ref.append(c)
    stop = threading.Event()
    c.start()
    try:
        assert wait_for_batch(buf, 2, lambda: 0, stop=stop, take=c.take_batch, poll_s=0.05) is not None
        c.set_version(1)
        t0 = time.monotonic()
        batch = wait_for_batch(buf, 2, lambda: 1, stop=stop, take=c.take_batch, poll_s=0.05)
        assert batch[0].group_id == "e2#0" and time.monotonic() - t0 >= 0.3
        counters = c.counters()
        assert counters["rollout/expiring_waits"] == 1 and counters["rollout/expiring_wait_timeouts"] == 1
        assert c.expiring_inflight(1) == 2 and c.expiring_inflight(2) == 0  # admitted at 0 < 2 - 1: stale anyway
    finally:
        stop.set()
        gate.set()
        c.stop()
    with pytest.raises(ValueError, match="expiring_wait_s"):
        RolloutController(RecordingEngine(False), VersionedWorkflow([], gate), DataStream(samples), staleness, buf,
                          group_size=2, expiring_wait_s=-1)


def test_an_episode_failing_past_the_workflow_stops_the_run_and_is_never_waited_for():
    """A workflow returning a group of the wrong size is a defect: the controller stops with the
    error (the runtime raises it), and the episode no longer counts as in flight."""

    class WrongSize:
        async def run_episode(self, engine, sample):
            return [Trajectory(sample=sample, group_id="x", prompt_ids=[1], response_ids=[2],
                               behaviour_logprobs=[0.0], versions=[0])]  # 1, not group_size=2

    staleness = StalenessManager(batch_size=2, eta=0, max_concurrent=2)
    buf = TrajectoryBuffer(0, on_drop=staleness.on_drop)
    c = RolloutController(RecordingEngine(False), WrongSize(), DataStream([Sample("0", "q", "1", "t")]),
                          staleness, buf, group_size=2, wait_for_expiring=True)
    c.start()
    try:
        deadline = __import__("time").monotonic() + 30
        while c.error is None and __import__("time").monotonic() < deadline:
            __import__("time").sleep(0.01)
    finally:
        c.stop()
    assert isinstance(c.error, RuntimeError) and "expected group_size=2" in str(c.error)
    assert c.expiring_inflight(0) == 0


def test_a_batch_that_is_not_complete_yet_is_not_an_expiring_wait():
    """eta = 0 (synchronous): every group of the step is in flight and "expiring" while the batch
    fills, but nothing is held back, so no expiring wait is counted (and no expiring_wait_s
    clock runs). A batch held back for a straggler still is one (the test above)."""
    import time

    samples = [Sample(str(i), "q", "1", "t") for i in range(8)]
    staleness = StalenessManager(batch_size=2, eta=0, max_concurrent=64)
    buf = TrajectoryBuffer(0, on_drop=staleness.on_drop)
    gate, ref = threading.Event(), []

    class Slow(VersionedWorkflow):  # every episode takes a while: the batch is incomplete at first
        async def run_episode(self, engine, sample):
            await asyncio.sleep(0.2)
            return await super().run_episode(engine, sample)

    gate.set()
    c = RolloutController(RecordingEngine(False), Slow(ref, gate), DataStream(samples, seed=0),
                          staleness, buf, group_size=2, wait_for_expiring=True, expiring_wait_s=0.05)
    ref.append(c)
    stop = threading.Event()
    c.start()
    try:
        for v in range(3):
            c.set_version(v)
            t0 = time.monotonic()
            assert wait_for_batch(buf, 2, lambda v=v: v, stop=stop, take=c.take_batch, poll_s=0.01) is not None
            assert time.monotonic() - t0 >= 0.1  # it did wait for the slow episode
        counters = c.counters()
        assert counters["rollout/expiring_waits"] == 0 and counters["rollout/expiring_wait_timeouts"] == 0
    finally:
        stop.set()
        c.stop()


def test_lowering_eta_mid_run_throttles_admission_and_drops_nothing_admitted():
    """An adaptive controller lowers eta 2 -> 0 at version 1 (asyppo.md: judged by the lowered
    bound, every decrease threw a batch away). Episodes admitted under eta 2 (e0, a straggler;
    e1; e2) are trained within eta 2 (e2 at version 1, e0 at version 2, both of age 0), the
    straggler still counts as expiring at version 2 = 0 + 2, nothing is dropped, and no new
    episode is admitted until the lowered bound allows one (version 3: (0 + 3 + 1) x 2 = 8 >
    6 accepted). The checkpoint keeps each buffered group's admission bound."""
    import time

    samples = [Sample(str(i), "q", "1", "t") for i in range(8)]
    staleness = StalenessManager(batch_size=2, eta=2, max_concurrent=64)
    buf = TrajectoryBuffer(2, on_drop=staleness.on_drop)
    gate, ref = threading.Event(), []
    c = RolloutController(RecordingEngine(False), VersionedWorkflow(ref, gate), DataStream(samples, seed=0),
                          staleness, buf, group_size=2)
    ref.append(c)
    stop = threading.Event()
    take = lambda v: wait_for_batch(buf, 2, lambda: v, stop=stop, take=c.take_batch, poll_s=0.05)  # noqa: E731
    c.start()
    try:
        groups = [take(0)[0].group_id]       # e1 or e2 (e0 waits at the gate)
        c.set_eta(0)
        c.set_version(1)
        deadline = time.monotonic() + 30
        while buf.size() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        groups.append(take(1)[0].group_id)   # the other one: age 0 < 1 - 0, kept by its bound 2
        c.set_version(2)
        assert c.expiring_inflight(2) == 2   # e0: admitted at 0 = 2 - 2
        assert c.stats.episodes_started == 3  # the lowered bound admits nothing: (0 + 2 + 1) x 2 = 6
        gate.set()
        groups.append(take(2)[0].group_id)   # the straggler: age 0 >= 2 - 2
        state = c.snapshot()
        c.set_version(3)                     # (0 + 3 + 1) x 2 = 8: one more episode, under eta 0
        deadline = time.monotonic() + 30
        while c.stats.episodes_started < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.stats.episodes_started == 4
    finally:
        stop.set()
        c.stop()
    assert sorted(groups[:2]) == ["e1#0", "e2#0"] and groups[2] == "e0#0"
    assert buf.stats()["dropped_stale"] == 0 and c.take_not_trained() == []
    assert state["buffer"] == [] and state["buffer_eta"] == []
    cnt = c.counters()  # trajectories: accepted = trained (3 batches of 2) + buffered + dropped
    assert cnt["rollout/trajectories_accepted"] == 2 * cnt["rollout/episodes_accepted"] == 6 + cnt["rollout/buffered"]


def test_controller_checkpoint_keeps_each_groups_admission_bound():
    """snapshot() saves each buffered group's admission bound (``buffer_eta``) and restore()
    puts it back, so a resume after eta was lowered drops nothing admitted under the old bound; a
    checkpoint saved before bounds were recorded restores them as the bound in force."""
    samples = [Sample(str(i), "q", "1", "t") for i in range(4)]

    def controller(eta):
        staleness = StalenessManager(batch_size=2, eta=eta, max_concurrent=64)
        buf = TrajectoryBuffer(eta, on_drop=staleness.on_drop)
        return RolloutController(RecordingEngine(False), VersionedWorkflow([], threading.Event()),
                                 DataStream(samples, seed=0), staleness, buf, group_size=2), buf

    c, buf = controller(0)
    group = [Trajectory(sample=samples[0], group_id=f"g#{i}", prompt_ids=[1], response_ids=[2],
                        behaviour_logprobs=[0.0], versions=[1]) for i in range(2)]
    buf.put(group, eta=3)                    # admitted under eta 3, before a lowering to 0
    state = c.snapshot()
    assert state["buffer_eta"] == [3]
    again, again_buf = controller(0)
    again.restore(state, version=4)
    assert again_buf.drop_stale(4) == 0      # 1 >= 4 - 3
    # the old-log-prob patches of work admitted under eta 3 live as long as it may be trained
    from conveyor.rollout.old_logprobs import OldLogprobPatch
    again.apply_old_logprobs([OldLogprobPatch("k", 0, (-1.0,), 1)])
    again.set_version(4)                     # 1 >= 4 - 3: kept (judged by eta 0 it was forgotten)
    assert len(again.old_logprobs) == 1
    again_buf.get_batch(2, 4)
    again.set_version(5)                     # nothing admitted under eta 3 is left: eta 0 applies
    assert len(again.old_logprobs) == 0
    old = dict(state, buffer_eta=None)       # an older checkpoint: the bound in force (0)
    third, third_buf = controller(0)
    third.restore(old, version=4)
    assert third_buf.drop_stale(4) == 2


class GoneEngine(RecordingEngine):
    """An engine whose server process died: every request raises EngineGoneError."""

    async def generate(self, prompt_ids, params=None, **kw):
        from conveyor.rollout.engine.remote import EngineGoneError

        self.calls.append((list(prompt_ids), None))
        raise EngineGoneError("the vLLM server (pid 1) exited with code -9", None, "http://x")


def test_an_engine_whose_server_is_gone_stops_the_controller_at_the_first_failure():
    """A dead server is not retried episode after episode (max_failed_in_a_row): the first
    EngineGoneError stops the controller with that error, for the runtime to raise."""
    import time

    from conveyor.rollout.engine.remote import EngineGoneError

    eng = GoneEngine(False)
    staleness = StalenessManager(batch_size=2, eta=None, max_concurrent=2)
    c = RolloutController(eng, TwoTurnWorkflow(), DataStream([Sample(str(i), "q", "1", "t") for i in range(50)]),
                          staleness, TrajectoryBuffer(None), group_size=2, max_failed_in_a_row=100)
    c.start()
    try:
        deadline = time.monotonic() + 10
        while c.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(c.error, EngineGoneError) and "exited with code -9" in str(c.error)
        assert c.stats.episodes_failed < 100  # not the 100-in-a-row rule
    finally:
        c.stop()
