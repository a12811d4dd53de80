"""The async ratio controller and mid-run eta changes of the capacity rule (issue 13).

MISSION.md section 4 (AsyPPO's AsyncRatioController) and section 1 (AReaL's capacity rule:
``capacity(v) = max(0, min(max_concurrent - running, (eta + v + 1) * B - (accepted + running))))``.
"""

from __future__ import annotations

import json
import threading

import pytest

from conveyor.rollout.adaptive import AsyncRatioController
from conveyor.rollout.staleness import StalenessManager

# ====================================================================== AsyncRatioController


def test_issue_example_ratios():
    # step 0.1, bounds [0.1, 1.0], base 0.7: 0.2 > 0.15 -> 0.6; 0.2 -> 0.5; 0.05 <= 0.15 -> 0.6.
    # Exact: the ratio is a whole number of steps from base (-1, -2, -1), so the floats are the
    # literals themselves (0.7 - 0.1 - 0.1 in floats would be 0.49999999999999994).
    c = AsyncRatioController(base=0.7, r_min=0.1, r_max=1.0, step=0.1, threshold=0.15)
    assert c.ratio == 0.7
    assert [c.update(v) for v in (0.2, 0.2, 0.05)] == [0.6, 0.5, 0.6]
    assert c.steps == -1 and c.n_updates == 3


def test_variance_equal_to_threshold_is_not_above():
    c = AsyncRatioController()
    assert c.update(0.15) == 0.8           # not above -> away from on-policy
    assert c.events[-1]["direction"] == "async"
    assert c.update(0.15000000001) == 0.7  # just above -> toward on-policy


def test_clamped_at_bounds_no_drift():
    c = AsyncRatioController()            # base 0.7, [0.1, 1.0], step 0.1
    ratios = [c.update(0.0) for _ in range(5)]
    assert ratios == [0.8, 0.9, 1.0, 1.0, 1.0]
    assert len(c.events) == 3               # the clamped updates record nothing
    ratios = [c.update(1.0) for _ in range(11)]
    assert ratios == [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0.1]
    # 1000 oscillations: still exactly on the grid
    for _ in range(1000):
        c.update(1.0)
        c.update(0.0)
    assert c.ratio == 0.2 and c.steps == -5


def test_partial_step_at_bound():
    # base 0.75, step 0.1, bounds [0.1, 1.0]: up 0.85, 0.95, then 1.0 (a partial step), and back
    # down to 0.95 (the grid from base), never to 0.9.
    c = AsyncRatioController(base=0.75, eta_max=10)
    assert [c.update(0.0) for _ in range(4)] == [0.85, 0.95, 1.0, 1.0]
    assert c.update(1.0) == 0.95
    # down: 0.85 ... 0.15, then 0.1 (partial), eta floor(0.15 * 10) = 1, floor(0.1 * 10) = 1
    for _ in range(8):
        c.update(1.0)
    assert c.ratio == 0.15 and c.eta() == 1
    assert c.update(1.0) == 0.1 and c.eta() == 1


def test_eta_mapping_floor_ratio_times_eta_max():
    # eta_max 4: ratio 0.7 -> floor(2.8) = 2; 0.8 -> floor(3.2) = 3; 1.0 -> 4; 0.5 -> 2;
    # 0.2 -> floor(0.8) = 0; 0.1 -> 0
    c = AsyncRatioController(eta_max=4)
    assert c.eta() == 2
    c.update(0.0)
    assert c.eta() == 3
    c.update(0.0)
    c.update(0.0)
    assert (c.ratio, c.eta()) == (1.0, 4)
    c = AsyncRatioController(eta_max=4)
    c.update(1.0)
    c.update(1.0)
    assert (c.ratio, c.eta()) == (0.5, 2)
    for _ in range(3):
        c.update(1.0)
    assert (c.ratio, c.eta()) == (0.2, 0)
    # exactness, eta_max 10: 0.7 -> 7, 0.8 -> 8, 0.9 -> 9, 1.0 -> 10. Float accumulation would
    # reach 0.8 as 0.7 + 0.1 = 0.7999999999999999 (x 10 = 7.999999999999999, floor 7) and 1.0 as
    # 0.9999999999999999 (floor 9).
    assert 0.7 + 0.1 < 0.8 and (0.7 + 0.1 + 0.1 + 0.1) * 10 < 10
    c = AsyncRatioController(eta_max=10)
    assert c.eta() == 7
    assert [(c.update(0.0), c.eta()) for _ in range(3)] == [(0.8, 8), (0.9, 9), (1.0, 10)]
    # the product itself is exact too: 0.7 * 90 = 62.99999999999999 in floats; exactly 63
    assert 0.7 * 90 < 63
    assert AsyncRatioController(eta_max=90).eta() == 63
    assert AsyncRatioController(base=0.29, eta_max=100).eta() == 29     # 0.29 * 100 -> 28.99..


