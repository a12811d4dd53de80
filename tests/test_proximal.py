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
    assert [e["event"] for e in tr.take_events()] == ["ewma_reset"] and tr.take_events() == []
    ew = tr.proximal
    ew.on_optimizer_step(tr.model, window=2)  # a window 2 optimiser steps wide -> beta 0.5
    ew._kept, ew._counted = 99, 100
    st = ew.after_update(tr.model, tr.version, {"staleness/max": 2.0})
    assert not st.events and ew.W == pytest.approx(0.5 * 1.0 + 1.0)
    assert st.values["proximal/ewma_beta"] == pytest.approx(0.5) and ew.resets == 1


def test_ewma_fixed_window_hand_computed_over_optimiser_steps():
    """Window w = 3 optimiser steps: beta = 3 / 5 for every step, bias-corrected (MISSION.md
    section 2). Parameters 1 (initial), then 3, 5, 4 after three optimiser steps."""
    lin = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    e = EWMA(lin)
    assert e.current_beta(3) == pytest.approx(0.6)
    # (W_t, ewma): W_t = 0.6 W_{t-1} + 1; ewma = (0.6 W_{t-1} / W_t) ewma + theta / W_t
    expected = [
        (1.6, 0.375 * 1.0 + 3.0 / 1.6),                       # 2.25
        (1.96, (0.96 / 1.96) * 2.25 + 5.0 / 1.96),            # 3.653061...
        (2.176, (4 + 0.6 * 5 + 0.36 * 3 + 0.216 * 1) / 2.176),  # weights 1, .6, .36, .216: 3.8125
    ]
    for theta, (w, value) in zip((3.0, 5.0, 4.0), expected, strict=True):
        with torch.no_grad():
            lin.weight.fill_(theta)
        e.on_optimizer_step(lin, window=3)
        assert e.W == pytest.approx(w) and e.model.weight.item() == pytest.approx(value, rel=1e-6)
    assert e.model.weight.item() == pytest.approx(3.8125, rel=1e-6) and e.updates == 3
    with pytest.raises(ValueError, match="window"):
        e.current_beta(-1)


def test_ewma_synchronous_run_averages_nothing(tiny):
    """eta = 0: every batch is of the trainer's own version (window 0, beta 0), so after every
    optimiser step the EWMA is exactly the current parameters and the proximal log-probs equal
    recompute's."""
    tr = _trainer(tiny, "ewma", eta=0, ewma_reset_keep_rate=0.0)
    for step in range(3):
        m = tr.train_step(make_trajs(4, seed=step, version=tr.version))
        assert m["proximal/ewma_beta"] == 0.0 and m["proximal/ewma_window"] == 0.0
        assert tr.proximal.W == 1.0
        ewma, cur = tr.proximal.model.state_dict(), tr.model.state_dict()
        assert all(torch.equal(ewma[k], cur[k]) for k in cur)
    mb = _mb(make_trajs(4, seed=9, version=tr.version))
    assert torch.equal(tr.proximal.old_logprobs(tr, mb) * mb.mask, _current(tr, mb) * mb.mask)


def test_ewma_updates_after_every_optimiser_step(tiny):
    """Three optimiser steps per update (trainer.minibatches = 3) on a batch one version stale:
    three EWMA steps, each with the window 1 version x 3 steps = 3 (beta = 0.6), on the
    parameters after each optimiser step."""
    model = copy.deepcopy(tiny.model)
    tc = TrainerConfig(lr=1e-3, warmup_steps=0, bf16=False, minibatches=3, micro_batch_tokens=24,
                       pack_row_tokens=24)
    pc = ProximalConfig(method="ewma", ewma_reset_keep_rate=0.0)
    tr = Trainer(model, tc, LossConfig(), proximal_cfg=pc, eta=2, version=1)
    seen = [{k: v.clone() for k, v in model.state_dict().items()}]
    orig_step = tr.optimizer.step

    def step(*a, **k):
        out = orig_step(*a, **k)
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
        return out

    tr.optimizer.step = step
    m = tr.train_step(make_trajs(8, version=0))
    assert len(seen) == 4 and m["proximal/ewma_updates"] == 3.0 and tr.proximal.updates == 3
    assert m["proximal/ewma_window"] == 3.0 and m["proximal/ewma_beta"] == pytest.approx(0.6)
    weights = [0.6 ** (3 - i) for i in range(4)]  # theta_0 .. theta_3: .216, .36, .6, 1
    assert tr.proximal.W == pytest.approx(sum(weights))
    for k, got in tr.proximal.model.state_dict().items():
        if got.is_floating_point():
            want = sum(w * s[k] for w, s in zip(weights, seen, strict=True)) / sum(weights)
            assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), k


