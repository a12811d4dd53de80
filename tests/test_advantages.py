"""Hand-computed checks of the outcome-reward advantage estimators."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.trainer.advantages import (
    broadcast_to_tokens,
    grpo_advantages,
    reinforce_baseline_advantages,
)

EPS = 1e-6

# Two groups, interleaved on purpose (members of a group need not be adjacent):
#   group "a": rewards 1, 2, 3 at positions 0, 2, 4
#   group "b": rewards 0, 4    at positions 1, 3
REWARDS = torch.tensor([1.0, 0.0, 2.0, 4.0, 3.0])
GROUPS = ["a", "b", "a", "b", "a"]


def test_grpo_two_groups_unbiased_std():
    # group a: mean 2, centered (-1, 0, 1), unbiased std sqrt((1 + 0 + 1) / (3 - 1)) = 1
    #          -> (-1, 0, 1) / (1 + 1e-6)
    # group b: mean 2, centered (-2, 2), unbiased std sqrt((4 + 4) / (2 - 1)) = sqrt(8)
    #          -> (-2, 2) / (2.8284271 + 1e-6) = (-0.7071065, 0.7071065)
    s8 = math.sqrt(8.0)
    expected = torch.tensor(
        [-1 / (1 + EPS), -2 / (s8 + EPS), 0.0, 2 / (s8 + EPS), 1 / (1 + EPS)]
    )
    adv = grpo_advantages(REWARDS, GROUPS)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)
    assert adv.dtype == torch.float32
    assert adv[1].item() == pytest.approx(-0.7071065, abs=1e-6)


def test_grpo_two_groups_population_std():
    # group a: population std sqrt(2 / 3) = 0.8164966 -> +-1 / 0.8164976 = +-1.2247434
    # group b: population std sqrt(8 / 2) = 2         -> +-2 / 2.000001  = +-0.9999995
    expected = torch.tensor([-1.2247434, -0.9999995, 0.0, 0.9999995, 1.2247434])
    adv = grpo_advantages(REWARDS, GROUPS, unbiased=False)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)


def test_dr_grpo_no_std_division():
    # r - mean_g only: a: (1, 2, 3) - 2 = (-1, 0, 1); b: (0, 4) - 2 = (-2, 2)
    adv = grpo_advantages(REWARDS, GROUPS, scale_by_std=False)
    assert torch.equal(adv, torch.tensor([-1.0, -2.0, 0.0, 2.0, 1.0]))


def test_grpo_tensor_group_ids_match_list_ids():
    ids = torch.tensor([7, -3, 7, -3, 7])
    torch.testing.assert_close(grpo_advantages(REWARDS, ids), grpo_advantages(REWARDS, GROUPS))


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_all_equal_group_is_exactly_zero(scale_by_std):
    # 0.1 is not exactly representable: the float mean of (0.1, 0.1, 0.1) can differ from 0.1 by
    # one ulp, which divided by (std ~ 0) + eps would give ~1e-11 instead of 0. Must be exact 0.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0], dtype=torch.float64)
    adv = grpo_advantages(rewards, [0, 0, 0, 1, 1], scale_by_std=scale_by_std)
    assert torch.equal(adv[:3], torch.zeros(3, dtype=torch.float64))
    assert adv.dtype == torch.float64
    # the other group is unaffected: centered (0.5, -0.5); unbiased std sqrt(0.5) = 0.7071068
    expected_b = 0.5 / (math.sqrt(0.5) + EPS) if scale_by_std else 0.5
    assert adv[3].item() == pytest.approx(expected_b, abs=1e-12)
    assert adv[4].item() == pytest.approx(-expected_b, abs=1e-12)


@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_group_of_one_is_zero(unbiased, scale_by_std):
    # unbiased std of one element divides by G - 1 = 0; must give 0, not NaN, not r
    adv = grpo_advantages(
        torch.tensor([5.0, 1.0, 3.0]), ["solo", "pair", "pair"],
        scale_by_std=scale_by_std, unbiased=unbiased,
    )
    assert adv[0].item() == 0.0
    assert torch.isfinite(adv).all()
    # the pair: centered (-1, 1)
    assert adv[2].item() == pytest.approx(-adv[1].item()) and adv[2].item() > 0


def test_grpo_integer_and_bool_rewards_give_float32():
    # bool rewards (correct / wrong), one group: (1, 0, 0, 1) mean 0.5, centered +-0.5,
    # unbiased std sqrt(4 * 0.25 / 3) = 0.5773503 -> +-0.5 / 0.5773513 = +-0.8660238
    adv = grpo_advantages(torch.tensor([True, False, False, True]), [0, 0, 0, 0])
    assert adv.dtype == torch.float32
    torch.testing.assert_close(
        adv, torch.tensor([0.8660238, -0.8660238, -0.8660238, 0.8660238]), rtol=0, atol=1e-6
    )
    adv_int = grpo_advantages(torch.tensor([2, 4]), [0, 0], scale_by_std=False)
    assert torch.equal(adv_int, torch.tensor([-1.0, 1.0]))


def test_grpo_empty_batch():
    adv = grpo_advantages(torch.zeros(0), [])
    assert adv.shape == (0,) and adv.dtype == torch.float32


def test_grpo_bad_input_raises_naming_argument():
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(REWARDS, ["a", "b"])
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(REWARDS, torch.zeros(5))  # float ids
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(REWARDS, "aabba")
    with pytest.raises(ValueError, match="rewards"):
        grpo_advantages(REWARDS.view(5, 1), GROUPS)
    with pytest.raises(ValueError, match="rewards"):
        grpo_advantages(torch.tensor([1.0, float("nan")]), [0, 0])
    with pytest.raises(ValueError, match="eps"):
        grpo_advantages(REWARDS, GROUPS, eps=-1.0)


finite_f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(st.tuples(finite_f32, st.integers(0, 4)), min_size=1, max_size=24),
    scale_by_std=st.booleans(),
    unbiased=st.booleans(),
)
def test_grpo_property_finite_and_zero_group_sums(data, scale_by_std, unbiased):
    rewards = torch.tensor([r for r, _ in data], dtype=torch.float32)
    if not scale_by_std:
        # reward differences must fit in float32 (documented limit), so stay far below 3.4e38
        rewards = rewards.clamp(-1e30, 1e30)
    ids = [g for _, g in data]
    adv = grpo_advantages(rewards, ids, scale_by_std=scale_by_std, unbiased=unbiased)
    assert adv.shape == rewards.shape
    assert torch.isfinite(adv).all()
    for g in set(ids):
        members = adv[torch.tensor([i == g for i in ids])].double()
        scale = 1.0 + members.abs().max().item()
        assert abs(members.sum().item()) <= 1e-6 * scale * len(members)
        if scale_by_std:
            # a z-score is bounded by sqrt(G - 1) (population std; (G - 1) / sqrt(G) with Bessel)
            assert members.abs().max().item() <= math.sqrt(max(len(members) - 1, 0)) + 1e-4


def test_reinforce_baseline_hand_values():
    # mean of (1, 2, 6) = 3 -> (-2, -1, 3)
    assert torch.equal(
        reinforce_baseline_advantages(torch.tensor([1.0, 2.0, 6.0])), torch.tensor([-2.0, -1.0, 3.0])
    )


def test_reinforce_baseline_single_and_empty():
    assert torch.equal(reinforce_baseline_advantages(torch.tensor([0.7])), torch.tensor([0.0]))
    assert reinforce_baseline_advantages(torch.zeros(0)).shape == (0,)
    with pytest.raises(ValueError, match="rewards"):
        reinforce_baseline_advantages(torch.ones(2, 2))


def test_broadcast_to_tokens():
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    out = broadcast_to_tokens(adv, mask)
    assert torch.equal(out, torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))
    assert out.dtype == torch.float32
    with pytest.raises(ValueError, match="mask"):
        broadcast_to_tokens(adv, torch.ones(3, 4))
    with pytest.raises(ValueError, match="adv"):
        broadcast_to_tokens(adv.view(2, 1), mask)
