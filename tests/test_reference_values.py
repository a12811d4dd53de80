"""conveyor against the field's reference implementations (issue 10, section 4b).

Every expected number in this module was computed BY THE REFERENCE IMPLEMENTATION: the named
function's source, taken verbatim (``ast`` by name, decorators dropped) from ``git show
<commit>:<path>`` of the repository at the commit below, executed on CPU (torch float32) on the
fixed inputs written here. Only the printed values are kept here, never the reference code.
Stubs replaced only what the functions import but do not compute with on one process
(``verl_F.masked_sum`` / ``masked_mean`` were loaded from ``verl/utils/torch_functional.py``
itself; distributed all-reduce is off; verl's ``ActorConfig`` was a dict with the fields read).

Sources (repository @ commit, file):

* VERL = ``verl-project/verl@1dda039b9c6311889a9c9a26040677e1254814f9`` (2026-08-22)
* VERL_GEO = ``verl-project/verl@9b718e1a7e55fbd974ae13a543e9e6cb89f1f735`` (2026-01-14, the
  last commit whose ``compute_rollout_rejection_mask`` has ``rollout_rs="geometric"``; later
  commits express it as ``seq_mean_k1``, which gives the same masks here)
* AREAL = ``inclusionAI/AReaL@4aef98d8d818af55b43621aaadba047ae10f4e77`` (2026-05-21)
* TRL = ``huggingface/trl@f2cd57710ae345ea6428ae95363267fcf38a3dc8`` (2026-07-24)

Where conveyor follows a different documented convention the test says so and asserts the
conveyor value derived from the reference value by that convention. Tolerances are float32
rounding (1e-6).
"""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.rollout.staleness import StalenessManager
from conveyor.trainer import corrections as C
from conveyor.trainer import losses as L
from conveyor.trainer.advantages import grpo_advantages

TOL = {"rel": 1e-6, "abs": 1e-6}


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def close(got, expected) -> None:
    got = got.flatten().tolist() if isinstance(got, torch.Tensor) else list(got)
    assert got == pytest.approx(list(expected), **TOL)


# ------------------------------------------------------------------ GRPO / Dr. GRPO advantages
# VERL verl/trainer/ppo/core_algos.py::compute_grpo_outcome_advantage(
#   token_level_rewards=r[:, None], response_mask=1, index, epsilon=1e-6,
#   norm_adv_by_std_in_grpo=True / False)
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 2.0, 3.5, 1.0, 1.0, 0.7]
GROUPS = ["a", "a", "a", "a", "b", "b", "b", "c", "c", "d"]
VERL_GRPO = [
    0.8660238981246948,
    -0.8660238981246948,
    -0.8660238981246948,
    0.8660238981246948,
    -0.9999993443489075,
    0.0,
    0.9999993443489075,
    0.0,
    0.0,
    0.6999993324279785,
]
VERL_DR_GRPO = [0.5, -0.5, -0.5, 0.5, -1.5, 0.0, 1.5, 0.0, 0.0, 0.699999988079071]


@pytest.mark.parametrize(("scale_by_std", "expected"), [(True, VERL_GRPO), (False, VERL_DR_GRPO)])
def test_grpo_and_dr_grpo_advantages_match_verl(scale_by_std, expected):
    adv = grpo_advantages(t(REWARDS), GROUPS, scale_by_std=scale_by_std, eps=1e-6)
    close(adv[:9], expected[:9])
    # convention (conveyor/trainer/advantages.py): a group of one response ("d") has no group
    # baseline and gets 0; verl uses mean 0, std 1 there, i.e. A = r.
    assert expected[9] == pytest.approx(REWARDS[9], abs=1e-6) and adv[9] == 0.0


# ------------------------------------------------------------------ PPO clip / decoupled PPO
LOGPROBS = [[-1.0, -0.5, -2.0, -0.1], [-0.3, -1.2, -0.05, -3.0]]
OLD = [[-1.5, -0.4, -1.0, -0.1], [-0.9, -1.0, -2.5, -3.6]]
ADV = [[1.0, 1.0, -1.0, 0.5], [-2.0, -0.5, -1.0, 2.0]]
MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
# VERL core_algos.py::compute_policy_loss_vanilla(old, lp, A, mask, loss_agg_mode="token-mean",
# config: clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0); also AREAL
# areal/utils/functional/functional.py::ppo_actor_loss_fn(lp, proximal=OLD, old=OLD, A,
#   eps_clip=0.2, eps_clip_higher=0.28, c_clip=3.0): the same value.
VERL_PPO_DUAL3 = 0.44410938024520874
VERL_PG_CLIPFRAC = 0.4285714328289032  # actor/pg_clipfrac of the same call
# the same call with clip_ratio_c=1e9 (verl always dual-clips; a huge c turns it off)
VERL_PPO_NO_DUAL = 1.6710160970687866


