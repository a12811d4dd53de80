"""Hand-computed checks of the critic-path advantage estimators (conveyor.trainer.gae)."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.trainer.gae import (
    SlidingWindowBaseline,
    adaptive_lambda,
    decoupled_gae,
    gae,
    segments,
    sliding_window_advantages,
    turn_level_gae,
    whiten,
)

ATOL = 1e-6
NAN = float("nan")


def close(actual, expected, atol=ATOL):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol)


# The SAO example: actions at 0, 1, 4, observations (tool output) at 2, 3; reward 1 on token 4.
MASK = torch.tensor([[1, 1, 0, 0, 1]])
VALUES = torch.tensor([[0.2, 0.4, 9.0, 9.0, 0.6]])
REWARDS = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])


def reference_gae(rewards, values, chain, action, gamma, lam):
    """Definition, row by row in Python: the chain is the explicit list of chain positions."""
    adv = torch.zeros(rewards.shape, dtype=torch.float64)
    ret = torch.zeros(rewards.shape, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        lam_b = float(lam[b]) if isinstance(lam, torch.Tensor) else lam
        steps = [t for t in range(rewards.shape[1]) if chain[b, t]]
        a, next_v = 0.0, 0.0
        for t in reversed(steps):
            delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
            a = delta + gamma * lam_b * a
            next_v = float(values[b, t])
            if action[b, t]:
                adv[b, t], ret[b, t] = a, a + float(values[b, t])
    return adv, ret


def verl_textbook_gae(rewards, values, gamma, lam):
    """verl's original loop (no mask): next value is values[:, t + 1], 0 after the end."""
    last, out = 0.0, []
    for t in reversed(range(rewards.shape[1])):
        next_v = values[:, t + 1] if t < rewards.shape[1] - 1 else 0.0
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        last = delta + gamma * lam * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


# ------------------------------------------------------------------------------------------
# gae: skip-observation (SAO) and naive
# ------------------------------------------------------------------------------------------


def test_skip_observation_lambda_1():
    # gamma 1, chain 0 -> 1 -> 4 (2, 3 skipped):
    # d4 = 1 + 0 - 0.6 = 0.4; A4 = 0.4
    # d1 = 0 + V4 - V1 = 0.6 - 0.4 = 0.2; A1 = 0.2 + 0.4 = 0.6
    # d0 = 0 + V1 - V0 = 0.4 - 0.2 = 0.2; A0 = 0.2 + 0.6 = 0.8
    # returns A + V = 1, 1, -, -, 1 (lambda 1: Monte-Carlo return)
    adv, ret = gae(REWARDS, VALUES, MASK, gamma=1.0, lam=1.0)
    close(adv, [[0.8, 0.6, 0.0, 0.0, 0.4]])
    close(ret, [[1.0, 1.0, 0.0, 0.0, 1.0]])
    assert adv.dtype == ret.dtype == torch.float32


def test_skip_observation_lambda_half():
    # A4 = 0.4; A1 = d1 + 0.5 A4 = 0.2 + 0.2 = 0.4; A0 = d0 + 0.5 A1 = 0.2 + 0.2 = 0.4
    # returns: 0.4 + 0.2 = 0.6, 0.4 + 0.4 = 0.8, 0.4 + 0.6 = 1.0
    adv, ret = gae(REWARDS, VALUES, MASK, gamma=1.0, lam=0.5)
    close(adv, [[0.4, 0.4, 0.0, 0.0, 0.4]])
    close(ret, [[0.6, 0.8, 0.0, 0.0, 1.0]])


@pytest.mark.parametrize("obs_value", [-1000.0, 0.0, 1e30, NAN, float("inf")])
@pytest.mark.parametrize("lam", [1.0, 0.5])
def test_observation_values_change_nothing(obs_value, lam):
    values = VALUES.clone()
    values[0, 2:4] = obs_value
    base = gae(REWARDS, VALUES, MASK, gamma=1.0, lam=lam)
    got = gae(REWARDS, values, MASK, gamma=1.0, lam=lam)
    assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])


