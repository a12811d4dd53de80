"""Hand-computed checks of AsyPPO's mini-critic ensemble (conveyor.trainer.ensemble; issue 13)."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.trainer.ensemble import (
    critic_sample_masks,
    ensemble_stats,
    index_in_group,
    shard_of,
    uncertainty_counts,
    uncertainty_masks,
)

NAN = float("nan")


def close(actual, expected, atol=1e-6):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol)


# ====================================================================== sharding


def test_shard_of_is_j_mod_n():
    # N = 2: responses 0, 2, 4 -> critic 0; 1, 3, 5 -> critic 1.  N = 3: 0,1,2,3,4 -> 0,1,2,0,1.
    assert [shard_of(j, 2) for j in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [shard_of(j, 3) for j in range(5)] == [0, 1, 2, 0, 1]
    assert [shard_of(j, 1) for j in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("args, name", [((-1, 2), "index_in_group"), ((0, 0), "n_critics"),
                                        ((1.0, 2), "index_in_group"), ((0, True), "n_critics")])
def test_shard_of_rejects_bad_arguments(args, name):
    with pytest.raises(ValueError, match=name):
        shard_of(*args)


def test_index_in_group_counts_in_batch_order():
    # "a" at 0, 2, 3 -> 0, 1, 2; "b" at 1, 4 -> 0, 1 (groups need not be contiguous).
    assert index_in_group(["a", "b", "a", "a", "b"]).tolist() == [0, 0, 1, 2, 1]
    assert index_in_group(torch.tensor([7, 7, 3, 7])).tolist() == [0, 1, 0, 2]
    assert index_in_group([]).tolist() == []


def test_critic_sample_masks_disjoint_shards():
    # Two prompts of 4 responses, contiguous: j = 0,1,2,3,0,1,2,3 -> critic j mod 2.
    masks = critic_sample_masks(["p", "p", "p", "p", "q", "q", "q", "q"], 2)
    assert masks.dtype == torch.bool and masks.shape == (2, 8)
    assert masks[0].tolist() == [True, False, True, False, True, False, True, False]
    assert masks[1].tolist() == [False, True, False, True, False, True, False, True]
    # interleaved: p q p q p -> j = 0 0 1 1 2 -> critics 0 0 1 1 0
    masks = critic_sample_masks(["p", "q", "p", "q", "p"], 2)
    assert masks[0].tolist() == [True, True, False, False, True]
    # every response in exactly one shard
    assert masks.sum(0).tolist() == [1, 1, 1, 1, 1]
    # N = 3 with groups of 2: critic 2 gets nothing
    masks = critic_sample_masks(torch.tensor([0, 0, 1, 1]), 3)
    assert masks.sum(1).tolist() == [2, 2, 0]


def test_index_in_group_rejects_bad_ids():
    with pytest.raises(ValueError, match="group_ids"):
        index_in_group(torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match="group_ids"):
        index_in_group("abc")
    with pytest.raises(ValueError, match="n_critics"):
        critic_sample_masks(["a"], 0)


# ====================================================================== ensemble_stats


def test_ensemble_stats_population_std_and_mask():
    # critic 0: [1, 2, 9], critic 1: [3, 2, NaN]; mask [1, 1, 0]
    # token 0: mean 2, std sqrt(((1-2)^2 + (3-2)^2) / 2) = 1 (population; sample std would be 1.414)
    # token 1: mean 2, std 0; token 2: off mask -> 0, 0 (the NaN is never read)
    values = torch.tensor([[[1.0, 2.0, 9.0]], [[3.0, 2.0, NAN]]])
    mean, std = ensemble_stats(values, torch.tensor([[1, 1, 0]]))
    close(mean, [[2.0, 2.0, 0.0]])
    close(std, [[1.0, 0.0, 0.0]])
    assert mean.dtype == torch.float32


def test_ensemble_stats_three_critics_and_single_critic():
    # values 0, 3, 6: mean 3, population std sqrt((9 + 0 + 9) / 3) = sqrt(6)
    values = torch.tensor([0.0, 3.0, 6.0], dtype=torch.float64).view(3, 1, 1)
    mean, std = ensemble_stats(values, torch.ones(1, 1))
    assert mean.dtype == torch.float64
    assert mean.item() == 3.0 and std.item() == pytest.approx(math.sqrt(6), abs=1e-12)
    # one critic: std 0, not NaN
    mean, std = ensemble_stats(torch.tensor([[[0.5, 0.25]]]), torch.ones(1, 2))
    close(mean, [[0.5, 0.25]])
    close(std, [[0.0, 0.0]])


def test_ensemble_stats_rejects_bad_shapes():
    with pytest.raises(ValueError, match="values"):
        ensemble_stats(torch.zeros(2, 1, 3), torch.ones(1, 2))
    with pytest.raises(ValueError, match="values"):
        ensemble_stats(torch.zeros(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="values"):
        ensemble_stats(torch.zeros(2, 1, 2, dtype=torch.long), torch.ones(1, 2))
    with pytest.raises(ValueError, match="mask"):
        ensemble_stats(torch.zeros(2, 1, 2), torch.ones(2))


# ====================================================================== uncertainty_masks


def test_issue_example_two_critics_ten_tokens():
    # Issue 13: critic 1 gives V = 0, critic 2 gives V = 0.1, 0.2, ..., 1.0 on 10 tokens.
    # std_t = |0 - V2_t| / 2 = 0.05, 0.10, ..., 0.50 (strictly increasing).
    # n = 10: floor(0.1 * 10) = 1 lowest -> token 0 loses its advantage;
    #         floor(0.2 * 10) = 2 highest -> tokens 8, 9 leave the entropy bonus.
    v2 = torch.arange(1, 11, dtype=torch.float32) / 10
    values = torch.stack([torch.zeros(1, 10), v2.view(1, 10)])
    mask = torch.ones(1, 10)
    mean, std = ensemble_stats(values, mask)
    close(std, v2.view(1, 10) / 2)
    close(mean, v2.view(1, 10) / 2)
    adv_keep, ent_keep = uncertainty_masks(std, mask)
    assert adv_keep.dtype == torch.float32
    assert adv_keep.tolist() == [[0.0] + [1.0] * 9]
    assert ent_keep.tolist() == [[1.0] * 8 + [0.0, 0.0]]
    assert uncertainty_counts(10) == (1, 2)


def test_counts_use_floor_and_exact_decimals():
    # floor: 9 tokens -> floor(0.9) = 0 and floor(1.8) = 1; 25 tokens -> 2 and 5
    assert uncertainty_counts(9) == (0, 1)
    assert uncertainty_counts(25) == (2, 5)
    assert uncertainty_counts(0) == (0, 0)
    # 0.29 * 100 == 28.999999999999996 in floats; exact decimal arithmetic gives 29
    assert 0.29 * 100 < 29
    assert uncertainty_counts(100, low_frac=0.29, high_frac=0.57) == (29, 57)
    assert uncertainty_counts(7, low_frac=1, high_frac=0.0) == (7, 0)


def test_batch_wide_selection_across_rows():
    # Two rows, 5 tokens each, all on mask -> n = 10: 1 lowest, 2 highest over the BATCH.
    # Row 0 std: 5 6 7 8 9; row 1 std: 0.5 1 2 3 4 -> lowest is (1, 0); highest (0, 3), (0, 4).
    std = torch.tensor([[5.0, 6.0, 7.0, 8.0, 9.0], [0.5, 1.0, 2.0, 3.0, 4.0]])
    adv, ent = uncertainty_masks(std, torch.ones(2, 5))
    assert adv.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]
    assert ent.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]


def test_ties_broken_by_flat_position_one_total_order():
    # All 10 std equal: order is by flat position (row-major). Lowest 1 = the first token
    # (row 0, t 0); highest 2 = the last two (row 1, t 3 and t 4).
    std = torch.full((2, 5), 0.3)
    adv, ent = uncertainty_masks(std, torch.ones(2, 5))
    assert adv.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert ent.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # Partial tie: std 0 at positions 3, 5, 7 (tied lowest), 1 elsewhere; low_frac 0.2 of 10 = 2:
    # the two earliest tied positions 3 and 5 are taken, 7 is not.
    # Highest 2: std 1 at 0,1,2,4,6,8,9 tied -> the two latest, 8 and 9.
    std = torch.ones(1, 10)
    std[0, [3, 5, 7]] = 0.0
    adv, ent = uncertainty_masks(std, torch.ones(1, 10), low_frac=0.2, high_frac=0.2)
    assert [i for i in range(10) if adv[0, i] == 0] == [3, 5]
    assert [i for i in range(10) if ent[0, i] == 0] == [8, 9]


def test_masked_positions_never_selected_and_do_not_count():
    # 12 positions, mask off at 0 (std -1: would be the lowest) and 11 (std 99: the highest),
    # so n = 10 and the counts are 1 and 2 over the on-mask std 0.1 .. 1.0 at positions 1..10.
    std = torch.tensor([[-1.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 99.0]])
    mask = torch.ones(1, 12)
    mask[0, 0] = mask[0, 11] = 0
    adv, ent = uncertainty_masks(std, mask)
    # keep is 0 off mask (a valid token mask), 0 on the selected token(s)
    assert adv.tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0]]
    assert ent.tolist() == [[0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]]
    # NaN off mask is ignored
    std[0, 0] = NAN
    adv2, ent2 = uncertainty_masks(std, mask)
    assert torch.equal(adv, adv2) and torch.equal(ent, ent2)


def test_fractions_zero_keep_every_action_token():
    std = torch.tensor([[0.3, 0.1, 0.2]])
    mask = torch.tensor([[1, 1, 0]])
    adv, ent = uncertainty_masks(std, mask, low_frac=0.0, high_frac=0.0)
    assert adv.tolist() == [[1, 1, 0]] and ent.tolist() == [[1, 1, 0]]


def test_empty_mask_gives_zeros():
    adv, ent = uncertainty_masks(torch.rand(2, 3), torch.zeros(2, 3))
    assert adv.tolist() == [[0] * 3] * 2 and ent.tolist() == [[0] * 3] * 2
    adv, ent = uncertainty_masks(torch.zeros(0, 4), torch.zeros(0, 4))
    assert adv.shape == (0, 4) and ent.shape == (0, 4)


def test_float64_std_keeps_dtype():
    adv, ent = uncertainty_masks(torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2))
    assert adv.dtype == torch.float64 and ent.dtype == torch.float64


def test_masks_compose_with_entropy_bonus_and_advantages():
    # entropy_bonus(entropy, mask, token_weights=entropy_keep) drops tokens 8 and 9:
    # sum of entropy 1..10 = 55 minus 9 + 10 -> 36.
    from conveyor.trainer.losses import entropy_bonus

    std = torch.arange(1, 11, dtype=torch.float32).view(1, 10) / 20
    mask = torch.ones(1, 10)
    adv_keep, ent_keep = uncertainty_masks(std, mask)
    entropy = torch.arange(1, 11, dtype=torch.float32).view(1, 10)
    assert entropy_bonus(entropy, mask, token_weights=ent_keep).item() == 36.0
    assert (torch.ones(1, 10) * adv_keep).sum().item() == 9.0


@pytest.mark.parametrize("kwargs, name", [
    ({"low_frac": -0.1}, "low_frac"), ({"low_frac": 1.5}, "low_frac"),
    ({"high_frac": NAN}, "high_frac"), ({"high_frac": float("inf")}, "high_frac"),
    ({"low_frac": "0.1"}, "low_frac"), ({"high_frac": True}, "high_frac"),
])
def test_invalid_fractions_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        uncertainty_masks(torch.zeros(1, 10), torch.ones(1, 10), **kwargs)
    with pytest.raises(ValueError, match=name):
        uncertainty_counts(10, **kwargs)


def test_invalid_std_and_mask():
    with pytest.raises(ValueError, match="std"):
        uncertainty_masks(torch.zeros(1, 3), torch.ones(1, 2))
    with pytest.raises(ValueError, match="std"):
        uncertainty_masks(torch.tensor([[0.0, NAN]]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="mask"):
        uncertainty_masks(torch.zeros(2), torch.ones(2))
    with pytest.raises(ValueError, match="n_tokens"):
        uncertainty_counts(-1)
