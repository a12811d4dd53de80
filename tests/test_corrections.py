"""The loss family of issue 4 against hand-computed values: two-ratio, DIS, mismatch weights,
rejection statistics, aggregation modes and the interpolated proximal policies."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.trainer import corrections as C
from conveyor.trainer import losses as L

LOG = math.log


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


# ---------------------------------------------------------------- two-ratio
def test_two_ratio_filters_discrepancy_and_clips_staleness_by_sign():
    # token 0: rho_d = 1.0, rho_s = 1.5, A = +1 -> clipped at 1.28 (no gradient), loss -1.28
    # token 1: rho_d = 2.0 (outside [0.8, 1.25]) -> filtered, loss 0
    # token 2: rho_d = 0.9, rho_s = 0.5, A = -1 -> clipped low at 0.8, loss +0.8
    # token 3: rho_d = 1.1, rho_s = 1.1, A = +2 -> unclipped, loss -2.2
    old = t([0.0, 0.0, 0.0, 0.0])
    behav = old - t([LOG(1.0), LOG(2.0), LOG(0.9), LOG(1.1)])
    lp = (old + t([LOG(1.5), LOG(1.0), LOG(0.5), LOG(1.1)])).requires_grad_()
    adv = t([1.0, 1.0, -1.0, 2.0])
    mask = torch.ones(1, 4)
    out = L.two_ratio_loss(lp, old, behav, adv, mask, eps_low=0.2, eps_high=0.28)
    assert out.loss_sum.item() == pytest.approx(-1.28 + 0.0 + 0.8 - 2.2, abs=1e-5)
    assert out.num_tokens.item() == 4  # the filtered token stays in the denominator
    assert out.metrics["discrepancy_keep_count"].item() == 3
    assert out.metrics["discrepancy_high_count"].item() == 1 and out.metrics["discrepancy_low_count"].item() == 0
    out.loss_sum.backward()
    g = lp.grad[0]
    assert g[0] == 0 and g[1] == 0 and g[2] == 0  # clipped, filtered, clipped
    assert g[3].item() == pytest.approx(-2.0 * 1.1, rel=1e-5)  # d(-r A)/dlogp = -r A
    agg = L.aggregate([out])
    assert agg["discrepancy_keep_frac"] == pytest.approx(0.75)


def test_two_ratio_equals_ppo_when_no_discrepancy():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=g)
    lp = old + 0.3 * torch.randn(3, 5, generator=g)
    adv = torch.randn(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    a = L.two_ratio_loss(lp, old, old, adv, mask, eps_low=0.2, eps_high=0.28)
    b = L.ppo_clip_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    assert a.loss_sum.item() == pytest.approx(b.loss_sum.item(), abs=1e-5)


def test_two_ratio_validates_bounds():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="discrepancy_low"):
        L.two_ratio_loss(z, z, z, z, torch.ones(1, 2), discrepancy_low=1.2)


# ---------------------------------------------------------------- DIS
def test_dis_hard_mask_both_sides():
    behav = torch.zeros(1, 4)
    r = [0.5, 0.71, 3.0, 6.5]  # eps 0.3 / 5.0: band (0.7, 6.0)
    lp = t([LOG(x) for x in r]).requires_grad_()
    adv = t([1.0, 1.0, -1.0, 1.0])
    out = L.dis_loss(lp, behav, adv, torch.ones(1, 4), **dict(zip(("eps_low", "eps_high"), L.DIS_PRESETS["reasoning"], strict=True)))
    assert out.loss_sum.item() == pytest.approx(-0.71 + 3.0, rel=1e-5)
    assert out.metrics["dis_masked_low_count"].item() == 1 and out.metrics["dis_masked_high_count"].item() == 1
    out.loss_sum.backward()
    assert lp.grad[0, 0] == 0 and lp.grad[0, 3] == 0  # masked, not clipped: no gradient
    assert lp.grad[0, 1].item() == pytest.approx(-0.71, rel=1e-5) and lp.grad[0, 2].item() == pytest.approx(3.0, rel=1e-5)
    assert L.DIS_PRESETS["coding"] == (0.8, 3.0)


def test_new_losses_empty_and_all_masked_give_zero_not_nan():
    for B, T in ((0, 0), (2, 3)):
        z = torch.zeros(B, T, requires_grad=True)
        mask = torch.zeros(B, T)
        nan = torch.full((B, T), float("nan"))
        for out in (L.two_ratio_loss(z, nan, nan, nan, mask), L.dis_loss(z, nan, nan, mask),
                    L.ppo_clip_loss(z, nan, nan, mask, token_weights=nan)):
            assert out.loss_sum.item() == 0.0 and out.num_tokens.item() == 0
            out.loss_sum.backward()
            assert z.grad is None or torch.isfinite(z.grad).all()


# ---------------------------------------------------------------- mismatch weights
def _lr(*xs):
    return t(list(xs)), torch.zeros(1, len(xs))


def test_tis_and_mis_token():
    prox, behav = _lr(LOG(0.4), LOG(1.5), LOG(3.0))
    mask = torch.ones(1, 3)
    w, m = C.mismatch_weights(prox, behav, mask, method="tis_token", cap=2.0)
    assert w[0].tolist() == pytest.approx([0.4, 1.5, 2.0], rel=1e-5)
    assert m["correction/truncated_token_frac"] == pytest.approx(1 / 3)
    w, m = C.mismatch_weights(prox, behav, mask, method="mis_token", low=0.5, high=2.0)
    assert w[0].tolist() == pytest.approx([0.0, 1.5, 0.0], rel=1e-5)
    assert m["correction/masked_token_frac"] == pytest.approx(2 / 3)
    w, _ = C.mismatch_weights(prox, behav, mask, method="none")
    assert w[0].tolist() == [1.0, 1.0, 1.0]


def test_sequence_level_weights_with_packed_rows():
    # one row packing two sequences: s0 = tokens 0-1 (ratios 1.5, 1.5 -> product 2.25),
    # s1 = tokens 2-4 (ratios 1.1 each -> product 1.331, geometric mean 1.1)
    prox = t([LOG(1.5), LOG(1.5), LOG(1.1), LOG(1.1), LOG(1.1), 0.0])
    behav = torch.zeros(1, 6)
    mask = t([1, 1, 1, 1, 1, 0])
    seq = torch.tensor([[0, 0, 1, 1, 1, -1]])
    w, _ = C.mismatch_weights(prox, behav, mask, method="tis_sequence", cap=2.0, seq_index=seq)
    assert w[0].tolist() == pytest.approx([2.0, 2.0, 1.331, 1.331, 1.331, 0.0], rel=1e-4)
    w, m = C.mismatch_weights(prox, behav, mask, method="mis_sequence", low=0.5, high=2.0, seq_index=seq)
    assert w[0].tolist() == pytest.approx([0.0, 0.0, 1.331, 1.331, 1.331, 0.0], rel=1e-4)
    assert m["correction/masked_seq_frac"] == pytest.approx(0.5)
    # geometric mean: s0 = 1.5 (outside [0.8, 1.25]), s1 = 1.1 (inside) -> the length trap avoided
    w, _ = C.mismatch_weights(prox, behav, mask, method="geo_mask", low=0.8, high=1.25, seq_index=seq)
    assert w[0].tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 0.0]


def test_length_trap_product_vs_geometric_mean():
    n = 100
    prox = torch.full((1, n), LOG(1.1))
    behav = torch.zeros(1, n)
    mask = torch.ones(1, n)
    w_seq, _ = C.mismatch_weights(prox, behav, mask, method="mis_sequence", low=0.5, high=2.0)
    w_geo, _ = C.mismatch_weights(prox, behav, mask, method="geo_mask", low=0.5, high=2.0)
    assert w_seq.sum() == 0  # 1.1^100 = 13,780: rejected
    assert w_geo.sum() == n  # geometric mean 1.1: kept


@pytest.mark.parametrize(("n", "token_log_ratio", "kept"), [
    (40, 1.0, False),     # issue 10: geometric mean e = 2.72 > 2 (was kept: sum clamped to 20)
    (400, -0.8, False),   # e^-0.8 = 0.449 < 0.5, long
    (400, 0.6, True),     # e^0.6 = 1.82, long: kept
    (28, 1.0, False),     # short enough that the old clamp did not bite
])
def test_geo_mask_rejects_long_mismatched_sequences(n, token_log_ratio, kept):
    prox = torch.full((1, n), token_log_ratio)
    w, _ = C.mismatch_weights(prox, torch.zeros(1, n), torch.ones(1, n), method="geo_mask",
                              low=0.5, high=2.0)
    assert w.sum() == (n if kept else 0)


def test_weights_are_detached_clamped_and_nan_free():
    prox = torch.tensor([[100.0, float("nan"), 0.0]], requires_grad=True)
    behav = torch.zeros(1, 3)
    mask = t([1, 1, 0])
    for method in C.CORRECTIONS:
        w, _ = C.mismatch_weights(prox, behav, mask, method=method)
        assert not w.requires_grad and torch.isfinite(w).all() and w[0, 2] == 0


def test_rejection_stats_hand_computed():
    lr = [LOG(2.0), LOG(0.5)]
    prox = t(lr)
    behav = torch.zeros(1, 2)
    keep, m = C.rejection_stats(prox, behav, torch.ones(1, 2), reject="k3", threshold=0.2)
    k1 = -(lr[0] + lr[1]) / 2
    k2 = (lr[0] ** 2 + lr[1] ** 2) / 4
    k3 = ((2.0 - 1 - lr[0]) + (0.5 - 1 - lr[1])) / 2
    assert m["mismatch/k1_mean"] == pytest.approx(k1, abs=1e-6)
    assert m["mismatch/k2_mean"] == pytest.approx(k2, rel=1e-5)
    assert m["mismatch/k3_mean"] == pytest.approx(k3, rel=1e-5)
    assert k3 > 0.2 and keep.sum() == 0 and m["mismatch/rejected_seq_frac"] == 1.0
    keep, _ = C.rejection_stats(prox, behav, torch.ones(1, 2), reject="k3", threshold=1.0)
    assert keep.sum() == 2


# ---------------------------------------------------------------- aggregation
def test_aggregation_modes_hand_computed():
    # two sequences in one row: lengths 2 and 4; per-token losses 1..6
    loss = t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    mask = torch.ones(1, 6)
    seq = torch.tensor([[0, 0, 1, 1, 1, 1]])

    def agg(mode, **kw):
        w, norm = C.aggregation_weights(mask, mode, seq_index=seq, **kw)
        return float((w * loss).sum()) / norm

    assert agg("token_mean") == pytest.approx(21 / 6)
    assert agg("seq_mean_token_mean") == pytest.approx(((1 + 2) / 2 + (3 + 4 + 5 + 6) / 4) / 2)
    assert agg("seq_mean_token_sum") == pytest.approx((3 + 18) / 2)
    assert agg("constant", constant=8) == pytest.approx(21 / (2 * 8))
    with pytest.raises(ValueError, match="constant"):
        C.aggregation_weights(mask, "constant")
    w, norm = C.aggregation_weights(torch.zeros(0, 0), "seq_mean_token_mean")
    assert norm == 0.0 and w.numel() == 0


# ---------------------------------------------------------------- interpolation
def test_interpolation_alpha_per_token():
    versions = torch.tensor([[5, 4, 3, 2, -1]])
    a = C.interpolation_alpha(versions, current_version=5)
    assert a[0].tolist() == pytest.approx([0.0, 1 / 2, 2 / 3, 3 / 4, 0.0])


def test_interpolated_proximal_values():
    th, b = t([LOG(0.4)]), t([LOG(0.1)])
    a = t([0.5])
    m = torch.ones(1, 1)
    assert C.interpolated_proximal(th, b, a, m, kind="loglinear").item() == pytest.approx(LOG(0.2), rel=1e-5)
    assert C.interpolated_proximal(th, b, a, m, kind="linear").item() == pytest.approx(LOG(0.25), rel=1e-5)
    assert C.interpolated_proximal(th, b, t([0.0]), m, kind="linear").item() == pytest.approx(LOG(0.1), rel=1e-5)
    assert C.interpolated_proximal(th, b, t([1.0]), m, kind="linear").item() == pytest.approx(LOG(0.4), rel=1e-5)


@pytest.mark.parametrize("gap", [1, 2, 3])
@pytest.mark.parametrize("kind", ["loglinear", "linear"])
def test_interpolation_only_rescales_the_clip_bounds(gap, kind):
    """MISSION.md section 2: decoupled PPO with an interpolated proximal policy clips exactly
    where PPO on the total ratio pi_theta / pi_behav clips with rescaled bounds."""
    eps_l, eps_h = 0.2, 0.28
    v = 10
    alpha = gap / (gap + 1)
    lo, hi = C.effective_clip_bounds(alpha, eps_l, eps_h, kind)
    r = torch.exp(torch.linspace(-1.5, 1.5, 301)).unsqueeze(0)  # total ratios
    behav = torch.full_like(r, LOG(0.3))
    theta = (behav + torch.log(r)).requires_grad_()
    versions = torch.full(r.shape, v - gap, dtype=torch.long)
    mask = torch.ones_like(r)
    prox = C.interpolated_proximal(theta, behav, C.interpolation_alpha(versions, v), mask, kind=kind)
    for sign in (1.0, -1.0):
        adv = torch.full_like(r, sign)
        theta.grad = None
        L.decoupled_ppo_loss(theta, prox, behav, adv, mask, eps_low=eps_l, eps_high=eps_h).loss_sum.backward()
        has_grad = theta.grad[0] != 0
        # PPO on r with the effective bounds: gradient vanishes where the clipped branch is active
        expect = ~((r[0] > hi) & (sign > 0)) & ~((r[0] < lo) & (sign < 0))
        # skip grid points within float error of a bound
        near = (torch.log(r[0]) - math.log(hi)).abs().lt(1e-3) | (torch.log(r[0]) - math.log(lo)).abs().lt(1e-3)
        assert torch.equal(has_grad[~near], expect[~near])
    # the two interpolations give interchangeable bounds (within ~15% of the log-width here)
    ll = C.effective_clip_bounds(alpha, eps_l, eps_h, "loglinear")
    assert math.log(lo) == pytest.approx(math.log(ll[0]), rel=0.5)
    assert effective_widths_monotone(eps_l, eps_h)


def effective_widths_monotone(eps_l, eps_h):
    his = [C.effective_clip_bounds(k / (k + 1), eps_l, eps_h, "loglinear")[1] for k in range(4)]
    return all(a < b for a, b in zip(his, his[1:], strict=False)) and his[0] == pytest.approx(1 + eps_h)
