"""Hand-computed checks of the policy-gradient losses (PPO clip, decoupled PPO, KL penalty)."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.trainer.losses import (
    LossOutput,
    aggregate,
    decoupled_ppo_loss,
    kl_penalty,
    ppo_clip_loss,
)

LN = math.log


def leaf(values, dtype=torch.float32):
    """A [B, T] leaf tensor that records its gradient."""
    return torch.tensor(values, dtype=dtype, requires_grad=True)


def ones_mask(b, t):
    return torch.ones(b, t, dtype=torch.bool)


# --------------------------------------------------------------------------------------------
# PPO clip
# --------------------------------------------------------------------------------------------


def test_ppo_ratio_one_gives_minus_advantage_sum():
    # r = 1 everywhere -> loss_t = -A_t; sum = -(1 - 2 + 0.5) = 0.5
    # d loss_t / d logprob_t = -A_t * r_t = -A_t
    lp = leaf([[-1.0, -2.0, -0.5]])
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    out = ppo_clip_loss(lp, lp.detach().clone(), adv, ones_mask(1, 3))
    assert out.loss_sum.item() == pytest.approx(0.5, abs=1e-6)
    assert out.num_tokens.item() == 3
    out.loss_sum.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, 2.0, -0.5]]))
    assert out.metrics["clip_low_count"].item() == 0
    assert out.metrics["clip_high_count"].item() == 0
    assert out.metrics["ratio_sum"].item() == pytest.approx(3.0)
    assert out.metrics["approx_kl_sum"].item() == pytest.approx(0.0, abs=1e-7)


def test_ppo_clip_high_positive_advantage_zero_gradient():
    # token 0: r = 1.5 > 1 + 0.2, A = 2 -> -min(1.5 * 2, 1.2 * 2) = -2.4, clipped: grad 0
    # token 1: r = 1.1 inside,    A = 2 -> -min(2.2, 2.2)         = -2.2, grad -A r = -2.2
    # sum = -4.6
    old = torch.tensor([[-1.0, -1.0]])
    lp = leaf([[-1.0 + LN(1.5), -1.0 + LN(1.1)]])
    adv = torch.tensor([[2.0, 2.0]])
    out = ppo_clip_loss(lp, old, adv, ones_mask(1, 2), eps_low=0.2, eps_high=0.2)
    assert out.loss_sum.item() == pytest.approx(-4.6, abs=1e-5)
    out.loss_sum.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -2.2]]))
    assert out.metrics["clip_high_count"].item() == 1
    assert out.metrics["clip_low_count"].item() == 0
    # ratio stats: sum 2.6, sq_sum 2.25 + 1.21 = 3.46, max 1.5, min 1.1
    assert out.metrics["ratio_sum"].item() == pytest.approx(2.6, abs=1e-6)
    assert out.metrics["ratio_sq_sum"].item() == pytest.approx(3.46, abs=1e-5)
    assert out.metrics["ratio_max"].item() == pytest.approx(1.5, abs=1e-6)
    assert out.metrics["ratio_min"].item() == pytest.approx(1.1, abs=1e-6)
    # k3: (1.5 - 1 - ln 1.5) + (1.1 - 1 - ln 1.1) = 0.0945349 + 0.0046898 = 0.0992247
    assert out.metrics["approx_kl_sum"].item() == pytest.approx(0.0992247, abs=1e-6)


def test_ppo_clip_low_negative_advantage_zero_gradient():
    # token 0: r = 0.5 < 1 - 0.2, A = -1 -> -min(-0.5, -0.8) = 0.8, clipped: grad 0
    # token 1: r = 0.5,           A = +1 -> -min(0.5, 0.8) = -0.5 (pessimistic side, not
    #          clipped): grad -A r = -0.5
    # sum = 0.3
    old = torch.tensor([[0.0, 0.0]])
    lp = leaf([[LN(0.5), LN(0.5)]])
    adv = torch.tensor([[-1.0, 1.0]])
    out = ppo_clip_loss(lp, old, adv, ones_mask(1, 2))
    assert out.loss_sum.item() == pytest.approx(0.3, abs=1e-6)
    out.loss_sum.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.5]]))
    assert out.metrics["clip_low_count"].item() == 1
    assert out.metrics["clip_high_count"].item() == 0


def test_ppo_asymmetric_clip_higher():
    # token 0: r = 1.25, A = +1; token 1: r = 0.75, A = -1
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    ratios = [[LN(1.25), LN(0.75)]]

    # DAPO eps_low 0.2, eps_high 0.28: 1.25 < 1.28 -> not clipped: loss -1.25, grad -1.25
    #                                  0.75 < 0.8  -> clipped:     loss  0.8,  grad 0
    lp = leaf(ratios)
    out = ppo_clip_loss(lp, old, adv, ones_mask(1, 2), eps_low=0.2, eps_high=0.28)
    assert out.loss_sum.item() == pytest.approx(-1.25 + 0.8, abs=1e-6)
    out.loss_sum.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.25, 0.0]]))
    assert (out.metrics["clip_high_count"].item(), out.metrics["clip_low_count"].item()) == (0, 1)

    # swap: eps_low 0.28 (0.75 > 0.72 -> not clipped: loss 0.75, grad -A r = 0.75),
    #       eps_high 0.2 (1.25 > 1.2  -> clipped:     loss -1.2, grad 0)
    lp = leaf(ratios)
    out = ppo_clip_loss(lp, old, adv, ones_mask(1, 2), eps_low=0.28, eps_high=0.2)
    assert out.loss_sum.item() == pytest.approx(-1.2 + 0.75, abs=1e-6)
    out.loss_sum.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.75]]))
    assert (out.metrics["clip_high_count"].item(), out.metrics["clip_low_count"].item()) == (1, 0)


def test_ppo_dual_clip_bounds_negative_advantage_loss():
    # token 0: r = 4, A = -1: PPO loss max(4, 1.2) = 4; dual clip c = 3 -> min(4, 3) = 3, grad 0
    # token 1: r = 2, A = -1: PPO loss max(2, 1.2) = 2 < 3 -> 2, grad -A r = 2
    # token 2: r = 4, A = +1: PPO loss -min(4, 1.2) = -1.2 (dual clip only for A < 0), grad 0
    old = torch.zeros(1, 3)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    ratios = [[LN(4.0), LN(2.0), LN(4.0)]]

    lp = leaf(ratios)
    out = ppo_clip_loss(lp, old, adv, ones_mask(1, 3), dual_clip=3.0)
    assert out.loss_sum.item() == pytest.approx(3.0 + 2.0 - 1.2, abs=1e-5)
    out.loss_sum.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 2.0, 0.0]]))
    assert out.metrics["dual_clip_count"].item() == 1
    assert out.metrics["clip_high_count"].item() == 1  # token 2

    # without dual clip token 0 is unbounded: loss 4, grad 4
    lp = leaf(ratios)
    out = ppo_clip_loss(lp, old, adv, ones_mask(1, 3))
    assert out.loss_sum.item() == pytest.approx(4.0 + 2.0 - 1.2, abs=1e-5)
    out.loss_sum.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[4.0, 2.0, 0.0]]))
    assert out.metrics["dual_clip_count"].item() == 0


def test_ppo_masked_tokens_contribute_nothing_even_garbage():
    # row 0: 2 real tokens then padding holding garbage (NaN advantage, inf log-probs)
    # row 1: 1 real token. Real tokens: r = 1, A = (1, 2 | 3) -> loss -(1 + 2 + 3) = -6
    nan, inf = float("nan"), float("inf")
    lp = leaf([[-1.0, -1.0, inf], [-2.0, -inf, nan]])
    old = torch.tensor([[-1.0, -1.0, -inf], [-2.0, 5.0, 0.0]])
    adv = torch.tensor([[1.0, 2.0, nan], [3.0, 1e30, nan]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # float mask works too
    out = ppo_clip_loss(lp, old, adv, mask)
    assert out.loss_sum.item() == pytest.approx(-6.0)
    assert out.num_tokens.item() == 3
    out.loss_sum.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0]]))
    for name, value in out.metrics.items():
        assert torch.isfinite(value), name
    assert out.metrics["ratio_max"].item() == 1.0


@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (0, 0), (2, 3)])
def test_ppo_empty_and_all_masked_give_zero_loss(shape):
    lp = torch.randn(shape, requires_grad=True)
    old = torch.randn(shape)
    adv = torch.randn(shape)
    mask = torch.zeros(shape, dtype=torch.bool)  # (2, 3): all masked
    out = ppo_clip_loss(lp, old, adv, mask, dual_clip=3.0)
    assert out.loss_sum.item() == 0.0
    assert out.num_tokens.item() == 0
    out.loss_sum.backward()
    assert lp.grad is not None and torch.equal(lp.grad, torch.zeros(shape))
    for name, value in out.metrics.items():
        assert not torch.isnan(value), name
    # identities of max / min, so that micro-batches combine exactly
    assert out.metrics["ratio_max"].item() == -math.inf
    assert out.metrics["ratio_min"].item() == math.inf
    logged = aggregate([out])
    assert all(math.isfinite(v) for v in logged.values()), logged
    assert logged["loss"] == 0.0 and logged["ratio_max"] == 0.0


def test_ppo_bf16_inputs_computed_in_fp32():
    # bf16 log-probs: the ratio is computed in fp32 from the bf16 values
    lp16 = torch.tensor([[-1.0, -0.5]], dtype=torch.bfloat16, requires_grad=True)
    old16 = torch.tensor([[-1.125, -0.5]], dtype=torch.bfloat16)  # both exact in bf16
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.bfloat16)
    out = ppo_clip_loss(lp16, old16, adv, ones_mask(1, 2))
    assert out.loss_sum.dtype == torch.float32
    # r0 = exp(0.125) = 1.1331485 (inside the clip range), r1 = 1
    # loss = -(1.1331485 * 1) - (1 * -1) = -0.1331485
    assert out.loss_sum.item() == pytest.approx(-0.1331485, abs=1e-6)
    out.loss_sum.backward()
    assert lp16.grad.dtype == torch.bfloat16
    assert lp16.grad[0, 0].item() == pytest.approx(-1.1331485, abs=1e-2)


def test_ppo_extreme_log_ratio_stays_finite():
    # log r = 100 would overflow fp32 exp; it is clamped to 20 (r = exp(20) = 4.85e8)
    lp = leaf([[100.0]])
    out = ppo_clip_loss(lp, torch.zeros(1, 1), torch.tensor([[-1.0]]), ones_mask(1, 1))
    assert out.loss_sum.item() == pytest.approx(math.exp(20.0), rel=1e-5)
    out.loss_sum.backward()
    assert torch.isfinite(lp.grad).all()


def test_ppo_bad_input_raises_naming_argument():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logprobs"):
        ppo_clip_loss(x, torch.zeros(2, 4), x, x)
    with pytest.raises(ValueError, match="advantages"):
        ppo_clip_loss(x, x, torch.zeros(2, 3, dtype=torch.long), x)
    with pytest.raises(ValueError, match="mask"):
        ppo_clip_loss(x, x, x, torch.zeros(6))
    with pytest.raises(ValueError, match="eps_low"):
        ppo_clip_loss(x, x, x, x, eps_low=1.0)
    with pytest.raises(ValueError, match="eps_high"):
        ppo_clip_loss(x, x, x, x, eps_high=-0.1)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(x, x, x, x, dual_clip=0.5)


# --------------------------------------------------------------------------------------------
# Decoupled PPO
# --------------------------------------------------------------------------------------------


def test_decoupled_equals_ppo_when_proximal_is_behaviour():
    g = torch.Generator().manual_seed(0)
    shape = (3, 5)
    lp_a = (torch.randn(shape, generator=g) * 0.3 - 1.0).requires_grad_()
    lp_b = lp_a.detach().clone().requires_grad_()
    behav = lp_a.detach() + torch.randn(shape, generator=g) * 0.3
    adv = torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.3

    ppo = ppo_clip_loss(lp_a, behav, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    dec = decoupled_ppo_loss(
        lp_b, behav, behav, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=3.0,
        behaviour_weight_cap=5.0, cap_mode="mask",
    )
    torch.testing.assert_close(dec.loss_sum, ppo.loss_sum)
    assert dec.num_tokens.item() == ppo.num_tokens.item() == mask.sum().item()
    for key, value in ppo.metrics.items():
        torch.testing.assert_close(dec.metrics[key], value)
    ppo.loss_sum.backward()
    dec.loss_sum.backward()
    torch.testing.assert_close(lp_b.grad, lp_a.grad)
    # w = 1 everywhere
    n = mask.sum().item()
    assert dec.metrics["behaviour_weight_sum"].item() == pytest.approx(n)
    assert dec.metrics["behaviour_weight_capped_count"].item() == 0
    assert dec.metrics["behaviour_approx_kl_sum"].item() == pytest.approx(0.0, abs=1e-7)
    # sanity: the random data actually exercised clipping (otherwise the test proves little)
    assert ppo.metrics["clip_low_count"].item() + ppo.metrics["clip_high_count"].item() > 0


def test_decoupled_behaviour_weight_scales_the_term():
    # w = pi_prox / pi_behav = 2, u = pi_theta / pi_prox = 1, A = 1
    # loss = -w * min(u A, clip(u) A) = -2; grad = -w * A * u = -2
    # second token: w = 0.5, u = 1.5 (> 1.2: clipped), A = 1 -> -0.5 * 1.2 = -0.6, grad 0
    prox = torch.tensor([[-1.0, -1.0]])
    behav = torch.tensor([[-1.0 - LN(2.0), -1.0 - LN(0.5)]])
    lp = leaf([[-1.0, -1.0 + LN(1.5)]])
    out = decoupled_ppo_loss(lp, prox, behav, torch.ones(1, 2), ones_mask(1, 2))
    assert out.loss_sum.item() == pytest.approx(-2.6, abs=1e-5)
    out.loss_sum.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-2.0, 0.0]]))
    assert out.metrics["behaviour_weight_sum"].item() == pytest.approx(2.5, abs=1e-6)
    assert out.metrics["behaviour_weight_max"].item() == pytest.approx(2.0, abs=1e-6)
    assert out.metrics["behaviour_weight_min"].item() == pytest.approx(0.5, abs=1e-6)
    # k3 of w: (2 - 1 - ln 2) + (0.5 - 1 - ln 0.5) = 0.3068528 + 0.1931472 = 0.5
    assert out.metrics["behaviour_approx_kl_sum"].item() == pytest.approx(0.5, abs=1e-6)
    # the PPO metrics are those of u
    assert out.metrics["ratio_max"].item() == pytest.approx(1.5, abs=1e-6)
    assert out.metrics["clip_high_count"].item() == 1


def _cap_case(cap, cap_mode):
    # w = (3, 1.5), u = 1, A = (1, 1), cap C = 2
    prox = torch.tensor([[-1.0, -1.0]])
    behav = torch.tensor([[-1.0 - LN(3.0), -1.0 - LN(1.5)]])
    lp = leaf([[-1.0, -1.0]])
    out = decoupled_ppo_loss(
        lp, prox, behav, torch.ones(1, 2), ones_mask(1, 2),
        behaviour_weight_cap=cap, cap_mode=cap_mode,
    )
    out.loss_sum.backward()
    return out, lp.grad


def test_decoupled_cap_clamp_vs_mask():
    # no cap: -(3 + 1.5) = -4.5, grads (-3, -1.5)
    out, grad = _cap_case(None, "clamp")
    assert out.loss_sum.item() == pytest.approx(-4.5, abs=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[-3.0, -1.5]]))
    assert out.metrics["behaviour_weight_capped_count"].item() == 0

    # clamp: min(3, 2) = 2 -> -(2 + 1.5) = -3.5, grads (-2, -1.5)
    out, grad = _cap_case(2.0, "clamp")
    assert out.loss_sum.item() == pytest.approx(-3.5, abs=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[-2.0, -1.5]]))
    assert out.metrics["behaviour_weight_capped_count"].item() == 1
    assert out.num_tokens.item() == 2

    # mask (AReaL): w = 3 > 2 -> token dropped: -(0 + 1.5) = -1.5, grads (0, -1.5);
    # the dropped token still counts in num_tokens (AReaL divides by the loss-mask count)
    out, grad = _cap_case(2.0, "mask")
    assert out.loss_sum.item() == pytest.approx(-1.5, abs=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.5]]))
    assert out.metrics["behaviour_weight_capped_count"].item() == 1
    assert out.num_tokens.item() == 2
    # behaviour-weight stats report the uncapped w: sum 4.5, max 3
    assert out.metrics["behaviour_weight_sum"].item() == pytest.approx(4.5, abs=1e-5)
    assert out.metrics["behaviour_weight_max"].item() == pytest.approx(3.0, abs=1e-5)


def test_decoupled_empty_and_masked_padding():
    out = decoupled_ppo_loss(*(torch.zeros(0, 3) for _ in range(4)), torch.zeros(0, 3))
    assert out.loss_sum.item() == 0.0 and out.num_tokens.item() == 0
    # padding with a huge behaviour log-ratio and NaN advantage is ignored
    lp = leaf([[-1.0, 0.0]])
    prox = torch.tensor([[-1.0, 0.0]])
    behav = torch.tensor([[-1.0, -1e9]])
    adv = torch.tensor([[2.0, float("nan")]])
    out = decoupled_ppo_loss(lp, prox, behav, adv, torch.tensor([[True, False]]))
    assert out.loss_sum.item() == pytest.approx(-2.0)
    out.loss_sum.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-2.0, 0.0]]))
    assert out.metrics["behaviour_weight_max"].item() == pytest.approx(1.0)


def test_decoupled_bad_input_raises_naming_argument():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="cap_mode"):
        decoupled_ppo_loss(x, x, x, x, x, cap_mode="truncate")
    with pytest.raises(ValueError, match="behaviour_weight_cap"):
        decoupled_ppo_loss(x, x, x, x, x, behaviour_weight_cap=0.5)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        decoupled_ppo_loss(x, x, torch.zeros(3, 2), x, x)
    with pytest.raises(ValueError, match="proximal_logprobs"):
        decoupled_ppo_loss(x, torch.zeros(2, 3, dtype=torch.int32), x, x, x)


# --------------------------------------------------------------------------------------------
# aggregate: exact global token-mean across micro-batches
# --------------------------------------------------------------------------------------------


def test_aggregate_two_micro_batches_equals_concatenated_batch():
    # micro-batch 1: one sequence with 3 counted tokens; micro-batch 2: one with 1 token.
    # tokens: (r, A) = (1.5, 1), (1, 1), (0.5, -1) | (1, 3)
    #   losses: -1.2 (clip high), -1, 0.8 (clip low) | -3   -> sum -4.4 over 4 tokens
    #   global token-mean -1.1; mean of micro-batch means ((-1.4 / 3) + (-3)) / 2 = -1.7333
    lp1, old1 = torch.tensor([[LN(1.5), 0.0, LN(0.5)]]), torch.zeros(1, 3)
    adv1, m1 = torch.tensor([[1.0, 1.0, -1.0]]), ones_mask(1, 3)
    lp2, old2 = torch.tensor([[0.0, 7.0, 7.0]]), torch.zeros(1, 3)
    adv2, m2 = torch.tensor([[3.0, 9.0, 9.0]]), torch.tensor([[True, False, False]])

    parts = [ppo_clip_loss(lp1, old1, adv1, m1), ppo_clip_loss(lp2, old2, adv2, m2)]
    whole = ppo_clip_loss(
        torch.cat([lp1, lp2]), torch.cat([old1, old2]), torch.cat([adv1, adv2]),
        torch.cat([m1, m2]),
    )
    got, want = aggregate(parts), aggregate([whole])
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-6), key

    assert got["loss"] == pytest.approx(-1.1, abs=1e-6)
    assert got["loss"] != pytest.approx((parts[0].loss_sum.item() / 3 + parts[1].loss_sum.item()) / 2)
    assert got["num_tokens"] == 4
    assert got["clip_high_frac"] == pytest.approx(0.25)
    assert got["clip_low_frac"] == pytest.approx(0.25)
    assert got["dual_clip_frac"] == 0.0
    # ratios (1.5, 1, 0.5, 1): mean 1, E[r^2] = (2.25 + 1 + 0.25 + 1) / 4 = 1.125,
    # std = sqrt(1.125 - 1) = 0.3535534; max 1.5 (micro-batch 1), min 0.5
    assert got["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert got["ratio_std"] == pytest.approx(0.3535534, abs=1e-6)
    assert got["ratio_max"] == pytest.approx(1.5, abs=1e-6)
    assert got["ratio_min"] == pytest.approx(0.5, abs=1e-6)
    # k3: (0.5 - ln 1.5) + 0 + (-0.5 - ln 0.5) + 0 = 0.0945349 + 0.1931472 = 0.2876821; / 4
    assert got["approx_kl_mean"] == pytest.approx(0.2876821 / 4, abs=1e-6)


def test_aggregate_rules_and_errors():
    a = LossOutput(torch.tensor(2.0), torch.tensor(2.0), {
        "x_sum": torch.tensor(4.0), "x_sq_sum": torch.tensor(10.0), "x_max": torch.tensor(3.0),
        "x_min": torch.tensor(1.0), "bad_count": torch.tensor(1.0), "sequences": torch.tensor(1.0),
    })
    b = LossOutput(torch.tensor(1.0), torch.tensor(0.0), {
        "x_sum": torch.tensor(0.0), "x_sq_sum": torch.tensor(0.0),
        "x_max": torch.tensor(-math.inf), "x_min": torch.tensor(math.inf),
        "bad_count": torch.tensor(0.0), "sequences": torch.tensor(2.0),
    })
    got = aggregate([a, b])
    # x over 2 tokens: mean 4 / 2 = 2, E[x^2] = 5, std = sqrt(5 - 4) = 1
    assert got == {
        "loss": 1.5, "num_tokens": 2.0, "x_mean": 2.0, "x_std": 1.0, "x_max": 3.0, "x_min": 1.0,
        "bad_frac": 0.5, "sequences": 3.0,
    }
    with pytest.raises(ValueError, match="outputs"):
        aggregate([])
    with pytest.raises(ValueError, match="outputs\\[1\\]"):
        aggregate([a, LossOutput(torch.tensor(0.0), torch.tensor(1.0), {})])


# --------------------------------------------------------------------------------------------
# KL penalty
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "expected", "grad"),
    [
        # pi_theta = 0.5, pi_ref = 0.25: log r = ln(0.25 / 0.5) = -ln 2 = -0.6931472
        ("k1", 0.6931472, 1.0),                          # -log r;      d/dlp = 1
        ("k2", 0.5 * 0.6931472**2, 0.6931472),           # (log r)^2/2; d/dlp = -log r
        ("k3", (0.5 - 1.0) + 0.6931472, 0.5),            # r - 1 - log r; d/dlp = 1 - r
    ],
)
def test_kl_penalty_hand_values(kind, expected, grad):
    # second token is masked and holds garbage
    lp = leaf([[LN(0.5), float("nan")]])
    ref = torch.tensor([[LN(0.25), 3.0]])
    kl = kl_penalty(lp, ref, torch.tensor([[1, 0]]), kind=kind)
    assert kl.dtype == torch.float32
    assert kl.item() == pytest.approx(expected, abs=1e-6)
    kl.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[grad, 0.0]]))


def test_kl_penalty_zero_when_equal_and_errors():
    lp = torch.randn(2, 4)
    for kind in ("k1", "k2", "k3"):
        assert kl_penalty(lp, lp.clone(), ones_mask(2, 4), kind=kind).item() == 0.0
    assert kl_penalty(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4)).item() == 0.0
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(lp, lp, ones_mask(2, 4), kind="k4")
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_penalty(lp, torch.zeros(2, 5), ones_mask(2, 4))