def test_events_record_every_change_with_reason():
    c = AsyncRatioController(eta_max=4)
    c.update(0.2)     # 0.7 -> 0.6, eta 2 -> 2
    c.update(0.0)     # 0.6 -> 0.7
    c.update(0.0)     # 0.7 -> 0.8, eta 2 -> 3
    ev = c.events
    assert [(e["old_ratio"], e["new_ratio"]) for e in ev] == [(0.7, 0.6), (0.6, 0.7), (0.7, 0.8)]
    assert [(e["old_eta"], e["new_eta"]) for e in ev] == [(2, 2), (2, 2), (2, 3)]
    assert ev[0] == {
        "update": 1, "old_ratio": 0.7, "new_ratio": 0.6, "old_eta": 2, "new_eta": 2,
        "direction": "on_policy", "reward_variance": 0.2, "threshold": 0.15,
        "reason": "reward variance 0.2 > threshold 0.15: one step toward on-policy",
    }
    assert ev[2]["reason"] == "reward variance 0 <= threshold 0.15: one step toward more asynchrony"
    ev[0]["new_ratio"] = 99                 # a copy
    assert c.events[0]["new_ratio"] == 0.6


def test_state_dict_round_trip_and_json():
    c = AsyncRatioController(eta_max=8)
    for v in (0.2, 0.2, 0.05, 0.3):
        c.update(v)
    state = json.loads(json.dumps(c.state_dict()))
    assert state["steps"] == -2 and state["ratio"] == 0.5 and state["eta"] == 4
    d = AsyncRatioController(eta_max=8)
    d.load_state_dict(state)
    assert (d.ratio, d.eta(), d.n_updates, d.events) == (0.5, 4, 4, c.events)
    assert d.update(0.0) == 0.6
    # eta_max and threshold may change on resume; the grid may not
    e = AsyncRatioController(eta_max=2, threshold=0.1)
    e.load_state_dict(state)
    assert (e.ratio, e.eta()) == (0.5, 1)
    with pytest.raises(ValueError, match="step"):
        AsyncRatioController(step=0.05).load_state_dict(state)
    bad = dict(state, steps=4)              # base 0.7 + 4 * 0.1 > r_max: out of range [-6, 3]
    with pytest.raises(ValueError, match="steps"):
        d.load_state_dict(bad)
    with pytest.raises(KeyError, match="n_updates"):
        d.load_state_dict({k: v for k, v in state.items() if k != "n_updates"})


@pytest.mark.parametrize("kwargs, name", [
    ({"base": 0.05}, "base"), ({"base": 1.1}, "r_max"), ({"r_min": -0.1}, "r_min"),
    ({"r_max": 1.5}, "r_max"), ({"step": 0.0}, "step"), ({"threshold": -1}, "threshold"),
    ({"eta_max": -1}, "eta_max"), ({"eta_max": 2.0}, "eta_max"), ({"base": float("nan")}, "base"),
    ({"step": True}, "step"),
])
def test_invalid_configuration_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AsyncRatioController(**kwargs)


@pytest.mark.parametrize("variance", [-0.1, float("nan"), float("inf"), "0.2", None])
def test_invalid_variance_changes_nothing(variance):
    c = AsyncRatioController()
    with pytest.raises(ValueError, match="reward_variance"):
        c.update(variance)
    assert (c.ratio, c.n_updates, c.events) == (0.7, 0, [])


# ====================================================================== StalenessManager.set_eta