def test_ewma_state_survives_checkpoint(tiny):
    tr = _trainer(tiny, "ewma", eta=2, ewma_reset_keep_rate=0.0)
    tr.train_step(make_trajs(4))
    state = tr.state_dict()
    tr2 = _trainer(tiny, "ewma", eta=2, ewma_reset_keep_rate=0.0)
    tr2.load_state_dict(state)
    assert tr2.proximal.W == tr.proximal.W and tr2.proximal.updates == tr.proximal.updates == 1
    for a, b in zip(tr2.proximal.model.parameters(), tr.proximal.model.parameters(), strict=True):
        assert torch.equal(a, b)
    # a checkpoint written before issue 10 (format 1: W, resets, params) still loads
    old = {k: v for k, v in state["proximal"].items() if k in ("W", "resets", "params")}
    tr3 = _trainer(tiny, "ewma", eta=2)
    tr3.proximal.load_state_dict(old)
    assert tr3.proximal.W == tr.proximal.W and tr3.proximal.updates == 0
    assert all(torch.equal(a, b) for a, b in
               zip(tr3.proximal.model.parameters(), tr.proximal.model.parameters(), strict=True))
    with pytest.raises(ValueError, match="format 3"):
        tr3.proximal.load_state_dict({**state["proximal"], "format": 3})


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


def _token_logprobs_full(model, traj):
    """Log-probs of ``traj``'s response tokens from one plain full-softmax forward (with grad)."""
    ids = torch.tensor([traj.prompt_ids + traj.response_ids])
    lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    P = len(traj.prompt_ids)
    return lp[torch.arange(P - 1, P - 1 + len(traj.response_ids)), torch.tensor(traj.response_ids)]


