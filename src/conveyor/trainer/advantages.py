"""Outcome-reward advantage estimators: one scalar reward per response -> one advantage.

Every function here is a pure function of tensors, computed without gradient (advantages are
data, never differentiated through). Shapes: ``N`` = number of responses (trajectories) in the
batch, ``T`` = padded number of response tokens.

Numerics: statistics are computed in float64 and the result is returned in the rewards'
floating dtype (float32 when the rewards are integer or bool).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

__all__ = ["grpo_advantages", "reinforce_baseline_advantages", "broadcast_to_tokens"]


def _check_rewards(rewards: Tensor) -> Tensor:
    if not isinstance(rewards, Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape [N], got shape {list(rewards.shape)}")
    if rewards.is_complex():
        raise ValueError(f"rewards must be real, got dtype {rewards.dtype}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite (no NaN or inf); a failed reward should be "
                         "replaced by the reward service's failure score before this point")
    return rewards


def _out_dtype(rewards: Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def _group_index(group_ids: Tensor | Sequence[Hashable], n: int, device: torch.device) -> Tensor:
    """Map arbitrary group ids to dense indices ``0..G-1`` (int64 ``[N]``)."""
    if isinstance(group_ids, Tensor):
        if group_ids.dim() != 1 or group_ids.shape[0] != n:
            raise ValueError(
                f"group_ids must have shape [N] = [{n}] like rewards, got {list(group_ids.shape)}"
            )
        if group_ids.is_floating_point() or group_ids.is_complex():
            raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
        if n == 0:
            return torch.zeros(0, dtype=torch.long, device=device)
        _, inverse = torch.unique(group_ids.to(device), return_inverse=True)
        return inverse.long()
    if isinstance(group_ids, str | bytes) or not isinstance(group_ids, Sequence):
        raise ValueError(
            f"group_ids must be a Tensor[N] or a list of N hashable ids, "
            f"got {type(group_ids).__name__}"
        )
    if len(group_ids) != n:
        raise ValueError(f"group_ids must have length N = {n} like rewards, got {len(group_ids)}")
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(g, len(dense)) for g in group_ids]
    return torch.tensor(index, dtype=torch.long, device=device)


@torch.no_grad()
def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    unbiased: bool = True,
) -> Tensor:
    """Group-relative outcome advantage of GRPO and Dr. GRPO.

    GRPO (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, section 4.1.2 "Outcome
    Supervision RL with GRPO"): every response ``i`` of group ``g`` (the responses to one prompt)
    gets ``A_i = (r_i - mean_g(r)) / std_g(r)``, used as the advantage of all its tokens.
    Dr. GRPO (Liu et al. 2025, arXiv 2503.20783, section 3.1): drop the std division, which
    biases updates towards too-easy / too-hard prompts: ``A_i = r_i - mean_g(r)``
    (``scale_by_std=False``).

    Standard deviation: the group std is the sample std with Bessel's correction
    (``unbiased=True``, divide by ``G - 1``) by default, plus ``eps`` in the denominator:
    ``A_i = (r_i - mean_g) / (std_g + eps)``. That is exactly what the two reference
    implementations compute, so their hyper-parameters transfer unchanged: TRL's GRPOTrainer
    (``trl/trainer/grpo_trainer.py``: ``rewards.view(-1, num_generations).std(dim=1)``, torch's
    default unbiased std, ``+ 1e-4``) and verl
    (``verl/trainer/ppo/core_algos.py::compute_grpo_outcome_advantage``: ``torch.std``, unbiased,
    ``+ epsilon`` with ``epsilon = 1e-6``). The paper does not say which std it uses.
    ``unbiased=False`` gives the population std (divide by ``G``) instead.

    Degenerate groups (MISSION.md section 5):
        * All rewards of a group equal (including a group of size 1): every advantage of that
          group is exactly ``0.0``: never NaN, and no ``tiny rounding residue / eps`` blow-up
          (the case is detected by ``max_g == min_g``, not by the std).
        * Group of size 1: advantage ``0.0`` and no division by zero. verl deliberately differs
          here (it uses mean 0, std 1, i.e. ``A = r``); a single response has no group baseline,
          so conveyor gives it no group-relative signal. Use ``reinforce_baseline_advantages``
          or a critic for single-rollout training (MISSION.md section 3).

    Args:
        rewards: ``[N]`` scalar reward per response; any real dtype (bool and integer rewards are
            accepted). Must be finite.
        group_ids: ``[N]`` group of each response: an integer tensor, or a list of hashable ids
            (e.g. ``Trajectory.group_id`` strings). Members of a group need not be adjacent and
            groups may have different sizes.
        scale_by_std: ``True`` for GRPO, ``False`` for Dr. GRPO.
        eps: Added to the std before dividing (only used when ``scale_by_std``); must be >= 0.
        unbiased: Bessel-corrected sample std (``True``, TRL / verl) or population std.

    Returns:
        ``[N]`` advantages in the rewards' floating dtype (float32 for integer or bool rewards),
        on the rewards' device. For every group the advantages sum to zero (up to rounding).
        Values are bounded by ``sqrt(G - 1)`` in magnitude when ``scale_by_std`` (a z-score); with
        ``scale_by_std=False`` they are reward differences, so rewards beyond about ``1e38``
        overflow float32.

    Raises:
        ValueError: ``rewards`` is not a 1-D real tensor or holds NaN / inf; ``group_ids`` has the
            wrong length / shape / dtype; ``eps`` is negative.
    """
    _check_rewards(rewards)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    n = rewards.shape[0]
    index = _group_index(group_ids, n, rewards.device)
    out_dtype = _out_dtype(rewards)
    if n == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards.device)

    r = rewards.to(torch.float64)
    num_groups = int(index.max()) + 1
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=r.device)
    count = zeros.index_add(0, index, torch.ones_like(r))                  # G_g
    mean = zeros.index_add(0, index, r) / count                             # mean_g(r)
    centered = r - mean[index]                                              # r_i - mean_g

    g_max = zeros.scatter_reduce(0, index, r, reduce="amax", include_self=False)
    g_min = zeros.scatter_reduce(0, index, r, reduce="amin", include_self=False)
    constant = (g_max == g_min)[index]          # all-equal group, or a group of size 1

    if scale_by_std:
        sq_sum = zeros.index_add(0, index, centered.square())              # sum_i (r_i - mean_g)^2
        dof = count - 1.0 if unbiased else count
        std = (sq_sum / dof.clamp(min=1.0)).sqrt()                          # std_g(r)
        adv = centered / (std[index] + eps)
    else:
        adv = centered
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.to(out_dtype)


@torch.no_grad()
def reinforce_baseline_advantages(rewards: Tensor) -> Tensor:
    """REINFORCE advantage with a batch-mean baseline: ``A_i = r_i - mean_j(r_j)``.

    Williams 1992, "Simple statistical gradient-following algorithms for connectionist
    reinforcement learning" (Machine Learning 8): the REINFORCE update
    ``dw = alpha * (r - b) * d log pi / dw`` with a reinforcement baseline ``b`` that does not
    depend on the action; here ``b`` is the mean reward of the batch. Unlike GRPO no group is needed,
    so it suits one response per prompt (MISSION.md section 3). Note that the baseline includes
    ``r_i`` itself (not leave-one-out).

    Args:
        rewards: ``[N]`` scalar reward per response; any real dtype, finite.

    Returns:
        ``[N]`` advantages in the rewards' floating dtype (float32 for integer or bool rewards).
        ``N = 1`` gives ``[0.0]``; ``N = 0`` gives an empty tensor.

    Raises:
        ValueError: ``rewards`` is not a 1-D real tensor or holds NaN / inf.
    """
    _check_rewards(rewards)
    out_dtype = _out_dtype(rewards)
    if rewards.shape[0] == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards.device)
    r = rewards.to(torch.float64)
    adv = r - r.mean()                                                      # r_i - b
    return adv.to(out_dtype)


def broadcast_to_tokens(adv: Tensor, mask: Tensor) -> Tensor:
    """Give every response token its sequence's advantage: ``A[b, t] = adv[b] * mask[b, t]``.

    Outcome-reward methods (GRPO arXiv 2402.03300 section 4.1.2: "sets the advantages of all
    tokens in the output as the normalized reward") use one advantage for all tokens.

    Args:
        adv: ``[N]`` per-sequence advantages, floating dtype.
        mask: ``[N, T]`` response-token mask, bool or numeric (1 for tokens that count, 0 for
            prompt and padding).

    Returns:
        ``[N, T]`` token advantages in ``adv``'s dtype; exactly 0 where ``mask`` is 0.

    Raises:
        ValueError: ``adv`` is not 1-D floating, ``mask`` is not 2-D, or their ``N`` differ.
    """
    if not isinstance(adv, Tensor) or adv.dim() != 1 or not adv.is_floating_point():
        shape = list(adv.shape) if isinstance(adv, Tensor) else type(adv).__name__
        raise ValueError(f"adv must be a floating tensor of shape [N], got {shape}")
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        shape = list(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a tensor of shape [N, T], got {shape}")
    if mask.shape[0] != adv.shape[0]:
        raise ValueError(
            f"mask must have shape [N, T] with N = {adv.shape[0]} (len(adv)), "
            f"got {list(mask.shape)}"
        )
    return adv.unsqueeze(1) * mask.to(adv.dtype)