def test_lowering_eta_admits_nothing_beyond_the_new_bound():
    # B = 4, eta 3, v = 0: capacity (3 + 0 + 1) * 4 = 16; start 16, accept 8 -> 8 running.
    m = StalenessManager(batch_size=4, eta=3, max_concurrent=100)
    assert m.capacity(0) == 16
    m.on_start(16)
    m.on_accept(8)
    m.set_eta(1)
    assert m.eta == 1
    # v = 0: (1 + 0 + 1) * 4 = 8 < accepted + running = 16 -> 0 (clamped, not -8)
    assert m.capacity(0) == 0
    # v = 1: (1 + 1 + 1) * 4 = 12 < 16 -> 0; v = 2: 16 - 16 = 0; v = 3: 20 - 16 = 4
    assert [m.capacity(v) for v in (1, 2, 3)] == [0, 0, 4]
    # rejections free slots: 16 - 4 = 12 at v = 1 -> 12 - 12 = 0; at v = 2: 16 - 12 = 4
    m.on_reject(4)
    assert (m.capacity(1), m.capacity(2)) == (0, 4)
    # eta 0 (synchronous): v = 2 -> 12 - 12 = 0, v = 3 -> 16 - 12 = 4
    m.set_eta(0)
    assert (m.capacity(2), m.capacity(3)) == (0, 4)


def test_lowering_eta_never_exceeds_bound_in_a_simulated_run():
    # Admit greedily every step; eta drops 4 -> 1 at version 3. After the change, every NEW
    # admission keeps accepted + running <= (eta + v + 1) * B at the version it happened.
    B = 2
    m = StalenessManager(batch_size=B, eta=4, max_concurrent=1000)
    for v in range(10):
        if v == 3:
            m.set_eta(1)
        cap = m.capacity(v)
        if cap:
            m.on_start(cap)
            if v >= 3:
                assert m.accepted + m.running <= (m.eta + v + 1) * B
        m.on_accept(min(B, m.running))      # the trainer consumes one batch per version
    # v=0: (4 + 0 + 1) * 2 = 10, start 10 (then acc 2, run 8); v=1, 2: start 2 each (total 14 =
    # (4 + 2 + 1) * 2). v=3, eta 1: (1 + 3 + 1) * 2 = 10 < 14 -> 0; v=4: 12 -> 0; v=5: 14 -> 0;
    # v=6: 16 - 14 = 2; then 2 per version (v = 7, 8, 9).
    assert m.started == 10 + 2 + 2 + 0 + 0 + 0 + 2 + 2 + 2 + 2


def test_raising_eta_releases_capacity_at_once():
    m = StalenessManager(batch_size=4, eta=1, max_concurrent=100)
    m.on_start(8)                           # (1 + 0 + 1) * 4 = 8
    assert m.capacity(0) == 0
    m.set_eta(3)
    assert m.capacity(0) == 8               # (3 + 0 + 1) * 4 - 8
    m.set_eta(10)
    assert m.capacity(0) == 36              # 44 - 8; max_concurrent 100 - 8 = 92 does not bind


def test_eta_none_transitions():
    m = StalenessManager(batch_size=4, eta=1, max_concurrent=20)
    m.on_start(8)
    assert m.capacity(0) == 0
    m.set_eta(None)                         # unbounded: only max_concurrent: 20 - 8 = 12
    assert m.eta is None and m.capacity(0) == 12
    m.on_start(12)
    m.on_accept(20)
    m.set_eta(2)                            # bound applies to what was admitted meanwhile:
    assert m.capacity(0) == 0               # (2 + 0 + 1) * 4 = 12 < 20
    assert m.capacity(2) == 0               # 20 - 20
    assert m.capacity(3) == 4               # 24 - 20
    assert m.state_dict()["eta"] == 2


@pytest.mark.parametrize("eta", [-1, 1.0, True, "2"])
def test_set_eta_rejects_bad_values_and_changes_nothing(eta):
    m = StalenessManager(batch_size=4, eta=2, max_concurrent=100)
    with pytest.raises(ValueError, match="eta"):
        m.set_eta(eta)
    assert m.eta == 2 and m.capacity(0) == 12