def test_naive_gae_differs_on_sao_example():
    # Naive chain 0 -> 1 -> 2 -> 3 -> 4, gamma 1, lam 0.5, observation values 9 enter it:
    # d4 = 1 - 0.6 = 0.4          A4 = 0.4
    # d3 = 0 + 0.6 - 9 = -8.4     A3 = -8.4 + 0.5 * 0.4   = -8.2  (reported as 0)
    # d2 = 0 + 9 - 9 = 0          A2 = 0 + 0.5 * -8.2     = -4.1  (reported as 0)
    # d1 = 0 + 9 - 0.4 = 8.6      A1 = 8.6 + 0.5 * -4.1   = 6.55
    # d0 = 0 + 0.4 - 0.2 = 0.2    A0 = 0.2 + 0.5 * 6.55   = 3.475
    # returns: 3.475 + 0.2 = 3.675, 6.55 + 0.4 = 6.95, 0.4 + 0.6 = 1.0
    adv, ret = gae(REWARDS, VALUES, MASK, gamma=1.0, lam=0.5, skip_observations=False)
    close(adv, [[3.475, 6.55, 0.0, 0.0, 0.4]], atol=1e-5)
    close(ret, [[3.675, 6.95, 0.0, 0.0, 1.0]], atol=1e-5)
    skip, _ = gae(REWARDS, VALUES, MASK, gamma=1.0, lam=0.5)
    assert not torch.allclose(adv, skip)


def test_naive_equals_skip_at_gamma_lambda_1():
    # gamma = lam = 1: both telescope to the Monte-Carlo advantage sum(r after t) - V_t.
    adv, ret = gae(REWARDS, VALUES, MASK, gamma=1.0, lam=1.0, skip_observations=False)
    close(adv, [[0.8, 0.6, 0.0, 0.0, 0.4]])
    close(ret, [[1.0, 1.0, 0.0, 0.0, 1.0]])


def test_no_observation_is_textbook_gae_hand():
    # actions 0, 1, 2; V = 0.5, 0.25, 0.5; reward 1 on 2; gamma 1, lam 0.5
    # d2 = 1 - 0.5 = 0.5            A2 = 0.5
    # d1 = 0.5 - 0.25 = 0.25        A1 = 0.25 + 0.25  = 0.5
    # d0 = 0.25 - 0.5 = -0.25       A0 = -0.25 + 0.25 = 0.0
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.25, 0.5]])
    m = torch.ones(1, 3)
    for skip in (True, False):
        adv, ret = gae(r, v, m, gamma=1.0, lam=0.5, skip_observations=skip)
        close(adv, [[0.0, 0.5, 0.5]])
        close(ret, [[0.5, 0.75, 1.0]])


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9), (0.5, 0.0)])
def test_no_observation_matches_verl_loop(gamma, lam):
    g = torch.Generator().manual_seed(0)
    r = torch.randn(4, 9, generator=g, dtype=torch.float64)
    v = torch.randn(4, 9, generator=g, dtype=torch.float64)
    m = torch.ones(4, 9, dtype=torch.bool)
    exp_adv, exp_ret = verl_textbook_gae(r, v, gamma, lam)
    for skip in (True, False):
        adv, ret = gae(r, v, m, gamma=gamma, lam=lam, skip_observations=skip)
        assert adv.dtype == torch.float64
        torch.testing.assert_close(adv, exp_adv, rtol=0, atol=1e-12)
        torch.testing.assert_close(ret, exp_ret, rtol=0, atol=1e-12)
    adv32, _ = gae(r.float(), v.float(), m, gamma=gamma, lam=lam)
    torch.testing.assert_close(adv32.double(), exp_adv, rtol=0, atol=1e-5)