@pytest.mark.parametrize("agg",
                         ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"])
def test_kl_penalty_is_aggregated_like_the_loss_across_micro_batches(tiny, agg):
    """The KL-to-reference term is aggregated with the policy loss's mode (verl
    ``verl/workers/utils/losses.py::ppo_loss``: ``agg_loss`` on the k3 matrix): with zero advantages
    the trainer's gradient equals the autograd gradient of ``kl_coef * agg(k3)`` from independent
    full-softmax forwards, with one micro-batch and with several; ``train/kl_ref`` stays the plain
    per-token mean of k3."""
    trajs = make_trajs(8)  # responses of 3..9 tokens: the modes differ
    for t in trajs:
        t.reward = 1.0  # all-equal groups: advantages 0, only the KL term has a gradient
    ref = copy.deepcopy(tiny.model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    kl_coef, constant = 0.5, 16.0
    model = copy.deepcopy(tiny.model)
    k3 = []
    for t in trajs:
        lp = _token_logprobs_full(model, t)
        with torch.no_grad():
            log_r = _token_logprobs_full(ref, t) - lp.detach()
        log_r = log_r + lp.detach() - lp  # log pi_ref - log pi_theta, gradient through lp
        k3.append(torch.exp(log_r) - 1.0 - log_r)
    n_tok = sum(len(k) for k in k3)
    objective = {
        "token_mean": sum(k.sum() for k in k3) / n_tok,
        "seq_mean_token_mean": sum(k.mean() for k in k3) / len(k3),
        "seq_mean_token_sum": sum(k.sum() for k in k3) / len(k3),
        "constant": sum(k.sum() for k in k3) / (len(k3) * constant),
    }[agg]
    (kl_coef * objective).backward()
    expected = torch.cat([p.grad.flatten() for p in model.parameters()])
    kl_ref = float(sum(k.sum() for k in k3)) / n_tok
    for budget in (4096, 24):  # one micro-batch vs several
        model = copy.deepcopy(tiny.model)
        tc = TrainerConfig(lr=1e-3, warmup_steps=0, bf16=False, grad_clip=None,
                           micro_batch_tokens=budget, pack_row_tokens=24)
        tr = Trainer(model, tc,
                     LossConfig(aggregation=agg, aggregation_constant=constant, kl_coef=kl_coef))
        tr.ref_model.load_state_dict(ref.state_dict())
        captured = {}
        orig_step = tr.optimizer.step

        def step(*a, _orig=orig_step, _m=model, captured=captured, **k):
            captured["g"] = torch.cat([p.grad.flatten() for p in _m.parameters()]).clone()
            return _orig(*a, **k)

        tr.optimizer.step = step
        m = tr.train_step(trajs)
        assert (m["train/micro_batches"] == 1) == (budget == 4096)
        assert torch.allclose(captured["g"], expected, atol=1e-6, rtol=1e-4), budget
        assert m["train/kl_ref"] == pytest.approx(kl_ref, rel=1e-4)


def test_partial_sync_equals_oracle_for_the_tokens_it_covers(tiny):
    import time

    from conveyor.rollout.engine import InferenceEngine, SamplingParams
    from conveyor.rollout.old_logprobs import OldLogprobBook
    from conveyor.runtime.publish import scoring_items

    tr = _trainer(tiny, "partial_sync", eta=4)
    eng_model = copy.deepcopy(tiny.model)
    eng = InferenceEngine(eng_model, tiny.tokenizer, track_partials=True, num_threads=1, seed=1)
    prompts = [[5 + i, 17, 300 + i, 42] for i in range(3)]
    weights = {0: WeightUpdate.from_model(eng_model, 0)}
    gen = torch.Generator().manual_seed(0)
    book = OldLogprobBook()  # the rollout side's store: patches are messages, nothing shared
    spec = tr.scoring_spec()
    eng.start()
    try:
        with pytest.raises(RuntimeError, match="paused"):
            eng.partial_requests()
        with pytest.raises(RuntimeError, match="paused"):
            eng.score_old_logprobs(spec, [])
        futs = [eng.submit(p, SamplingParams(max_new_tokens=400, temperature=1.0, ignore_eos=True)) for p in prompts]
        for v in (1, 2):
            start = eng.stats()["decode_steps"]
            while eng.stats()["decode_steps"] < start + 10:
                time.sleep(0.0005)
            eng.pause()
            patches, n = eng.score_old_logprobs(spec, scoring_items(eng.partial_requests(), []))
            assert n > 0 and {p.version for p in patches} == {v - 1} and book.apply(patches) == n
            new = {k: t + 0.05 * torch.randn(t.shape, generator=gen) * t.abs().mean()
                   for k, t in WeightUpdate.from_model(eng_model, v).tensors.items()}
            eng.update_weights(WeightUpdate(version=v, tensors=new))
            weights[v] = WeightUpdate.from_model(eng_model, v)
            eng.resume()
        outs = [f.result() for f in futs]
        eng.pause()
        parts = eng.partial_requests()  # the finished requests, remembered until this call
        assert len(parts) == 3 and all(p.finished for p in parts)
        assert {p.key for p in parts} == {o.key for o in outs} and all(o.key for o in outs)
        patches, n = eng.score_old_logprobs(spec, scoring_items(parts, []))
        book.apply(patches)
        assert eng.partial_requests() == []  # forgotten after the call
    finally:
        eng.stop()
    trajs = [traj_of(o) for o in outs]
    assert book.attach(trajs) == sum(len(o.token_ids) for o in outs)  # every token covered
    assert len(book) == 0  # handed out: forgotten
    model = copy.deepcopy(tr.model)
    for o, t in zip(outs, trajs, strict=True):
        assert set(o.versions) == {0, 1, 2}  # every request spans three versions
        seq = pack_one(o)
        expect = torch.zeros(len(o.token_ids))
        for u, upd in weights.items():
            model.load_state_dict({**upd.tensors, **{a: upd.tensors[s] for a, s in upd.aliases.items()}})
            with torch.no_grad():
                lp, _ = tr._logprobs(model, seq)
            lp = lp[seq.mask > 0]
            sel = torch.tensor(o.versions) == u
            expect[sel] = lp[sel]
        assert torch.allclose(torch.tensor(t.metadata["old_logprobs"]), expect, atol=1e-5)


def traj_of(o):
    from conveyor.types import Sample, Trajectory

    return Trajectory(sample=Sample("x", "", "", ""), group_id="g", prompt_ids=o.prompt_ids, response_ids=o.token_ids,
                      behaviour_logprobs=list(o.logprobs), versions=o.versions,
                      metadata={"request_spans": [list(sp) for sp in o.spans()]})


def pack_one(o):
    from conveyor.types import Sample, Trajectory

    t = Trajectory(sample=Sample("x", "", "", ""), group_id="g", prompt_ids=o.prompt_ids, response_ids=o.token_ids,
                   behaviour_logprobs=[0.0] * len(o.token_ids), versions=o.versions)
    return _mb([t])


def test_partial_sync_strategy_uses_recorded_values_and_counts_missing(tiny):
    tr = _trainer(tiny, "partial_sync", eta=2)
    trajs = make_trajs(2, version=0)
    t0, t1 = trajs
    t0.versions = [0] * len(t0.response_ids)
    t0.metadata["old_logprobs"] = [-1.5] * len(t0.response_ids)  # recorded at the update that retired version 0
    t1.versions = [0] * len(t1.response_ids)  # never recorded: falls back, counted
    tr.version = 1
    mb = _mb(trajs)
    theta = _current(tr, mb)
    out = tr.proximal.from_forward(theta, mb, 1)
    m0 = (mb.seq_index == 0) & (mb.mask > 0)
    m1 = (mb.seq_index == 1) & (mb.mask > 0)
    assert torch.all(out[m0] == -1.5) and torch.equal(out[m1], theta[m1])
    st = tr.proximal.after_update(tr.model, 2, {})
    assert st.values["proximal/partial_sync_missing_frac"] == pytest.approx(m1.sum().item() / (m0.sum() + m1.sum()).item())


def test_dedicated_worker_scores_with_the_retired_version_then_loads_the_next(tiny):
    from conveyor.trainer.proximal import Dedicated

    tr = _trainer(tiny, "dedicated", eta=2)
    ded = tr.proximal
    assert isinstance(ded, Dedicated) and ded.extra_bytes() == param_bytes(tr.model)
    ded.start(tr)
    try:
        from conveyor.rollout.old_logprobs import OldLogprobBook, items_of_trajectory

        trajs = make_trajs(3, version=0)
        for i, t in enumerate(trajs):
            t.versions = [0] * len(t.response_ids)
            t.metadata["request_spans"] = [[f"e:{i}", 0, len(t.response_ids)]]

        expect = [reference_logprobs(tr.model, t) for t in trajs]  # version-0 weights (bf16 off)
        new = copy.deepcopy(tr.model)
        with torch.no_grad():
            for p in new.parameters():
                p.add_(0.01)
        book = OldLogprobBook()
        ded.retire([items_of_trajectory(t) for t in trajs], WeightUpdate.from_model(new, 1), book.apply)
        assert ded.wait_retired(1) >= 0.0
        assert len(book) == 3  # delivered before wait_retired returned
        book.attach(trajs)
        for t, e in zip(trajs, expect, strict=True):
            assert torch.allclose(torch.tensor(t.metadata["old_logprobs"]), e, atol=1e-4)
        assert ded.version == 1 and ded.retired == 0
        for a, b in zip(ded.model.parameters(), new.parameters(), strict=True):
            assert torch.equal(a, b)
    finally:
        ded.stop()


def test_reference_forward_is_timed_apart_from_the_proximal_policy(tiny, monkeypatch):
    """The KL penalty's reference forward is ``time/reference_s``, not proximal cost: with
    ``recompute`` and one minibatch the proximal log-probs come from the gradient pass (no extra
    forward), so ``time/proximal_s`` stays far below a slowed-down reference pass."""
    import time as _time

    tr = _trainer(tiny, "recompute", eta=2, loss={"kl_coef": 0.05})
    assert tr.has_reference
    slow = tr._reference_logprobs

    def reference_logprobs_slowly(mb):
        _time.sleep(0.3)
        return slow(mb)

    monkeypatch.setattr(tr, "_reference_logprobs", reference_logprobs_slowly)
    m = tr.train_step(make_trajs(4, version=0))
    assert m["time/reference_s"] >= 0.3
    assert m["time/proximal_s"] < 0.25
    plain = _trainer(tiny, "recompute", eta=2, loss={"kl_coef": 0.0})
    assert "time/reference_s" not in plain.train_step(make_trajs(4, version=0))
