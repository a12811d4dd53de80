"""Proximal ("old logits") strategies (issue 4): exactness at eta = 0, snapshot vs an oracle
recompute for multi-version trajectories, eviction, EWMA bias correction / adaptive decay /
reset, interpolation, the auto choice and the cost ledger."""

from __future__ import annotations

import copy

import pytest
import torch

from conveyor.config import LossConfig, ProximalConfig, TrainerConfig
from conveyor.sync import WeightUpdate
from conveyor.trainer.batch import pack
from conveyor.trainer.corrections import interpolated_proximal, interpolation_alpha
from conveyor.trainer.proximal import EWMA, choose_auto, param_bytes
from conveyor.trainer.trainer import Trainer, compute_advantages
from tests.test_trainer import make_trajs, reference_logprobs


def _trainer(tiny, method, eta=2, **kw):
    model = copy.deepcopy(tiny.model)
    return Trainer(model, TrainerConfig(lr=1e-3, warmup_steps=0, bf16=False), LossConfig(**kw.pop("loss", {})),
                   proximal_cfg=ProximalConfig(method=method, **kw), eta=eta)


def _mb(trajs):
    return pack(trajs, compute_advantages(trajs, "grpo"), [list(range(len(trajs)))])


def _current(tr, mb):
    with torch.no_grad():
        lp, _ = tr._logprobs(tr.model, mb)
    return lp


@pytest.mark.parametrize("method", ["recompute", "snapshot", "auto"])
def test_eta0_exact_methods_return_recompute_logprobs(tiny, method):
    tr = _trainer(tiny, method, eta=0)
    mb = _mb(make_trajs(6, version=0))
    got = tr.proximal.old_logprobs(tr, mb)
    if got is None:  # recompute / auto(recompute): the gradient pass's detached log-probs
        got = tr.proximal.from_forward(_current(tr, mb), mb, tr.version)
    assert torch.equal(got * mb.mask, _current(tr, mb) * mb.mask)


def test_snapshot_equals_oracle_for_multi_version_trajectories(tiny):
    tr = _trainer(tiny, "snapshot", eta=3)
    params = {0: WeightUpdate.from_model(tr.model, 0)}
    for v in range(1, 4):  # three real updates: versions 1, 2, 3
        tr.train_step(make_trajs(4, seed=v, version=v - 1))
        params[v] = WeightUpdate.from_model(tr.model, v)
    assert tr.version == 3 and sorted(tr.proximal.snapshots) == [0, 1, 2, 3]
    trajs = make_trajs(4, seed=9)
    for t in trajs:  # every trajectory spans versions: token k was sampled by version k % 4
        t.versions = [k % 4 for k in range(len(t.response_ids))]
    mb = _mb(trajs)
    got = tr.proximal.old_logprobs(tr, mb)
    oracle = torch.zeros_like(got)
    model = copy.deepcopy(tr.model)
    for u, upd in params.items():
        model.load_state_dict({**upd.tensors, **{a: upd.tensors[s] for a, s in upd.aliases.items()}})
        with torch.no_grad():
            lp, _ = tr._logprobs(model, mb)
        oracle = torch.where(mb.versions == u, lp, oracle)
    m = mb.mask > 0
    assert torch.allclose(got[m], oracle[m], atol=1e-6)
    # the versions really differ (so the test would catch using one set of weights for all)
    assert not torch.allclose(got[m], _current(tr, mb)[m], atol=1e-4)


def test_snapshot_eviction_never_exceeds_eta_plus_one(tiny):
    tr = _trainer(tiny, "snapshot", eta=1)
    one = param_bytes(tr.model)
    for v in range(4):
        m = tr.train_step(make_trajs(4, seed=v, version=v))
        assert len(tr.proximal.snapshots) <= 2
        assert m["proximal/snapshots"] <= 2
        assert m["proximal/extra_bytes"] == pytest.approx(one * (len(tr.proximal.snapshots) + 1))
    assert sorted(tr.proximal.snapshots) == [3, 4]


def test_snapshot_missing_version_falls_back_and_is_counted(tiny):
    tr = _trainer(tiny, "snapshot", eta=4)
    trajs = make_trajs(4, version=0)
    for t in trajs:
        t.versions = [0] * len(t.response_ids)
    tr.proximal.snapshots.clear()  # e.g. right after a resume
    tr.version = 1
    m = tr.train_step(trajs)
    assert m["proximal/snapshot_missing_frac"] == 1.0


def test_behavior_and_interpolate(tiny):
    tr = _trainer(tiny, "behavior")
    mb = _mb(make_trajs(4))
    assert torch.equal(tr.proximal.old_logprobs(tr, mb), mb.behaviour_logprobs)
    tr = _trainer(tiny, "interpolate", interpolation="linear")
    trajs = make_trajs(4)
    for t in trajs:
        t.versions = [0] * len(t.response_ids)
    mb = _mb(trajs)
    tr.version = 2
    theta = _current(tr, mb)
    expect = interpolated_proximal(theta, mb.behaviour_logprobs, interpolation_alpha(mb.versions, 2), mb.mask, kind="linear")
    assert tr.proximal.old_logprobs(tr, mb) is None
    assert torch.equal(tr.proximal.from_forward(theta, mb, 2), expect)