def test_trajectory_ending_in_observation():
    # actions 0, 1; observations 2, 3 (the episode ended on a tool output); reward 1 on 1.
    # V = 0.5, 0.25, 7, 7; gamma 1, lam 0.5. Skip: token 1 is terminal.
    # d1 = 1 - 0.25 = 0.75   A1 = 0.75
    # d0 = 0.25 - 0.5 = -0.25  A0 = -0.25 + 0.5 * 0.75 = 0.125
    r = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    v = torch.tensor([[0.5, 0.25, 7.0, 7.0]])
    m = torch.tensor([[1, 1, 0, 0]])
    adv, ret = gae(r, v, m, gamma=1.0, lam=0.5)
    close(adv, [[0.125, 0.75, 0.0, 0.0]])
    close(ret, [[0.625, 1.0, 0.0, 0.0]])
    # Naive, default valid_mask: trailing observations count as padding -> same numbers.
    naive, _ = gae(r, v, m, gamma=1.0, lam=0.5, skip_observations=False)
    close(naive, [[0.125, 0.75, 0.0, 0.0]])
    # Naive with valid_mask covering the trailing observations: chain 0 -> 1 -> 2 -> 3.
    # d3 = 0 - 7 = -7             A3 = -7
    # d2 = 7 - 7 = 0              A2 = 0 + 0.5 * -7   = -3.5
    # d1 = 1 + 7 - 0.25 = 7.75    A1 = 7.75 - 1.75    = 6.0
    # d0 = 0.25 - 0.5 = -0.25     A0 = -0.25 + 3.0    = 2.75
    naive, ret = gae(r, v, m, gamma=1.0, lam=0.5, skip_observations=False,
                     valid_mask=torch.ones(1, 4))
    close(naive, [[2.75, 6.0, 0.0, 0.0]])
    close(ret, [[3.25, 6.25, 0.0, 0.0]])
    # valid_mask is ignored by the skip variant.
    skip, _ = gae(r, v, m, gamma=1.0, lam=0.5, valid_mask=torch.ones(1, 4))
    close(skip, [[0.125, 0.75, 0.0, 0.0]])


def test_empty_rows_give_zeros_without_nan():
    r = torch.zeros(2, 4)
    v = torch.tensor([[NAN, 1.0, float("inf"), 3.0], [0.5, 0.5, 0.5, 0.5]])
    m = torch.tensor([[0, 0, 0, 0], [1, 1, 0, 0]])
    for skip in (True, False):
        adv, ret = gae(r, v, m, gamma=1.0, lam=0.9, skip_observations=skip)
        assert torch.equal(adv[0], torch.zeros(4)) and torch.equal(ret[0], torch.zeros(4))
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
        # row 1: d1 = -0.5, A1 = -0.5; d0 = 0.5 - 0.5 = 0, A0 = 0.9 * -0.5 = -0.45
        close(adv[1], [-0.45, -0.5, 0.0, 0.0])
    for shape in [(0, 5), (3, 0), (0, 0)]:
        adv, ret = gae(torch.zeros(shape), torch.zeros(shape), torch.zeros(shape), gamma=1.0,
                       lam=1.0, skip_observations=False)
        assert adv.shape == ret.shape == shape


def test_right_padded_batch_of_different_lengths():
    # gamma 1, lam 0.5. Row 0: 3 actions then 2 padding tokens (garbage values there).
    #   V = 0.1, 0.2, 0.3; r2 = 1. d2 = 0.7, A2 = 0.7; d1 = 0.1, A1 = 0.1 + 0.35 = 0.45;
    #   d0 = 0.1, A0 = 0.1 + 0.225 = 0.325
    # Row 1: 5 actions, V = 0.5 each, r4 = -1. d4 = -1.5, A4 = -1.5; d3..d0 = 0, so
    #   A3 = -0.75, A2 = -0.375, A1 = -0.1875, A0 = -0.09375
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, -1.0]])
    v = torch.tensor([[0.1, 0.2, 0.3, 50.0, NAN], [0.5] * 5])
    m = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    expected = [[0.325, 0.45, 0.7, 0.0, 0.0], [-0.09375, -0.1875, -0.375, -0.75, -1.5]]
    for skip in (True, False):
        adv, ret = gae(r, v, m, gamma=1.0, lam=0.5, skip_observations=skip)
        close(adv, expected)
        close(ret[0], [0.425, 0.65, 1.0, 0.0, 0.0])
        # each row alone gives the same numbers (rows are independent)
        for b in range(2):
            one, _ = gae(r[b:b + 1], v[b:b + 1], m[b:b + 1], gamma=1.0, lam=0.5,
                         skip_observations=skip)
            assert torch.equal(one[0], adv[b])


