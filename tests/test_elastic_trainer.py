"""``trainer.elastic_threads`` (issue 16): the trainer borrows the idle engine's threads during
its update (:mod:`conveyor.runtime.elastic`) through the engine's lease
(:meth:`InferenceEngine.lend_threads` / ``return_threads``): the engine runs no forward pass
while its cores are lent, and the trainer gives them back at the next layer boundary once work
reaches the engine."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from engine_helpers import wait_until as _wait

from conveyor.rollout.engine import InferenceEngine, SamplingParams
from conveyor.rollout.engine import local as engine_local
from conveyor.runtime.elastic import TrainerThreadBorrowing


@pytest.fixture
def engine(tiny):
    eng = InferenceEngine(copy.deepcopy(tiny.model), tiny.tokenizer, max_batch_size=4, seed=0, num_threads=1)
    yield eng
    eng.stop()


SP = SamplingParams(max_new_tokens=4, temperature=1.0)


# ---------------------------------------------------------------- the engine's lease


def test_engine_lends_its_threads_only_after_idling_for_the_asked_time(engine):
    assert not engine.lend_threads()  # not started: no decode thread to hold back
    engine.start()
    assert _wait(lambda: engine.idle_seconds > 0)
    assert not engine.lend_threads(min_idle_s=60.0)  # idle, but not for a minute
    engine.pause()
    engine.submit([5, 6, 7], SP)
    assert engine.idle_seconds == 0.0 and not engine.lend_threads()  # a waiting request is work
    engine.resume()
    assert _wait(lambda: engine.idle and engine.idle_seconds > 0.05)
    assert engine.lend_threads(min_idle_s=0.05)
    assert not engine.idle  # lent: the reference scorer's gate must not take the same cores
    assert not engine.lend_threads()  # one lease at a time
    engine.return_threads()
    engine.return_threads()  # idempotent
    assert engine.idle
    st = engine.stats()
    assert st["lends"] == 1 and st["reclaims"] == 0 and st["lent_seconds"] > 0


def test_work_waits_for_lent_threads_and_asks_for_them_back(engine):
    engine.start()
    assert _wait(lambda: engine.idle_seconds > 0)
    assert engine.lend_threads()
    fut = engine.submit([5, 6, 7], SP)
    assert _wait(lambda: engine.reclaim_requested, timeout=5)
    time.sleep(0.3)
    assert not fut.done()  # no forward pass while the cores are lent
    assert engine.stats()["generated_tokens"] == 0
    engine.return_threads()
    out = fut.result(timeout=30)
    assert len(out.token_ids) == 4
    st = engine.stats()
    assert st["reclaims"] == 1 and st["reclaim_wait_seconds"] >= 0.3 and st["reclaim_timeouts"] == 0
    assert not engine.reclaim_requested


def test_a_borrower_that_never_answers_cannot_stall_the_engine(engine, monkeypatch):
    monkeypatch.setattr(engine_local, "RECLAIM_TIMEOUT_S", 0.3)
    engine.start()
    assert _wait(lambda: engine.idle_seconds > 0)
    assert engine.lend_threads()
    out = engine.submit([5, 6, 7], SP).result(timeout=30)  # runs after the timeout, still lent
    assert len(out.token_ids) == 4
    assert engine.stats()["reclaim_timeouts"] == 1
    t0 = time.perf_counter()
    engine.submit([8, 9], SP).result(timeout=30)  # no second wait during the same lease
    assert time.perf_counter() - t0 < 0.3 + 5.0 and engine.stats()["reclaim_timeouts"] == 1
    engine.return_threads()


def test_stop_does_not_wait_for_lent_threads(engine):
    engine.start()
    assert _wait(lambda: engine.idle_seconds > 0)
    assert engine.lend_threads()
    fut = engine.submit([5, 6, 7], SP)
    assert _wait(lambda: engine.reclaim_requested, timeout=5)
    t0 = time.perf_counter()
    engine.stop()
    assert time.perf_counter() - t0 < 5.0
    assert fut.result(timeout=5).finish_reason == "abort"


# ---------------------------------------------------------------- the trainer's side


class FakeEngine:
    """The lease as the borrower sees it; ``idle`` decides whether a lend is granted."""

    def __init__(self, idle: bool = True):
        self.idle = idle
        self.lent = False
        self.reclaim_requested = False
        self.lend_calls = 0
        self.returns = 0

    def lend_threads(self, min_idle_s: float = 0.0) -> bool:
        self.lend_calls += 1
        if self.idle and not self.lent:
            self.lent = True
            return True
        return False

    def return_threads(self) -> None:
        self.lent = False
        self.reclaim_requested = False
        self.returns += 1


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)]))


def _forward(model, x):
    x = model[0](x)
    for block in model[1]:
        x = torch.tanh(block(x))
    return x


def test_borrowing_happens_only_inside_the_update_and_ends_with_it():
    eng = FakeEngine()
    b = TrainerThreadBorrowing(eng, own=1, extra=1)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        b.poll()
        assert eng.lend_calls == 0  # outside the update: never asks
        with b.update() as out:
            b.poll()
            assert eng.lent and torch.get_num_threads() == 2
            seen = []
            t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
            t.start()
            t.join()
            assert seen == [1]  # the process-wide default is left alone
            time.sleep(0.02)
        assert not eng.lent and eng.returns == 1 and torch.get_num_threads() == 1
        assert out["elastic/trainer_borrows"] == 1.0 and out["time/borrowed_threads_s"] >= 0.02
        b.poll()
        assert eng.lend_calls == 1  # after the update: never asks again
    finally:
        torch.set_num_threads(before)


def test_the_cores_go_back_at_the_next_layer_boundary_once_the_engine_wants_them():
    eng = FakeEngine()
    model = _model()
    b = TrainerThreadBorrowing(eng, own=1, extra=1)
    assert b.install([model, None]) == 3  # the three blocks of the ModuleList
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    counts = []
    model[1][2].register_forward_pre_hook(lambda m, a: counts.append(("fwd", torch.get_num_threads())))
    try:
        with b.update() as out:
            x = torch.randn(4, 8, requires_grad=True)
            y = _forward(model, x)  # first block: borrowed
            assert counts == [("fwd", 2)]
            eng.idle, eng.reclaim_requested = False, True  # work reached the engine during the forward
            grads = []
            x.register_hook(lambda g: grads.append(torch.get_num_threads()))
            y.sum().backward()  # the backward's first block boundary gives them back
            assert eng.returns == 1 and not eng.lent
            assert grads == [1]  # the rest of the backward ran on the trainer's own thread
        assert out["elastic/trainer_borrows"] >= 1.0
    finally:
        torch.set_num_threads(before)


def test_hooks_check_in_the_backward_as_well_and_do_nothing_on_other_threads_or_in_copies():
    eng = FakeEngine(idle=False)  # never granted: count the checks
    model = _model()
    b = TrainerThreadBorrowing(eng, own=1, extra=1)
    b.install([model])
    twin = copy.deepcopy(model)  # e.g. an evaluation copy: the hooks come along as closures
    with b.update():
        x = torch.randn(2, 8, requires_grad=True)
        _forward(model, x).sum().backward()
        assert eng.lend_calls == 6  # 3 blocks forward + 3 in the backward
        with torch.no_grad():
            _forward(model, x)
        assert eng.lend_calls == 9  # no-grad forward: no backward checks
        t = threading.Thread(target=lambda: _forward(twin, torch.randn(2, 8)))
        t.start()
        t.join()
        assert eng.lend_calls == 9  # another thread (the engine's, an evaluation's): nothing
    b.remove()
    with b.update():
        _forward(model, torch.randn(2, 8))
    assert eng.lend_calls == 9


def test_borrowing_gives_back_on_an_error_in_the_update():
    eng = FakeEngine()
    b = TrainerThreadBorrowing(eng, own=1, extra=1)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with b.update():
                b.poll()
                raise RuntimeError("boom")
        assert not eng.lent and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_borrower_arguments_are_checked():
    with pytest.raises(ValueError, match="own=0"):
        TrainerThreadBorrowing(FakeEngine(), own=0, extra=1)


@pytest.mark.parametrize("override,named", [
    ("runtime.name=ray", "runtime.name=ray"),
    ("rollout.num_engines=2", "rollout.num_engines=2"),
    ("trainer.world_size=2", "trainer.world_size=2"),
    ("trainer.device=cuda", "trainer.device=cuda"),
])
def test_elastic_trainer_threads_refuse_what_they_cannot_serve(override, named):
    from conveyor.config import load_config

    with pytest.raises(ValueError, match=named):
        load_config(None, ["trainer.elastic_threads=true", override])


def test_a_run_with_elastic_trainer_threads_borrows_the_idle_engines_threads(tmp_path, monkeypatch):
    """The inline runtime wires it: with eta = 0 the engine idles through every update, so each
    update borrows its threads; the engine's lease counters agree with the trainer's metrics."""
    import json

    from test_train_e2e import BASE

    from conveyor.config import load_config
    from conveyor.runtime import elastic
    from conveyor.train import run_training

    monkeypatch.setattr(elastic, "MIN_IDLE_S", 0.0)
    run = tmp_path / "r"
    cfg = load_config(None, BASE + ["trainer.total_steps=4", "async.eta=0", "trainer.num_threads=1",
                                    "trainer.elastic_threads=true", f"run.dir={run}",
                                    "run.eval_before=false", "run.eval_after=false"])
    res = run_training(cfg)
    assert res.steps == 4 and not res.interrupted
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["elastic/trainer_borrows"] >= 1 for r in rows)
    assert all(r["time/borrowed_threads_s"] > 0 for r in rows)
    stats = json.loads((run / "engine_stats.json").read_text())
    assert stats["lends"] == sum(r["elastic/trainer_borrows"] for r in rows)
    assert stats["lent_seconds"] >= 0.9 * sum(r["time/borrowed_threads_s"] for r in rows)
    assert torch.get_num_threads() >= 1
