"""Advantage credit by length and position (conveyor.trainer.credit): hand-computed values, the
undefined cases, and the figures a trainer step logs."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from conveyor.config import LossConfig, TrainerConfig
from conveyor.trainer.credit import credit_metrics, per_response_credit
from conveyor.trainer.trainer import Trainer
from tests.test_critic_training import fixed_values, make_trainer, traj


def close(got: torch.Tensor, rows: list[list[float]]) -> bool:
    return torch.allclose(got.double(), torch.tensor(rows, dtype=torch.float64), atol=1e-6, rtol=0)


def test_per_response_credit_hand_values():
    """Row 0: actions at 0, 1, 4 (observations 2, 3 ignored), A = 0.8, 0.6, 0.4: sum 1.8 over 3,
    first half = ranks 0, 1 (2k < 3): 1.4 over 2. Row 1: 2 actions, A = -0.5, -0.5: first half is
    rank 0 only. Row 2: no action token."""
    adv = torch.tensor([[0.8, 0.6, 9.0, 9.0, 0.4], [-0.5, -0.5, 7.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0, 0, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    got = per_response_credit(adv, mask)
    assert got.dtype == torch.float64
    assert close(got, [[1.8, 3, 1.4, 2], [-1.0, 2, -0.5, 1], [0, 0, 0, 0]])
    # one action token: it is the first half
    assert per_response_credit(torch.tensor([[2.0]]), torch.tensor([[1]])).tolist() == [[2.0, 1.0, 2.0, 1.0]]


def test_credit_metrics_hand_values():
    """From the rows above with rewards 1, 0, 0: two responses with tokens (row 2 left out), so
    the correlation of lengths (3, 2) with sums (1.8, -1.0) is 1; rewarded sum 1.8, unrewarded
    -1.0; first half (1.4 - 0.5) / 3 = 0.3, second half (0.4 - 0.5) / 2 = -0.05."""
    credit = torch.tensor([[1.8, 3, 1.4, 2], [-1.0, 2, -0.5, 1], [0, 0, 0, 0]], dtype=torch.float64)
    got = credit_metrics(credit, torch.tensor([1.0, 0.0, 0.0]))
    assert got == pytest.approx({"advantage/length_corr": 1.0, "advantage/sum_rewarded": 1.8,
                                 "advantage/sum_unrewarded": -1.0, "advantage/first_half_mean": 0.3,
                                 "advantage/second_half_mean": -0.05})
    # lengths 1, 2, 3 with sums 0, 1, 1: sum(dx dy) = 1, |dx| = sqrt 2, |dy| = sqrt(6) / 3 -> 3 / sqrt 12
    credit = torch.tensor([[0.0, 1, 0, 1], [1.0, 2, 1, 1], [1.0, 3, 0.5, 2]])
    assert credit_metrics(credit, torch.zeros(3))["advantage/length_corr"] == pytest.approx(3 / math.sqrt(12))


def test_credit_metrics_leave_out_what_is_undefined():
    one = credit_metrics(torch.tensor([[1.0, 2, 0.5, 1]]), torch.tensor([1.0]))
    assert set(one) == {"advantage/sum_rewarded", "advantage/first_half_mean", "advantage/second_half_mean"}
    same_length = credit_metrics(torch.tensor([[1.0, 2, 0.5, 1], [-1.0, 2, 0.0, 1]]), torch.tensor([0.0, -0.5]))
    assert "advantage/length_corr" not in same_length and "advantage/sum_rewarded" not in same_length
    assert same_length["advantage/sum_unrewarded"] == 0.0                 # reward <= 0 is unrewarded
    assert credit_metrics(torch.zeros(2, 4), torch.ones(2)) == {}         # no action token anywhere
    assert not any(math.isnan(v) for v in same_length.values())
    with pytest.raises(ValueError, match=r"credit must be \[N, 4\]"):
        credit_metrics(torch.zeros(2, 3), torch.zeros(2))
    with pytest.raises(ValueError, match=r"rewards must be \[N\] = \[2\]"):
        credit_metrics(torch.zeros(2, 4), torch.zeros(3))
    with pytest.raises(ValueError, match="one shape"):
        per_response_credit(torch.zeros(2, 3), torch.zeros(2, 4))


def test_trainer_credit_of_the_packed_advantages(tiny):
    """The skip-observation example of test_critic_training (lambda 1): trajectory 0's advantages
    (0.8, 0.6, -, -, 0.4), reward 1; trajectory 1's (-0.5, -0.5), reward 0; the trainer's credit
    rows read them back out of the packed micro-batch, and a full step logs the figures."""
    trajs = [traj(0, [5, 6, 7, 8, 9], 1.0, action_mask=[1, 1, 0, 0, 1]), traj(1, [5, 6], 0.0)]
    tr = make_trainer(tiny, critic={"policy_lam": 1.0})
    fixed_values(tr, {0: [0.2, 0.4, 9.0, 9.0, 0.6], 1: [0.5, 0.5]})
    batch = tr.pack(trajs)
    tr.assign_advantages(batch, tr.score(batch))
    assert close(tr._credit(batch), [[1.8, 3, 1.4, 2], [-1.0, 2, -0.5, 1]])


def test_a_train_step_logs_the_credit_of_its_batch(tiny):
    """A real step (tiny critic, K = 2): the logged figures are credit_metrics of the step's own
    credit rows and rewards (the rows captured as the step computes them)."""
    trajs = [traj(0, [5, 6, 7, 8, 9], 1.0, action_mask=[1, 1, 0, 0, 1]), traj(1, [5, 6], 0.0),
             traj(2, [7, 8, 9, 10, 11, 12], 0.0)]
    tr = make_trainer(tiny)
    seen = []
    real = tr._credit
    tr._credit = lambda batch: seen.append(real(batch)) or seen[-1]
    metrics = tr.train_step(trajs)
    assert len(seen) == 1 and seen[0].shape == (3, 4)
    assert seen[0][:, 1].tolist() == [3.0, 2.0, 6.0]                    # action tokens per trajectory
    want = credit_metrics(seen[0], torch.tensor([1.0, 0.0, 0.0]))
    assert set(want) == {"advantage/length_corr", "advantage/sum_rewarded", "advantage/sum_unrewarded",
                         "advantage/first_half_mean", "advantage/second_half_mean"}
    assert {k: metrics[k] for k in want} == pytest.approx(want)


def test_grpo_step_logs_credit_too(tiny):
    """An outcome estimator broadcasts one advantage over a response's tokens: a group of two with
    rewards 1 and 0 (GRPO: +0.707, -0.707 with the group std) and lengths 3 and 2."""
    tr = Trainer(copy.deepcopy(tiny.model), TrainerConfig(bf16=False, lr=1e-5, warmup_steps=0),
                 LossConfig(name="ppo", advantage="grpo", kl_coef=0.0))
    trajs = [traj(0, [5, 6, 7], 1.0, group="g"), traj(1, [5, 6], 0.0, group="g")]
    batch = tr.pack(trajs)
    tr.assign_advantages(batch, tr.score(batch))
    a = float(batch.sequence_advantages[0])
    assert a > 0 and float(batch.sequence_advantages[1]) == pytest.approx(-a)
    assert close(tr._credit(batch), [[3 * a, 3, 2 * a, 2], [-2 * a, 2, -a, 1]])