def test_gamma_below_one_skips_observation():
    # actions 0, 2; observation 1 (V = 100, never read); r2 = 1; gamma 0.9, lam 0.8.
    # d2 = 1 - 0.5 = 0.5                       A2 = 0.5
    # d0 = 0 + 0.9 * V2 - V0 = 0.45 - 0.5 = -0.05  A0 = -0.05 + 0.9 * 0.8 * 0.5 = 0.31
    # (the discount is per chain step: the skipped observation costs no extra gamma)
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 100.0, 0.5]])
    m = torch.tensor([[1, 0, 1]])
    adv, ret = gae(r, v, m, gamma=0.9, lam=0.8)
    close(adv, [[0.31, 0.0, 0.5]])
    close(ret, [[0.81, 0.0, 1.0]])


def test_lambda_per_row_tensor():
    # Two copies of the SAO example with lam = (1, 0.5) give the two hand-computed rows.
    r, v, m = REWARDS.repeat(2, 1), VALUES.repeat(2, 1), MASK.repeat(2, 1)
    adv, _ = gae(r, v, m, gamma=1.0, lam=torch.tensor([1.0, 0.5]))
    close(adv, [[0.8, 0.6, 0.0, 0.0, 0.4], [0.4, 0.4, 0.0, 0.0, 0.4]])


@pytest.mark.parametrize("skip", [True, False])
def test_random_batches_match_reference(skip):
    g = torch.Generator().manual_seed(1)
    b, t = 6, 12
    action = torch.rand(b, t, generator=g) < 0.6
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    valid = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    action &= valid
    r = torch.where(action, torch.randn(b, t, generator=g, dtype=torch.float64), 0.0)
    v = torch.randn(b, t, generator=g, dtype=torch.float64)
    lam = torch.rand(b, generator=g, dtype=torch.float64)
    adv, ret = gae(r, v, action, gamma=0.97, lam=lam, skip_observations=skip, valid_mask=valid)
    exp_adv, exp_ret = reference_gae(r, v, action if skip else valid, action, 0.97, lam)
    torch.testing.assert_close(adv, exp_adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, exp_ret, rtol=0, atol=1e-12)


def test_low_precision_inputs_compute_in_float32():
    adv, ret = gae(REWARDS.bfloat16(), VALUES.bfloat16(), MASK.bool(), gamma=1.0, lam=1.0)
    assert adv.dtype == ret.dtype == torch.float32
    close(adv, [[0.8, 0.6, 0.0, 0.0, 0.4]], atol=1e-2)


def test_gae_errors():
    with pytest.raises(ValueError, match=r"values must have the shape of action_mask"):
        gae(REWARDS, VALUES[:, :4], MASK, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"action_mask must be a tensor of shape \[B, T\]"):
        gae(REWARDS, VALUES, MASK[0], gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"rewards must be a floating"):
        gae(REWARDS.long(), VALUES, MASK, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"rewards must be exactly 0 outside action_mask"):
        gae(torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]]), VALUES, MASK, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\]"):
        gae(REWARDS, VALUES, MASK, gamma=1.5, lam=1.0)
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\]"):
        gae(REWARDS, VALUES, MASK, gamma=1.0, lam=-0.1)
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\]"):
        gae(REWARDS, VALUES, MASK, gamma=1.0, lam=torch.tensor([NAN]))
    with pytest.raises(ValueError, match=r"lam tensor must have shape \[B\] = \[1\]"):
        gae(REWARDS, VALUES, MASK, gamma=1.0, lam=torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match=r"valid_mask must be non-zero on every action"):
        gae(REWARDS, VALUES, MASK, gamma=1.0, lam=1.0, skip_observations=False,
            valid_mask=torch.tensor([[1, 1, 1, 1, 0]]))
    with pytest.raises(ValueError, match=r"valid_mask must have the shape"):
        gae(REWARDS, VALUES, MASK, gamma=1.0, lam=1.0, valid_mask=torch.ones(1, 4))