def test_set_eta_thread_safe_with_concurrent_capacity():
    # One thread flips eta between 0 and 5 while another reads capacity: every reading is one
    # of the two exact values (v = 0, nothing admitted: 1 * 2 = 2 or 6 * 2 = 12).
    m = StalenessManager(batch_size=2, eta=0, max_concurrent=100)
    stop = threading.Event()
    seen: set[int] = set()

    def flip():
        i = 0
        while not stop.is_set():
            m.set_eta(5 if i % 2 else 0)
            i += 1

    t = threading.Thread(target=flip)
    t.start()
    try:
        for _ in range(2000):
            seen.add(m.capacity(0))
    finally:
        stop.set()
        t.join()
    assert seen <= {2, 12}


def test_controller_drives_manager():
    # The intended wiring: eta from the controller after each update.
    c = AsyncRatioController(eta_max=4)     # eta 2
    m = StalenessManager(batch_size=2, eta=c.eta(), max_concurrent=100)
    assert m.capacity(0) == 6               # (2 + 0 + 1) * 2
    for _ in range(6):
        c.update(0.5)                       # 0.7 -> 0.1 over 6 steps, eta floor(0.4) = 0
    m.set_eta(c.eta())
    assert (c.ratio, m.eta, m.capacity(0)) == (0.1, 0, 2)


def _group(version, gid, n=1):
    from conveyor.types import Sample, Trajectory
    return [Trajectory(sample=Sample(gid, "q", "1", "t"), group_id=f"{gid}#{i}", prompt_ids=[1], response_ids=[2],
                       behaviour_logprobs=[0.0], versions=[version]) for i in range(n)]


def test_buffer_judges_each_group_by_the_bound_it_was_admitted_under():
    """TrajectoryBuffer.set_eta: a lowered bound applies to the groups admitted after it only; a
    group put under a higher bound keeps it (asyppo.md: judging it by the lowered one threw a
    batch away at every decrease); raising the bound applies to every group at once; None
    (unbounded) never drops; a bad value names the field."""
    from conveyor.rollout.buffer import TrajectoryBuffer

    buf = TrajectoryBuffer(eta=4)
    for v in (0, 1, 2, 3):
        buf.put(_group(v, f"g{v}"))          # admitted under eta 4 (the bound in force)
    assert buf.drop_stale(4) == 0            # ages 0..3 >= 4 - 4
    buf.set_eta(1)
    assert buf.eta == 1
    buf.put(_group(2, "late"))               # admitted under eta 1: age 2 < 4 - 1
    buf.put(_group(2, "explicit"), eta=3)    # admitted under eta 3 (an episode in flight at the change)
    assert buf.drop_stale(4) == 1            # only "late": the others keep their bounds (4, 3)
    assert [r["group"] for r in buf.take_dropped()] == ["late#0"]
    assert buf.drop_stale(5) == 1            # g0: 0 < 5 - 4 (explicit: 2 >= 5 - 3, kept)
    assert buf.drop_stale(6) == 2            # g1: 1 < 6 - 4; explicit: 2 < 6 - 3
    assert sorted(r["group"] for r in buf.take_dropped()) == ["explicit#0", "g0#0", "g1#0"]
    buf.set_eta(6)                           # raising: every group at once (g2: 2 >= 8 - 6)
    assert buf.drop_stale(8) == 0 and buf.size() == 2
    buf.put(_group(0, "unbounded"), eta=None)  # admitted while unbounded: never stale
    assert buf.widest_bound() is None
    assert buf.drop_stale(100) == 2 and [g[0].group_id for g in buf.snapshot()] == ["unbounded#0"]
    buf.set_eta(None)
    buf.put(_group(0, "old"))
    assert buf.drop_stale(1000) == 0
    with pytest.raises(ValueError, match="eta"):
        buf.set_eta(-1)
    with pytest.raises(ValueError, match="eta"):
        buf.put(_group(0, "bad"), eta=-2)