@pytest.mark.parametrize(
    ("dual_clip", "expected"), [(3.0, VERL_PPO_DUAL3), (None, VERL_PPO_NO_DUAL)]
)
def test_ppo_clip_loss_matches_verl_and_areal(dual_clip, expected):
    out = L.ppo_clip_loss(
        t(LOGPROBS), t(OLD), t(ADV), t(MASK), eps_low=0.2, eps_high=0.28, dual_clip=dual_clip
    )
    assert float(out.loss_sum / out.num_tokens) == pytest.approx(expected, **TOL)
    clipped = out.metrics["clip_low_count"] + out.metrics["clip_high_count"]
    assert float(clipped / out.num_tokens) == pytest.approx(VERL_PG_CLIPFRAC, **TOL)


PROX = [[-1.2, -0.45, -1.5, -0.1], [-0.8, -1.1, -1.0, -3.3]]
BEHAV = [
    [-1.3, -0.4, -3.8, -0.2],
    [-0.7, -1.0, -1.2, -3.0],
]  # token (0, 2): pi_prox/pi_behav = e^2.3 > 5
# AREAL functional.py::ppo_actor_loss_fn(lp, PROX, BEHAV, A, eps_clip=0.2, eps_clip_higher=0.28,
# c_clip=None, rejection_sampling=RejectionSamplingConfig(level="token", metric="ratio", upper=5.0,
# action="mask" / "clamp")) -- the replacement of behav_imp_weight_cap / behav_imp_weight_mode
AREAL_DECOUPLED = {"mask": 0.3428594768047333, "clamp": 0.9142881035804749}


@pytest.mark.parametrize("cap_mode", ["mask", "clamp"])
def test_decoupled_ppo_loss_matches_areal(cap_mode):
    out = L.decoupled_ppo_loss(
        t(LOGPROBS),
        t(PROX),
        t(BEHAV),
        t(ADV),
        t(MASK),
        eps_low=0.2,
        eps_high=0.28,
        behaviour_weight_cap=5.0,
        cap_mode=cap_mode,
    )
    assert float(out.loss_sum / out.num_tokens) == pytest.approx(AREAL_DECOUPLED[cap_mode], **TOL)


# ------------------------------------------------------------------ the four aggregation modes
AGG_LOSS = [[1.0, 2.0, 0.0, 0.0], [3.0, 4.0, 5.0, 6.0], [-1.0, 0.5, 2.0, 0.0]]
AGG_MASK = [[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]]
# VERL core_algos.py::agg_loss(loss_mat, loss_mask, mode); conveyor's `constant` (Dr. GRPO) is
# verl's "seq-mean-token-sum-norm" with loss_scale_factor = the constant (8 tokens here)
VERL_AGG = {
    "token_mean": 2.5,
    "seq_mean_token_mean": 2.1666667461395264,
    "seq_mean_token_sum": 7.5,
    "constant": 0.9375,
}


@pytest.mark.parametrize("mode", C.AGGREGATIONS)
@pytest.mark.parametrize("packed", [False, True])
def test_aggregation_modes_match_verl_agg_loss(mode, packed):
    loss, mask = t(AGG_LOSS), t(AGG_MASK)
    seq_index = None
    if packed:  # the same three sequences packed into one row (seq_index tells them apart)
        keep = mask.flatten() > 0
        loss = loss.flatten()[keep][None]
        mask = torch.ones_like(loss)
        seq_index = torch.tensor([[0, 0, 1, 1, 1, 1, 2, 2, 2]])
    w, norm = C.aggregation_weights(mask, mode, seq_index=seq_index, constant=8.0)
    assert float((w * loss).sum()) / norm == pytest.approx(VERL_AGG[mode], **TOL)