def test_decoupled_gae():
    # policy lam 0.5 -> advantages (0.4, 0.4, 0, 0, 0.4); critic lam 1 -> returns (1, 1, 0, 0, 1)
    adv, ret = decoupled_gae(REWARDS, VALUES, MASK, gamma=1.0, policy_lam=0.5)
    close(adv, [[0.4, 0.4, 0.0, 0.0, 0.4]])
    close(ret, [[1.0, 1.0, 0.0, 0.0, 1.0]])


# ------------------------------------------------------------------------------------------
# adaptive_lambda
# ------------------------------------------------------------------------------------------


def test_adaptive_lambda_sao_alpha():
    # alpha 1.5: l = 1 -> 1 - 1/1.5 = 1/3; l = 2 -> 1 - 1/3 = 2/3; l = 10 -> 1 - 1/15 = 14/15;
    # l = 0 -> 0; l = 1000 -> 1 - 1/1500
    lam = adaptive_lambda(torch.tensor([1, 2, 10, 0, 1000]), alpha=1.5)
    assert lam.dtype == torch.float32
    close(lam, [1 / 3, 2 / 3, 14 / 15, 0.0, 1 - 1 / 1500])


def test_adaptive_lambda_vapo_alpha_clamps():
    # alpha 0.05: l = 10 -> 1 - 1/0.5 = -1 -> 0; l = 20 -> 1 - 1/1 = 0; l = 100 -> 1 - 1/5 = 0.8
    lam = adaptive_lambda(torch.tensor([10.0, 20.0, 100.0, 0.0]), alpha=0.05)
    close(lam, [0.0, 0.0, 0.8, 0.0])
    assert torch.isfinite(lam).all()


def test_adaptive_lambda_feeds_gae():
    # SAO example has 3 action tokens: lam = 1 - 1/(1.5 * 3) = 7/9.
    # A4 = 0.4; A1 = 0.2 + 7/9 * 0.4 = 0.5111111; A0 = 0.2 + 7/9 * A1 = 0.5975309
    lam = adaptive_lambda(MASK.sum(-1), alpha=1.5)
    close(lam, [7 / 9])
    adv, _ = gae(REWARDS, VALUES, MASK, gamma=1.0, lam=lam)
    a1 = 0.2 + 7 / 9 * 0.4
    close(adv, [[0.2 + 7 / 9 * a1, a1, 0.0, 0.0, 0.4]])


def test_adaptive_lambda_errors():
    for alpha in (0.0, -1.0, NAN):
        with pytest.raises(ValueError, match="alpha must be > 0"):
            adaptive_lambda(torch.tensor([3]), alpha=alpha)
    with pytest.raises(ValueError, match=r"lengths must be finite and >= 0"):
        adaptive_lambda(torch.tensor([-1]), alpha=1.5)
    with pytest.raises(ValueError, match=r"lengths must be a tensor of shape \[B\]"):
        adaptive_lambda(torch.ones(2, 2), alpha=1.5)


# ------------------------------------------------------------------------------------------
# segments and turn-level GAE
# ------------------------------------------------------------------------------------------