def test_buffer_widest_bound_and_snapshot_with_bounds():
    """The widest bound a buffered group is judged by (old-log-prob patches live that long), and
    each group's admission bound in the snapshot, to put back on a resume."""
    from conveyor.rollout.buffer import TrajectoryBuffer

    buf = TrajectoryBuffer(eta=2)
    assert buf.widest_bound() == 2           # empty: the bound in force
    buf.put(_group(0, "a"), eta=4)
    buf.put(_group(1, "b"))
    assert buf.widest_bound() == 4
    buf.set_eta(5)
    assert buf.widest_bound() == 5
    pairs = buf.snapshot_with_bounds()
    assert [(g[0].group_id, eta) for g, eta in pairs] == [("a#0", 4), ("b#0", 2)]
    again = TrajectoryBuffer(eta=1)
    for g, eta in pairs:
        again.put(g, eta=eta)
    assert again.drop_stale(4) == 1          # b: 1 < 4 - 2; a: 0 >= 4 - 4 kept
    assert again.snapshot()[0][0].group_id == "a#0"


def test_buffer_waits_for_expiring_groups_by_their_own_bound():
    """get_batch's wait for expiring groups counts a buffered group as expiring at the version
    where its own bound (admission or in force, the larger) ends, not where the lowered one does."""
    from conveyor.rollout.buffer import TrajectoryBuffer

    buf = TrajectoryBuffer(eta=1)
    buf.put(_group(0, "a", 2), eta=3)        # expires after the batch at v 3 (0 = 3 - 3)
    buf.put(_group(2, "b", 2))               # bound 1: expires after the batch at v 3 (2 = 3 - 1)
    # v 3, 2 expiring in flight: a (2) + b (2) + 2 > 4: waiting cannot save them all: batch forms
    assert buf.get_batch(4, 3, pending_expiring=2) is not None
    buf.put(_group(1, "a", 2), eta=3)        # expires at v 4
    buf.put(_group(3, "b", 2))               # expires at v 4 too (3 = 4 - 1)
    buf.put(_group(3, "c", 2), eta=3)        # expires at v 6 only
    # v 4: a + b = 4 expiring; with 2 more in flight they cannot all fit: no wait
    assert buf.get_batch(4, 4, pending_expiring=2) is not None
    assert [g[0].group_id for g in buf.snapshot()] == ["c#0"]
    assert buf.get_batch(4, 4, pending_expiring=2) is None  # c is not expiring; 2 in flight fit: but only 2 buffered
    buf.put(_group(4, "d", 2))
    assert buf.last_held_back is False
    # v 4 with c (expires v 6) and d (expires v 5): nothing expiring buffered, 2 pending fit: wait
    assert buf.get_batch(4, 4, pending_expiring=2) is None and buf.last_held_back is True


def test_buffer_hands_out_the_earliest_deadline_first():
    """asyppo.md, the fixed adaptive run: with eta raised 2 -> 3 and lowered again, a group
    admitted under eta 2 waited behind same-age groups admitted under eta 3 (oldest first) and was
    dropped. Earliest deadline first (age + bound) takes it before them; with one bound the order
    is oldest first, as before."""
    from conveyor.rollout.buffer import TrajectoryBuffer

    buf = TrajectoryBuffer(eta=2)
    buf.put(_group(1, "wide1"), eta=3)       # deadline 4
    buf.put(_group(1, "wide2"), eta=3)       # deadline 4
    buf.put(_group(1, "narrow"), eta=2)      # deadline 3: inserted last, taken first
    buf.put(_group(0, "old"), eta=3)         # deadline 3, older: first of all
    assert [t.group_id for t in buf.get_batch(2, 3)] == ["old#0", "narrow#0"]
    assert buf.drop_stale(4) == 0            # the wide groups are still within their bound at 4
    assert [t.group_id for t in buf.get_batch(2, 4)] == ["wide1#0", "wide2#0"]
    one = TrajectoryBuffer(eta=2)            # one bound: oldest first, then insertion order
    for v, gid in ((3, "c"), (1, "a"), (2, "b"), (1, "a2")):
        one.put(_group(v, gid))
    assert [t.group_id for t in one.get_batch(4, 3)] == ["a#0", "a2#0", "b#0", "c#0"]
    unbounded = TrajectoryBuffer(eta=2)      # an unbounded group has no deadline: last
    unbounded.put(_group(0, "free"), eta=None)
    unbounded.put(_group(1, "bounded"))
    assert [t.group_id for t in unbounded.get_batch(1, 2)] == ["bounded#0"]