# ------------------------------------------------------------------ KL estimators
KL_LOGPROB = [-1.0, -0.2, -3.0, -0.7, -2.0]
KL_REF = [-1.5, -0.2, -1.0, -0.9, -6.0]
# VERL core_algos.py::kl_penalty(logprob, ref_logprob, "k1" / "k2" / "k3") (per token)
VERL_KL = {
    "k1": [0.5, 0.0, -2.0, 0.19999998807907104, 4.0],
    "k2": [0.125, 0.0, 2.0, 0.019999997690320015, 8.0],
    "k3": [0.10653066635131836, 0.0, 4.389056205749512, 0.018730759620666504, 3.0183157920837402],
}


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_match_verl_kl_penalty(kind):
    lp, ref = t([KL_LOGPROB]).T, t([KL_REF]).T  # [5, 1]: one token per row
    per_token = [
        float(L.kl_penalty(lp[i : i + 1], ref[i : i + 1], torch.ones(1, 1), kind=kind))
        for i in range(5)
    ]
    close(per_token, VERL_KL[kind])


# ------------------------------------------------------------ the KL term, aggregated like the loss
# issue 10's input: sequences of 1 and 3 tokens, log pi_ref - log pi_theta = -0.5 everywhere, so
# every token's k3 = e^-0.5 - 1 + 0.5 = 0.106531; advantages 0, kl_coef 1.
KLA_LOGPROB = [[-1.0, 0.0, 0.0], [-1.0, -2.0, -0.3]]
KLA_MASK = [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
# VERL verl/workers/utils/losses.py::ppo_loss adds kl_loss = agg_loss(kl_penalty(lp, ref, "k3"),
# response_mask, loss_agg_mode); the values of core_algos.agg_loss on that k3 matrix:
VERL_KL_AGG = {
    "token_mean": 0.10653066635131836,
    "seq_mean_token_mean": 0.10653066635131836,
    "seq_mean_token_sum": 0.21306133270263672,
    "constant": 0.02663266658782959,
}
# TRL trl/trainer/grpo_trainer.py::GRPOTrainer._compute_loss (beta=1, advantages 0,
# max_completion_length=8): loss_type "grpo" = seq_mean_token_mean, "bnpo" / "dapo" = token_mean,
# "dr_grpo" = constant (B x max_completion_length)
TRL_KL_AGG = {
    "seq_mean_token_mean": 0.10653066635131836,
    "token_mean": 0.10653066635131836,
    "constant": 0.02663266658782959,
}


@pytest.mark.parametrize("mode", C.AGGREGATIONS)
def test_kl_penalty_aggregated_like_the_loss_matches_verl_and_trl(mode):
    lp, mask = t(KLA_LOGPROB), t(KLA_MASK)
    ref = lp - 0.5
    w, norm = C.aggregation_weights(mask, mode, constant=8.0)
    got = float(L.kl_penalty(lp, ref, mask, kind="k3", token_weights=w)) / norm
    assert got == pytest.approx(VERL_KL_AGG[mode], **TOL)
    if mode in TRL_KL_AGG:
        assert got == pytest.approx(TRL_KL_AGG[mode], **TOL)


# ------------------------------------------------------------------ TIS / MIS / IcePop
IS_LOG_RATIO = [
    [0.3, -0.9, -0.2, 0.0, 0.0],
    [0.05, -0.1, 0.2, 0.5, -0.4],
    [2.0, -1.0, 0.1, 0.0, 0.0],
]
IS_MASK = [[1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 0.0]]
# VERL verl/trainer/ppo/rollout_corr_helper.py::compute_rollout_correction_weights(log_ratio, mask,
# rollout_is="token" / "sequence", rollout_is_threshold=2.0 (TIS) / "0.5_2.0" (IcePop))
VERL_IS = {
    ("tis_token", "token", 2.0): [
        [1.3498588800430298, 0.4065696597099304, 0.8187307715415955, 0.0, 0.0],
        [
            1.0512710809707642,
            0.904837429523468,
            1.2214027643203735,
            1.6487212181091309,
            0.6703200340270996,
        ],
        [2.0, 0.3678794503211975, 1.1051709651947021, 1.0, 0.0],
    ],
    ("mis_token", "token", "0.5_2.0"): [
        [1.3498588800430298, 0.0, 0.8187307715415955, 0.0, 0.0],
        [
            1.0512710809707642,
            0.904837429523468,
            1.2214027643203735,
            1.6487212181091309,
            0.6703200340270996,
        ],
        [0.0, 0.0, 1.1051709651947021, 1.0, 0.0],
    ],
    ("tis_sequence", "sequence", 2.0): [
        [0.4493289887905121] * 3 + [0.0] * 2,
        [1.2840254306793213] * 5,
        [2.0] * 4 + [0.0],
    ],
    ("mis_sequence", "sequence", "0.5_2.0"): [[0.0] * 5, [1.2840254306793213] * 5, [0.0] * 5],
}


@pytest.mark.parametrize("key", list(VERL_IS), ids=lambda k: k[0])
def test_tis_mis_icepop_weights_match_verl(key):
    lr = t(IS_LOG_RATIO)
    w, _ = C.mismatch_weights(
        lr, torch.zeros_like(lr), t(IS_MASK), method=key[0], cap=2.0, low=0.5, high=2.0
    )
    close(w, [x for row in VERL_IS[key] for x in row])


# ------------------------------------------------------------------ geometric-mean rejection
# four sequences, padded to 100 tokens, with a constant per-token log(pi_prox / pi_behav):
# 40 x 1.0 (geometric mean e = 2.72), 100 x log 1.1 (product 13,780, geometric 1.1),
# 3 x [0.5, -0.2, 0.1], 5 x -0.8 (geometric e^-0.8 = 0.449). Band [0.5, 2].
# VERL_GEO rollout_corr_helper.py::compute_rollout_rejection_mask(log_ratio, mask,
#   rollout_rs="geometric", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5),
# VERL compute_rollout_rejection_mask(..., rollout_rs="seq_mean_k1",
#   rollout_rs_threshold="0.5_2.0") and
# AREAL functional.py::apply_rejection_sampling(level="sequence", metric="ratio", agg="mean",
#   lower=0.5, upper=2.0, action="mask") all keep these token counts per sequence:
REF_GEO_KEPT = [0.0, 100.0, 3.0, 0.0]


def test_geo_mask_matches_verl_and_areal_on_long_sequences():
    lr = torch.zeros(4, 100)
    mask = torch.zeros(4, 100)
    lr[0, :40], mask[0, :40] = 1.0, 1.0
    lr[1, :], mask[1, :] = math.log(1.1), 1.0
    lr[2, :3], mask[2, :3] = torch.tensor([0.5, -0.2, 0.1]), 1.0
    lr[3, :5], mask[3, :5] = -0.8, 1.0
    w, m = C.mismatch_weights(lr, torch.zeros_like(lr), mask, method="geo_mask", low=0.5, high=2.0)
    close(w.sum(-1), REF_GEO_KEPT)
    assert m["correction/masked_seq_frac"] == pytest.approx(0.5)


# ------------------------------------------------------------------ k1 / k2 / k3 rejection
RS_LOG_RATIO = [[0.1, -0.1, 0.05, 0.0], [0.6, -0.5, 0.3, -0.2], [0.02, 0.01, 0.0, 0.0]]
RS_MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
# VERL rollout_corr_helper.py::compute_rollout_rejection_mask(log_ratio, mask,
# rollout_rs="seq_mean_k2" / "seq_mean_k3", rollout_rs_threshold=thr): sequences kept
VERL_RS_KEPT = {
    ("k2", 0.01): [1, 0, 1],
    ("k3", 0.01): [1, 0, 1],
    ("k2", 0.09): [1, 0, 1],
    ("k3", 0.09): [1, 0, 1],
    ("k2", 0.1): [1, 1, 1],
    ("k3", 0.1): [1, 1, 1],
}
# AREAL functional.py::apply_rejection_sampling(level="sequence", metric="kl_k3", agg="mean",
# upper=0.09) keeps [1, 1, 1]: AReaL's KLEstimator k3 uses r = pi_behav / pi_prox
# (areal/utils/data.py::KLEstimator._compute_approx_kl), i.e. k3(-log r) in conveyor's terms.
AREAL_RS_K3_009_KEPT = [1, 1, 1]
# AREAL KLEstimator._compute_approx_kl(prox, behav, "k2", apply_clamp=False) on row 1:
AREAL_K2_ROW1 = [0.18000000715255737, 0.125, 0.04500000178813934, 0.020000001415610313]


@pytest.mark.parametrize("key", list(VERL_RS_KEPT), ids=str)
def test_kl_rejection_matches_verl(key):
    kind, threshold = key
    lr = t(RS_LOG_RATIO)
    keep, _ = C.rejection_stats(
        lr, torch.zeros_like(lr), t(RS_MASK), reject=kind, threshold=threshold
    )
    close((keep.sum(-1) > 0).float(), VERL_RS_KEPT[key])


def test_kl_rejection_statistics_and_areal_convention():
    lr = t(RS_LOG_RATIO)
    _, m = C.rejection_stats(lr[1:2], torch.zeros(1, 4), torch.ones(1, 4))
    assert m["mismatch/k2_mean"] == pytest.approx(sum(AREAL_K2_ROW1) / 4, **TOL)
    # AReaL's k3 direction is conveyor's with pi_prox and pi_behav swapped
    keep, _ = C.rejection_stats(torch.zeros_like(lr), lr, t(RS_MASK), reject="k3", threshold=0.09)
    close((keep.sum(-1) > 0).float(), AREAL_RS_K3_009_KEPT)


# ------------------------------------------------------------------ AReaL's interpolation
INT_BEHAV = [-1.0, -2.0, -0.5, -3.0, -0.2, -1.5]
INT_THETA = [-0.8, -2.6, -0.5, -1.0, -0.9, -1.5]
INT_VERSIONS = [4, 3, 2, 1, 4, -1]  # -1: a prompt token
# AREAL areal/trainer/ppo/actor.py::compute_prox_logp_approximations(old_logp=BEHAV,
# logprobs=THETA, versions, current_version=5, method=...). AReaL's current_version is the
# version the update produces (v_prox = current_version - 1); conveyor's trainer at version v
# produces v + 1, so conveyor's v = 4. AReaL's linear adds 1e-10 inside the log.
AREAL_INTERP = {
    "loglinear": [-1.0, -2.299999952316284, -0.5, -1.5, -0.20000000298023224, -1.5],
    "linear": [-1.0, -2.2556591033935547, -0.5, -1.2435581684112549, -0.19999997317790985, -1.5],
}


@pytest.mark.parametrize("kind", ["loglinear", "linear"])
def test_interpolated_proximal_matches_areal(kind):
    versions = torch.tensor([INT_VERSIONS])
    mask = (versions >= 0).float()
    alpha = C.interpolation_alpha(versions, current_version=4)
    got = C.interpolated_proximal(t([INT_THETA]), t([INT_BEHAV]), alpha, mask, kind=kind)
    close(got[0, :5], AREAL_INTERP[kind][:5])
    # convention: conveyor returns 0 at masked positions (the prompt token); AReaL returns pi_behav
    assert got[0, 5] == 0.0 and AREAL_INTERP[kind][5] == INT_BEHAV[5]


# ------------------------------------------------------------------ the capacity rule
# AREAL areal/infra/staleness_manager.py::StalenessManager(max_concurrent_rollouts,
#   consumer_batch_size, max_staleness).get_capacity() with rollout_stat.accepted / running set
#   and get_version() = v
CAPACITY_CASES = [  # (eta, v, batch, max_concurrent, accepted, running) -> AReaL's capacity
    ((2, 0, 4, 64, 0, 0), 12),
    ((2, 0, 4, 64, 8, 3), 1),
    ((2, 3, 4, 64, 20, 2), 2),
    ((0, 0, 4, 64, 0, 4), 0),
    ((0, 1, 4, 64, 4, 0), 4),
    ((4, 1, 8, 16, 10, 6), 10),
    ((1, 2, 3, 64, 12, 0), 0),
    ((8, 5, 2, 5, 10, 1), 4),
    ((2, 1, 4, 64, 14, 2), 0),
    ((0, 0, 4, 64, 3, 4), -3),
]
# AREAL StalenessManager(64, 4, 2) with accepted=3, on_version_recovered(7):
# (accepted, get_capacity())
AREAL_RECOVERED = (28, 12)


@pytest.mark.parametrize(("case", "areal"), CAPACITY_CASES)
def test_capacity_rule_matches_areal(case, areal):
    eta, v, batch, max_concurrent, accepted, running = case
    sm = StalenessManager(batch, eta, max_concurrent)
    left = accepted
    while left:
        n = min(left, max_concurrent)
        sm.on_start(n)
        sm.on_accept(n)
        left -= n
    if running:
        sm.on_start(running)
    # convention: conveyor clamps at 0 (a count of rollouts to start); AReaL may return < 0
    assert sm.capacity(v) == max(0, areal)


def test_capacity_after_resume_matches_areal():
    sm = StalenessManager(4, 2, 64)
    sm.on_start(3)
    sm.on_accept(3)
    sm.reset_after_resume(7)
    assert (sm.accepted, sm.capacity(7)) == AREAL_RECOVERED