def test_segments():
    assert segments(torch.tensor([1, 1, 0, 0, 1])) == [(0, 2), (4, 5)]
    assert segments(torch.tensor([0, 1, 0, 1, 1, 0])) == [(1, 2), (3, 5)]
    assert segments(torch.tensor([0, 0])) == []
    assert segments(torch.tensor([], dtype=torch.bool)) == []
    with pytest.raises(ValueError, match="action_mask_row"):
        segments(torch.ones(1, 3))


# Two turns: turn 0 = tokens 0, 1 (reward 0.5 on 1), observations 2, 3, turn 1 = tokens 4, 5
# (reward 1 on 5). Turn values are read at the first token: V_0 = 0.3, V_1 = 0.6 (99 and 9
# elsewhere are never read).
TURN_R = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.0, 1.0, 0.0]])
TURN_V = torch.tensor([[0.3, 99.0, 9.0, 9.0, 0.6, 99.0, NAN]])
TURN_M = torch.tensor([[1, 1, 0, 0, 1, 1, 0]])


def test_turn_level_gae_two_turns():
    # gamma 1, lam 1: d_1 = 1 - 0.6 = 0.4, A_1 = 0.4; d_0 = 0.5 + 0.6 - 0.3 = 0.8,
    # A_0 = 0.8 + 0.4 = 1.2; returns A + V: 1.5 and 1.0 on every token of the turn.
    adv, ret = turn_level_gae(TURN_R, TURN_V, TURN_M, gamma=1.0, lam=1.0)
    close(adv, [[1.2, 1.2, 0.0, 0.0, 0.4, 0.4, 0.0]])
    close(ret, [[1.5, 1.5, 0.0, 0.0, 1.0, 1.0, 0.0]])
    # lam 0.5: A_0 = 0.8 + 0.5 * 0.4 = 1.0; gamma 0.9, lam 1: d_0 = 0.5 + 0.54 - 0.3 = 0.74,
    # A_0 = 0.74 + 0.9 * 0.4 = 1.1
    adv, _ = turn_level_gae(TURN_R, TURN_V, TURN_M, gamma=1.0, lam=0.5)
    close(adv, [[1.0, 1.0, 0.0, 0.0, 0.4, 0.4, 0.0]])
    adv, ret = turn_level_gae(TURN_R, TURN_V, TURN_M, gamma=0.9, lam=torch.tensor([1.0]))
    close(adv, [[1.1, 1.1, 0.0, 0.0, 0.4, 0.4, 0.0]])
    close(ret, [[1.4, 1.4, 0.0, 0.0, 1.0, 1.0, 0.0]])


def test_turn_level_differs_from_token_level():
    # Token level reads V at token 1 (99): A1 = 0.5 + V4 - V1 + A4 = 0.5 + 0.6 - 99 + 0.4
    tok, _ = gae(TURN_R, TURN_V, TURN_M, gamma=1.0, lam=1.0)
    close(tok[0, 1:2], [0.5 + 0.6 - 99.0 + 0.4], atol=1e-4)
    turn, _ = turn_level_gae(TURN_R, TURN_V, TURN_M, gamma=1.0, lam=1.0)
    assert not torch.allclose(tok, turn)


def test_turn_level_batch_and_empty():
    # Row 1 is empty; row 2 is one turn (tokens 1..2), V_0 = 0.25, R_0 = 1 + 2 = 3 -> A = 2.75.
    r = torch.cat([TURN_R, torch.zeros(1, 7), torch.tensor([[0.0, 1.0, 2.0, 0, 0, 0, 0]])])
    v = torch.cat([TURN_V, torch.full((1, 7), NAN), torch.tensor([[5.0, 0.25, 7.0, 0, 0, 0, 0]])])
    m = torch.cat([TURN_M, torch.zeros(1, 7, dtype=torch.long),
                   torch.tensor([[0, 1, 1, 0, 0, 0, 0]])])
    adv, ret = turn_level_gae(r, v, m, gamma=1.0, lam=1.0)
    close(adv[0], [1.2, 1.2, 0.0, 0.0, 0.4, 0.4, 0.0])
    close(adv[1], [0.0] * 7)
    close(adv[2], [0.0, 2.75, 2.75, 0.0, 0.0, 0.0, 0.0])
    close(ret[2], [0.0, 3.0, 3.0, 0.0, 0.0, 0.0, 0.0])
    adv, ret = turn_level_gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3),
                              gamma=1.0, lam=1.0)
    assert torch.equal(adv, torch.zeros(2, 3)) and torch.equal(ret, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="rewards must be exactly 0 outside"):
        turn_level_gae(torch.ones(1, 7), TURN_V, TURN_M, gamma=1.0, lam=1.0)