def test_ewma_bias_correction_and_adaptive_decay():
    lin = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    e = EWMA(lin, beta=0.5)
    with torch.no_grad():
        lin.weight.fill_(3.0)
    e.update(lin, window=1)
    # W1 = 0.5 * 1 + 1 = 1.5; ewma = (0.5 * 1 / 1.5) * 1 + 3 / 1.5 = 1/3 + 2 = 2.333...
    assert e.W == pytest.approx(1.5)
    assert e.model.weight.item() == pytest.approx(1 / 3 + 2)
    with torch.no_grad():
        lin.weight.fill_(5.0)
    e.update(lin, window=1)
    # W2 = 0.5 * 1.5 + 1 = 1.75; ewma = (0.75 / 1.75) * 2.333 + 5 / 1.75
    assert e.model.weight.item() == pytest.approx((0.75 / 1.75) * (7 / 3) + 5 / 1.75)
    # the bias-corrected weights sum to one: a constant parameter stays constant
    e2 = EWMA(lin, beta=0.9)
    for _ in range(5):
        e2.update(lin, window=1)
    assert e2.model.weight.item() == pytest.approx(5.0)
    ad = EWMA(lin)  # adaptive: beta = W / (W + 2)
    assert ad.current_beta(2) == pytest.approx(0.5) and ad.current_beta(4) == pytest.approx(4 / 6)
    assert ad.current_beta(4) / (1 - ad.current_beta(4)) == pytest.approx(4 / 2)  # centre of mass W / 2


def test_ewma_resets_on_low_keep_rate_and_logs_event(tiny):
    tr = _trainer(tiny, "ewma", eta=2, ewma_reset_keep_rate=0.95)
    trajs = make_trajs(4)  # behaviour log-probs are -5: far from the model's -> keep-rate ~0
    m = tr.train_step(trajs)
    assert m["proximal/ewma_keep_rate"] < 0.95
    assert tr.events and tr.events[0]["event"] == "ewma_reset" and m["proximal/ewma_resets"] == 1
    assert tr.proximal.W == 1.0
    for a, b in zip(tr.proximal.model.parameters(), tr.model.parameters(), strict=True):
        assert torch.equal(a, b)
    # a high keep-rate (behaviour log-probs equal to the EWMA's) averages instead of resetting
    mb = _mb(trajs)
    with torch.no_grad():
        lp, _ = tr._logprobs(tr.proximal.model, mb)
    for t in trajs:
        t.behaviour_logprobs = [0.0] * len(t.response_ids)
    tr.events.clear()
    ew = tr.proximal
    ew._kept, ew._counted = 99, 100
    st = ew.after_update(tr.model, tr.version, {"staleness/max": 1.0})
    assert not st.events and ew.W == pytest.approx(0.5 * 1.0 + 1.0)  # W=2 window -> beta 0.5


def test_ewma_state_survives_checkpoint(tiny):
    tr = _trainer(tiny, "ewma", eta=2, ewma_reset_keep_rate=0.0)
    tr.train_step(make_trajs(4))
    state = tr.state_dict()
    tr2 = _trainer(tiny, "ewma", eta=2, ewma_reset_keep_rate=0.0)
    tr2.load_state_dict(state)
    assert tr2.proximal.W == tr.proximal.W
    for a, b in zip(tr2.proximal.model.parameters(), tr.proximal.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_auto_choice(tiny):
    one = param_bytes(tiny.model)
    assert choose_auto(tiny.model, 0, 0)[0] == "recompute"
    assert choose_auto(tiny.model, 2, 4 * one)[0] == "snapshot"
    m, why = choose_auto(tiny.model, 2, 3 * one)
    assert m == "ewma" and "budget" in why
    assert choose_auto(tiny.model, None, 10**12)[0] == "ewma"
    tr = _trainer(tiny, "auto", eta=2, memory_budget_bytes=1)
    assert tr.proximal.name == "ewma" and "budget" in tr.proximal_note


@pytest.mark.parametrize("method", ["recompute", "behavior", "snapshot", "interpolate", "ewma"])
@pytest.mark.parametrize("loss", ["decoupled_ppo", "two_ratio"])
def test_every_method_trains_with_every_proximal_loss(tiny, method, loss):
    tr = _trainer(tiny, method, eta=2, loss={"name": loss, "correction": "tis_token" if loss == "decoupled_ppo" else None})
    before = [p.detach().clone() for p in tr.model.parameters()]
    trajs = make_trajs(8, version=0)
    for t in trajs:  # behaviour log-probs of the same weights (as an engine would record them)
        t.behaviour_logprobs = reference_logprobs(tr.model, t).tolist()
    m = tr.train_step(trajs)
    assert tr.version == 1 and m["train/skipped_nonfinite"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters(), strict=True))
    assert m["proximal/extra_bytes"] >= 0 and m["time/proximal_s"] >= 0
    assert "mismatch/k3_mean" in m
    if loss == "two_ratio" and method != "behavior":
        assert m["loss/discrepancy_keep_frac"] > 0.9  # same weights: rho_d ~ 1


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"])
def test_aggregation_modes_are_micro_batch_invariant(tiny, agg):
    trajs = make_trajs(8)
    grads = []
    for budget in (4096, 24):  # one micro-batch vs several
        model = copy.deepcopy(tiny.model)
        tr = Trainer(model, TrainerConfig(lr=1e-3, warmup_steps=0, bf16=False, micro_batch_tokens=budget, pack_row_tokens=24),
                     LossConfig(name="dis", aggregation=agg, aggregation_constant=16.0))
        tr.train_step(trajs)
        grads.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
