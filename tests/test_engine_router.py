"""EngineRouter (rollout.num_engines): routing, weights to every engine, merged statistics, and a
dead engine replaced with its requests run again. Fake engines here; real ones in
tests/test_train_e2e.py (inline) and tests/test_ray_runtime.py (Ray engine actors)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from conveyor.rollout.engine import Engine, GenerationOutput
from conveyor.rollout.engine.router import EngineDiedError, EngineRouter, merge_engine_stats


class FakeEngine:
    """Answers each prompt with ``[name, len(prompt)]`` after ``gate`` opens; counts calls."""

    def __init__(self, name: int, version: int = 0, busy: float | None = None):
        self.name = name
        self._version = version
        self.prompts: list[list[int]] = []
        self.updates: list[int] = []
        self.calls: list[str] = []
        self.dead = False
        self.gate: asyncio.Event | None = None
        self.busy = 1.5 * (name + 1) if busy is None else busy
        self.closed = False

    @property
    def version(self) -> int:
        return self._version

    def start(self):
        self.calls.append("start")

    def stop(self):
        self.calls.append("stop")

    def close(self):
        self.closed = True

    def pause(self):
        self.calls.append("pause")

    def resume(self):
        self.calls.append("resume")

    def stats(self):
        if self.dead:
            raise EngineDiedError(f"engine {self.name} is gone")
        return {"busy_seconds": self.busy, "generated_tokens": 10 * (self.name + 1), "running": 1, "waiting": 2,
                "version": self._version, "paused": False, "dtype": "float32",
                "decode_profile": {1: [2, 0.5], self.name + 2: [1, 0.25]}}

    def update_weights(self, update, *, wait=True):
        if self.dead:
            raise EngineDiedError(f"engine {self.name} is gone")
        self.updates.append(update.version)
        self._version = update.version
        f = concurrent.futures.Future()
        f.set_result(None)
        return f

    def partial_requests(self, *, require_pause=True):
        return []

    async def generate(self, prompt_ids, params=None):
        self.prompts.append(list(prompt_ids))
        if self.gate is not None:
            await self.gate.wait()
        if self.dead:
            raise EngineDiedError(f"engine {self.name} died")
        return GenerationOutput(prompt_ids=list(prompt_ids), token_ids=[self.name, len(prompt_ids)],
                                logprobs=[-1.0, -1.0], versions=[self._version] * 2)


class Update:
    def __init__(self, version):
        self.version = version


def run(coro):
    return asyncio.run(coro)


def test_router_is_an_engine_and_spreads_new_prompts_over_the_least_loaded_engines():
    a, b = FakeEngine(0), FakeEngine(1)
    r = EngineRouter([a, b])
    assert isinstance(r, Engine)

    async def go():
        gate = asyncio.Event()
        a.gate = b.gate = gate
        tasks = [asyncio.create_task(r.generate([i, 100 + i])) for i in range(4)]  # 4 different prompts
        await asyncio.sleep(0.01)
        gate.set()
        return await asyncio.gather(*tasks)

    outs = run(go())
    # least loaded, ties to the lowest index: 0, 1, 0, 1
    assert [o.token_ids[0] for o in outs] == [0, 1, 0, 1]
    assert len(a.prompts) == len(b.prompts) == 2


def test_a_groups_responses_and_an_episodes_next_turn_go_to_the_engine_that_served_it():
    a, b = FakeEngine(0), FakeEngine(1)
    r = EngineRouter([a, b], affinity_slack=8)

    async def go():
        gate = asyncio.Event()
        a.gate = b.gate = gate
        group1 = [asyncio.create_task(r.generate([7, 7, 7])) for _ in range(4)]
        group2 = [asyncio.create_task(r.generate([8, 8])) for _ in range(4)]
        await asyncio.sleep(0.01)
        gate.set()
        g1, g2 = await asyncio.gather(*group1), await asyncio.gather(*group2)
        a.gate = b.gate = None
        # the next turn of an episode served by engine 1: prompt + its response + an observation
        first = g2[0]
        nxt = await r.generate(list(first.prompt_ids) + list(first.token_ids) + [55, 56])
        return g1, g2, nxt

    g1, g2, nxt = run(go())
    assert {o.token_ids[0] for o in g1} == {0}  # the whole group on engine 0
    assert {o.token_ids[0] for o in g2} == {1}  # the next new prompt on the least loaded, engine 1
    assert nxt.token_ids[0] == 1
    assert r.stats()["routed_by_affinity"] == 3 + 3 + 1


def test_affinity_yields_to_load_beyond_the_slack():
    a, b = FakeEngine(0), FakeEngine(1)
    r = EngineRouter([a, b], affinity_slack=1)

    async def go():
        gate = asyncio.Event()
        a.gate = b.gate = gate
        tasks = [asyncio.create_task(r.generate([3, 3])) for _ in range(5)]
        await asyncio.sleep(0.01)
        gate.set()
        return await asyncio.gather(*tasks)

    outs = run(go())
    # engine 0 keeps the prompt while it has at most 1 more in flight than engine 1; the third
    # request goes to engine 1 (2 > 0 + 1), which then holds the prompt too and gets the rest
    assert [o.token_ids[0] for o in outs] == [0, 0, 1, 1, 1]


def test_weights_control_and_statistics_reach_every_engine():
    a, b = FakeEngine(0), FakeEngine(1)
    r = EngineRouter([a, b])
    r.start()
    r.pause()
    r.resume()
    r.stop()
    assert a.calls == b.calls == ["start", "pause", "resume", "stop"]
    f = r.update_weights(Update(3))
    assert f.done() and f.result() is None
    assert a.updates == b.updates == [3] and r.version == 3
    st = r.stats()
    assert st["num_engines"] == 2 and len(st["engines"]) == 2
    assert st["busy_seconds"] == pytest.approx(1.5 + 3.0)
    assert st["generated_tokens"] == 30 and st["running"] == 2 and st["waiting"] == 4
    assert st["version"] == 3 and st["paused"] is False and st["dtype"] == "float32"
    assert st["decode_profile"] == {1: [4, 1.0], 2: [1, 0.25], 3: [1, 0.25]}


def test_merge_engine_stats_takes_the_lowest_version_and_all_paused():
    m = merge_engine_stats([{"version": 4, "paused": True, "n": 1}, {"version": 2, "paused": False, "n": 2.5}])
    assert m == {"version": 2, "paused": False, "n": 3.5}


def test_a_dead_engine_is_replaced_at_the_newest_weights_and_its_requests_run_again():
    a, b = FakeEngine(0), FakeEngine(1)
    built = []
    release = threading.Event()

    def restart(slot, update):
        release.wait(5)  # a slow start (a Ray actor): the requests must not wait for it
        e = FakeEngine(10 + slot, version=update.version, busy=0.25)
        built.append((slot, update.version))
        return e

    r = EngineRouter([a, b], restart=restart, max_restarts=1)
    r.start()
    r.update_weights(Update(1))
    assert r.stats()["busy_seconds"] == pytest.approx(1.5 + 3.0)  # read before the death

    async def go():
        gate = asyncio.Event()
        a.gate = b.gate = gate
        tasks = [asyncio.create_task(r.generate([i])) for i in range(4)]  # 2 on each engine
        await asyncio.sleep(0.01)
        b.dead = True  # engine 1 dies with 2 requests in flight
        gate.set()
        return await asyncio.gather(*tasks)

    outs = run(go())
    assert len(outs) == 4 and all(o.versions == [1, 1] for o in outs)
    assert [o.token_ids[0] for o in outs] == [0] * 4  # the two that died ran again on engine 0 at once
    assert built == [] and r.stats()["engines"][1]["state"] == "replacing"
    release.set()
    assert r.wait_for_replacements(5)
    assert built == [(1, 1)]
    st = r.stats()
    assert [e["state"] for e in st["engines"]] == ["live", "live"]
    assert st["engine_restarts"] == 1 and st["router_resubmitted"] == 2
    assert r.engines[1].name == 11 and r.engines[1].calls == ["start"]
    # the dead engine's counters (as last read) were carried: busy seconds never go back
    assert st["busy_seconds"] == pytest.approx(1.5 + 3.0 + 0.25)
    assert st["engines"][1]["busy_seconds"] == pytest.approx(3.0 + 0.25)


def test_without_restarts_a_dead_engine_leaves_rotation_and_the_other_one_serves():
    a, b = FakeEngine(0), FakeEngine(1)
    r = EngineRouter([a, b], restart=None)
    b.dead = True

    async def go():
        gate = asyncio.Event()
        a.gate = b.gate = gate
        tasks = [asyncio.create_task(r.generate([i])) for i in range(3)]  # 0, 1, 0
        await asyncio.sleep(0.01)
        gate.set()
        return await asyncio.gather(*tasks)

    outs = run(go())
    assert [o.token_ids[0] for o in outs] == [0, 0, 0]
    assert len(b.prompts) == 1
    assert r.stats()["router_resubmitted"] == 1
    a.dead = True
    with pytest.raises(RuntimeError, match="no engine is left"):
        run(r.generate([9]))


def test_a_replacement_built_while_weights_change_gets_the_newest():
    a, b = FakeEngine(0), FakeEngine(1)
    release = threading.Event()
    started = threading.Event()

    def restart(slot, update):
        started.set()
        release.wait(5)
        return FakeEngine(20, version=update.version)

    r = EngineRouter([a, b], restart=restart)
    r.update_weights(Update(1))
    t = threading.Thread(target=r._replace, args=(1, 0, "test"))
    t.start()
    assert started.wait(5)
    r.update_weights(Update(2))  # slot 1 is down: only engine 0 gets it now
    assert b.updates == [1] and a.updates == [1, 2]
    release.set()
    t.join(5)
    assert r.engines[1].name == 20 and r.engines[1].updates == [2] and r.version == 2


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="at least one engine"):
        EngineRouter([])
    with pytest.raises(ValueError, match="max_restarts"):
        EngineRouter([FakeEngine(0)], max_restarts=-1)


def test_partial_requests_are_gathered_and_scoring_is_split_over_the_engines():
    from conveyor.rollout.old_logprobs import ScoringItem

    class Scoring(FakeEngine):
        def __init__(self, name):
            super().__init__(name)
            self.scored: list[int] = []

        def partial_requests(self, *, require_pause=True):
            if self.dead:
                raise EngineDiedError("gone")
            return [f"{self.name}:a", f"{self.name}:b"]

        def score_old_logprobs(self, spec, items, version=None):
            if self.dead:
                raise EngineDiedError("gone")
            self.scored += [len(it.token_ids) for it in items]
            return [(self.name, len(it.token_ids)) for it in items], sum(len(it.token_ids) for it in items)

    a, b = Scoring(0), Scoring(1)
    r = EngineRouter([a, b])
    assert r.partial_requests() == ["0:a", "0:b", "1:a", "1:b"]
    items = [ScoringItem(prompt_ids=[1], token_ids=[2] * n, versions=[0] * n, spans=[(f"k{n}", 0, n)])
             for n in (9, 1, 5, 4)]
    patches, scored = r.score_old_logprobs(None, items, 0)
    assert scored == 19 and sorted(p[1] for p in patches) == [1, 4, 5, 9]
    # longest (prompt + tokens) first, each to the engine with fewer tokens so far:
    # 10 -> a (10, 0), 6 -> b (10, 6), 5 -> b (10, 11), 2 -> a (12, 11)
    assert a.scored == [9, 1] and b.scored == [5, 4]
    # an engine that dies at the publish: left out of the partial requests, its share scored on
    # the other one (its replacement is started in the background)
    b.dead = True
    a.scored = []
    assert r.partial_requests() == ["0:a", "0:b"]
    patches, scored = r.score_old_logprobs(None, items, 0)
    assert scored == 19 and sorted(a.scored) == [1, 4, 5, 9] and len(patches) == 4


def test_a_replacement_that_fails_is_closed_and_not_tried_again_by_the_other_requests():
    a, b = FakeEngine(0), FakeEngine(1)
    made = []

    class Broken(FakeEngine):
        def start(self):
            raise RuntimeError("no CPUs")

    def restart(slot, update):
        made.append(Broken(30))
        return made[-1]

    r = EngineRouter([a, b], restart=restart, max_restarts=5)
    r.start()

    async def go():
        gate = asyncio.Event()
        a.gate = b.gate = gate
        tasks = [asyncio.create_task(r.generate([i])) for i in range(6)]  # 3 on each engine
        await asyncio.sleep(0.01)
        b.dead = True
        gate.set()
        return await asyncio.gather(*tasks)

    outs = run(go())
    assert [o.token_ids[0] for o in outs] == [0] * 6  # engine 0 served the three that died too
    assert r.wait_for_replacements(5)
    assert len(made) == 1 and made[0].closed  # one attempt for the three requests, and closed
    st = r.stats()
    assert st["engine_restarts"] == 1 and st["router_resubmitted"] == 3
    assert st["engines"][1]["state"] == "dead"
    assert st["engines"][1].get("running", 0) == 0  # a dead engine shows nothing running


def test_waiting_requests_are_counted_by_the_router_without_asking_the_engines():
    a, b = FakeEngine(0), FakeEngine(1)
    r = EngineRouter([a, b], max_batch_size=2)

    async def go():
        gate = asyncio.Event()
        a.gate = b.gate = gate
        tasks = [asyncio.create_task(r.generate([i])) for i in range(7)]  # 4 on engine 0, 3 on engine 1
        await asyncio.sleep(0.01)
        waiting = r.waiting_requests()
        gate.set()
        await asyncio.gather(*tasks)
        return waiting

    assert run(go()) == (4 - 2) + (3 - 2)
    assert r.waiting_requests() == 0


def test_an_episodes_turn_is_recognised_by_length_and_tail_among_many_remembered():
    a, b = FakeEngine(0), FakeEngine(1)
    r = EngineRouter([a, b], affinity_slack=100)

    async def go():
        gate = asyncio.Event()
        a.gate = b.gate = gate
        # 40 episodes' first turns of different lengths, spread over both engines
        tasks = [asyncio.create_task(r.generate(list(range(1000, 1000 + 50 + k)))) for k in range(40)]
        await asyncio.sleep(0.01)
        gate.set()
        firsts = await asyncio.gather(*tasks)
        a.gate = b.gate = None
        nexts = [await r.generate(list(o.prompt_ids) + list(o.token_ids) + [7] * 20) for o in firsts]
        return firsts, nexts

    firsts, nexts = run(go())
    assert {o.token_ids[0] for o in firsts} == {0, 1}
    assert [n.token_ids[0] for n in nexts] == [o.token_ids[0] for o in firsts]  # each turn back to its engine


def test_a_weight_update_that_an_engine_never_applies_times_out():
    a = FakeEngine(0)

    class Stuck(FakeEngine):
        def update_weights(self, update, *, wait=True):
            return concurrent.futures.Future()  # never resolves

    r = EngineRouter([a, Stuck(1)], update_timeout_s=0.2)
    with pytest.raises(TimeoutError, match="version 3"):
        r.update_weights(Update(3))


def test_two_real_engines_pause_together_and_score_every_partial_request_as_one_engine_would(tiny):
    # partial_sync over two engines: the requests in flight on both are gathered at the pause
    # (keys unique across engines) and the items scored on both give the same patches as one
    # engine scoring all of them
    import copy

    from conveyor.rollout.engine import InferenceEngine, SamplingParams
    from conveyor.runtime.publish import scoring_items
    from conveyor.trainer.logprobs import ScoringSpec

    engines = [InferenceEngine(copy.deepcopy(tiny.model).eval(), tiny.tokenizer, seed=i, track_partials=True,
                               num_threads=1) for i in range(2)]
    r = EngineRouter(engines)
    r.start()
    params = SamplingParams(max_new_tokens=400, ignore_eos=True, temperature=1.0)

    async def go():
        tasks = [asyncio.create_task(r.generate([5 + i, 6, 7, 8], params)) for i in range(4)]  # 2 per engine
        while min(e.stats()["generated_tokens"] for e in engines) < 12:
            await asyncio.sleep(0.005)
        r.pause()
        try:
            partials = r.partial_requests()
            items = scoring_items(partials, [])
            spec = ScoringSpec(temperature=1.0, bf16=False, autocast_weight_cache=False, chunk_tokens=4096,
                               micro_batch_tokens=4096, pack_row_tokens=512)
            split = r.score_old_logprobs(spec, items)
            alone = engines[0].score_old_logprobs(spec, items)
        finally:
            r.stop()
        await asyncio.gather(*tasks)
        return partials, split, alone

    try:
        partials, (patches, n), (patches1, n1) = run(go())
    finally:
        r.close()
    engine_ids = {p.key.split(":")[0] for p in partials}
    assert len(engine_ids) == 2 and len({p.key for p in partials}) == len(partials) == 4
    assert n == n1 == sum(len(p.token_ids) for p in partials) > 0
    by_key = {p.key: p for p in patches1}
    assert len(patches) == len(patches1)
    for p in patches:
        q = by_key[p.key]
        assert p.start == q.start and p.version == q.version == 0
        assert p.values == pytest.approx(q.values, abs=1e-5)


def test_a_replacement_installed_while_the_router_is_paused_is_paused_too():
    a, b = FakeEngine(0), FakeEngine(1)
    release, started = threading.Event(), threading.Event()

    def restart(slot, update):
        started.set()
        release.wait(5)
        return FakeEngine(40)

    r = EngineRouter([a, b], restart=restart)
    r.start()
    t = threading.Thread(target=r._replace, args=(1, 0, "test"))
    t.start()
    assert started.wait(5)
    r.pause()  # slot 1 is down: only engine 0 is paused now
    assert a.calls[-1] == "pause" and "pause" not in b.calls
    release.set()
    t.join(5)
    assert r.engines[1].calls == ["start", "pause"]  # installed into the paused router, paused
    r.resume()
    assert r.engines[1].calls[-1] == "resume"


def test_stop_waits_for_a_replacement_still_starting_and_installs_it_stopped():
    # nothing may start an engine (a Ray actor) after the runtime stopped the router and cleaned up
    a, b = FakeEngine(0), FakeEngine(1)
    release = threading.Event()

    def restart(slot, update):
        release.wait(5)
        return FakeEngine(50)

    r = EngineRouter([a, b], restart=restart)
    r.start()
    b.dead = True
    with pytest.raises(EngineDiedError):
        run(b.generate([1]))
    r._on_death(1, 0, "test")  # as a request that died there reports it
    r._on_death(1, 0, "test")  # a second request of the same engine starts no second replacement
    assert len(r._replacing) == 1
    threading.Timer(0.2, release.set).start()
    t0 = time.monotonic()
    r.stop()
    assert time.monotonic() - t0 >= 0.15  # it waited for the replacement
    assert r.engines[1].name == 50 and r.engines[1].calls == ["start", "stop"]
    assert r.stats()["engines"][1]["state"] == "live"


def test_a_replacement_that_outlasts_the_wait_is_reported_not_waited_for_forever():
    a, b = FakeEngine(0), FakeEngine(1)
    release = threading.Event()

    def restart(slot, update):
        release.wait(5)
        return FakeEngine(60)

    r = EngineRouter([a, b], restart=restart, replace_timeout_s=0.1)
    r.start()
    r._on_death(1, 0, "test")
    assert r.wait_for_replacements() is False
    assert r.stats()["engines"][1]["state"] == "replacing"
    release.set()
    assert r.wait_for_replacements(5) is True and r.engines[1].name == 60


def test_an_engine_found_dead_after_stop_is_replaced_only_when_the_router_starts_again():
    # after stop() the caller cleans up (kills the engine actors it knows): nothing may be built then
    a, b = FakeEngine(0), FakeEngine(1)
    built = []

    def restart(slot, update):
        built.append(slot)
        return FakeEngine(70)

    r = EngineRouter([a, b], restart=restart)
    r.start()
    r.stop()
    b.dead = True
    st = r.stats()  # finds it dead
    assert st["engines"][1]["state"] == "replacing" and r.wait_for_replacements(1) and built == []
    r.start()
    assert r.wait_for_replacements(5) and built == [1] and r.engines[1].name == 70
    assert r.stats()["engines"][1]["state"] == "live"


def test_every_counter_of_a_real_engine_is_carried_over_when_an_engine_is_replaced(tiny):
    """A replaced engine's counters are added to its successor's (CUMULATIVE_ENGINE_STATS): each
    number the local engine reports is either listed there or one of the known gauges (values
    of now, not sums), so a new counter cannot silently restart from 0 after a replacement."""
    from conveyor.rollout.engine import InferenceEngine
    from conveyor.rollout.engine.router import CUMULATIVE_ENGINE_STATS

    gauges = {"num_threads", "running", "waiting", "version", "paused", "prefix_cache_tokens"}
    numbers = {k for k, v in InferenceEngine(tiny.model, tiny.tokenizer).stats().items()
               if isinstance(v, (int, float))}
    assert numbers - gauges == CUMULATIVE_ENGINE_STATS