# ------------------------------------------------------------------------------------------
# whiten
# ------------------------------------------------------------------------------------------


def test_whiten():
    # masked tokens 1, 2, 3: mean 2, unbiased var ((1 + 0 + 1) / 2) = 1 -> (-1, 0, 1) / sqrt(1 + 1e-8)
    a = torch.tensor([[1.0, 2.0, NAN], [3.0, 100.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    s = 1 / math.sqrt(1 + 1e-8)
    close(whiten(a, m), [[-s, 0.0, 0.0], [s, 0.0, 0.0]])
    close(whiten(a, m, shift_mean=False), [[2 - s, 2.0, 0.0], [2 + s, 0.0, 0.0]])
    # one token or none: zeros, no NaN
    assert torch.equal(whiten(a, torch.tensor([[0, 1, 0], [0, 0, 0]])), torch.zeros(2, 3))
    assert torch.equal(whiten(a, torch.zeros(2, 3)), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"advantages and mask must both be tensors"):
        whiten(a, m[:, :2])
    with pytest.raises(ValueError, match=r"eps must be >= 0"):
        whiten(a, m, eps=-1.0)


# ------------------------------------------------------------------------------------------
# sliding-window mean-reward baseline
# ------------------------------------------------------------------------------------------


def test_sliding_window_four_steps():
    # window 3, one reward per step: 1, 0, 1, 1
    # step 1: history []        -> b = 0           A = 1
    # step 2: history [1]       -> b = 1           A = -1
    # step 3: history [1, 0]    -> b = 0.5         A = 0.5
    # step 4: history [1, 0, 1] -> b = 2/3         A = 1/3
    history: list[float] = []
    got = []
    for r in (1.0, 0.0, 1.0, 1.0):
        adv, history = sliding_window_advantages(torch.tensor([r]), history, window=3)
        got.append(adv.item())
    assert got == pytest.approx([1.0, -1.0, 0.5, 1 / 3], abs=ATOL)
    assert history == [0.0, 1.0, 1.0]


def test_sliding_window_several_rewards_per_step():
    # history [1, 1, 0, 0], window 2 -> b = mean(0, 0) = 0 for every reward of this step
    adv, hist = sliding_window_advantages(torch.tensor([1.0, 0.0, 1.0]), [1, 1, 0, 0], 2)
    assert adv.dtype == torch.float32
    close(adv, [1.0, 0.0, 1.0])
    assert hist == [0.0, 1.0]
    adv, _ = sliding_window_advantages(torch.tensor([1, 0], dtype=torch.int64), [0.5], 4)
    close(adv, [0.5, -0.5])
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="window must be an int >= 1"):
            sliding_window_advantages(torch.tensor([1.0]), [], bad)
    with pytest.raises(ValueError, match="rewards must be finite"):
        sliding_window_advantages(torch.tensor([NAN]), [], 3)
    with pytest.raises(ValueError, match=r"rewards must be a real tensor of shape \[N\]"):
        sliding_window_advantages(torch.ones(1, 1), [], 3)


def test_sliding_window_baseline_resume_is_exact():
    steps = [torch.tensor([1.0, 0.0]), torch.tensor([1.0]), torch.tensor([0.0, 0.0, 1.0]),
             torch.tensor([1.0]), torch.tensor([0.25, 0.75])]
    full = SlidingWindowBaseline(window=4)
    expected = [full.advantages(r) for r in steps]
    # step 1: b 0 -> (1, 0); step 2: hist [1, 0], b 0.5 -> 0.5
    close(expected[0], [1.0, 0.0])
    close(expected[1], [0.5])
    first = SlidingWindowBaseline(window=4)
    for r in steps[:3]:
        first.advantages(r)
    state = first.state_dict()
    first.advantages(torch.tensor([5.0]))          # the saved state is a copy
    resumed = SlidingWindowBaseline(window=4)
    resumed.load_state_dict(state)
    for r, exp in zip(steps[3:], expected[3:]):
        assert torch.equal(resumed.advantages(r), exp)
    assert resumed.state_dict() == full.state_dict()
    with pytest.raises(ValueError, match="window"):
        SlidingWindowBaseline(window=2).load_state_dict(state)
    with pytest.raises(ValueError, match="keys"):
        resumed.load_state_dict({"history": []})
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        SlidingWindowBaseline(window=0)


def test_sliding_window_baseline_load_trims_and_copies():
    # a longer saved history is trimmed to the window: [1, 1, 0, 0] -> [0, 0], b = 0
    state = {"window": 2, "history": [1.0, 1.0, 0.0, 0.0]}
    base = SlidingWindowBaseline(window=2)
    base.load_state_dict(state)
    state["history"].append(100.0)                 # the caller's list is not aliased
    assert base.state_dict() == {"window": 2, "history": [0.0, 0.0]}
    close(base.advantages(torch.tensor([1.0])), [1.0])


def test_clamp_values_hand_values_and_errors():
    from conveyor.trainer.gae import clamp_values

    v = torch.tensor([[-0.2, 0.5, 1.3]])
    assert clamp_values(v, None) is v
    assert torch.equal(clamp_values(v, (0.0, 1.0)), torch.tensor([[0.0, 0.5, 1.0]]))
    for bad in ((1.0, 0.0), (0.0, 0.0), (0.0, float("inf"))):
        with pytest.raises(ValueError, match="finite lo < hi"):
            clamp_values(v, bad)


def test_value_bounds_keep_an_unrewarded_response_from_a_positive_advantage(tiny):
    """One response of 3 action tokens, reward 0, V = (-0.2, -0.1, 0.3), gamma 1, lambda 1:
    A_t = R - V_t = (0.2, 0.1, -0.3): the first two tokens are pushed up although the response
    earned nothing. With critic.value_bounds=[0, 1]: V -> (0, 0, 0.3), A = (0, 0, -0.3). The
    returns (lambda 1: R = 0 on every token) are the same either way."""
    from tests.test_critic_training import fixed_values, make_trainer, token_advantages, traj

    trajs = [traj(0, [5, 6, 7], 0.0)]
    for bounds, want in ((None, [0.2, 0.1, -0.3]), ([0.0, 1.0], [0.0, 0.0, -0.3])):
        tr = make_trainer(tiny, critic={"policy_lam": 1.0, "value_bounds": bounds})
        fixed_values(tr, {0: [-0.2, -0.1, 0.3]})
        batch = tr.pack(trajs)
        scores = tr.score(batch)
        tr.assign_advantages(batch, scores)
        assert token_advantages(batch, 0) == pytest.approx(want, abs=1e-6)
        assert scores.returns[0][batch.micro_batches[0].mask > 0].tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-6)


def test_value_bounds_config_errors():
    from conveyor.config import ConfigError, load_config

    assert load_config(None, ["loss.advantage=gae", "rollout.group_size=1", "critic.value_bounds=[0, 1]"]
                       ).critic.value_bounds == (0.0, 1.0)
    with pytest.raises(ConfigError, match=r"critic.value_bounds: .*finite lo < hi"):
        load_config(None, ["loss.advantage=gae", "critic.value_bounds=[1, 0]"])
