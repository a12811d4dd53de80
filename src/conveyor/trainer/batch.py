"""Packing trajectories into micro-batches by token budget (no padding).

Several trajectories are concatenated into one row; ``position_ids`` restart at 0 for every
sequence, which transformers' mask utilities turn into a block-diagonal causal mask (with sdpa,
when no attention mask is passed). All per-token tensors are aligned with the *targets*: position
``j`` holds what is needed to score token ``input_ids[j + 1]``, so the response-token mask is zero
on prompt tokens and at sequence boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.types import Trajectory


@dataclass
class PackedBatch:
    """One packed micro-batch of ``S`` trajectories, ``L`` tokens in total.

    Attributes:
        input_ids: ``[1, L]`` int64, prompt + response of every trajectory, concatenated.
        position_ids: ``[1, L]`` int64, restarting at 0 for each trajectory.
        targets: ``[1, L]`` int64, ``input_ids`` shifted left by one (last slot of each
            sequence holds 0 and is masked).
        mask: ``[1, L]`` float32, 1.0 where the target is a response token.
        behaviour_logprobs: ``[1, L]`` float32, engine log-probs of the target tokens (0 elsewhere).
        versions: ``[1, L]`` int64, policy version of the target token (-1 elsewhere).
        advantages: ``[1, L]`` float32, per-token advantage (0 elsewhere).
        seq_index: ``[1, L]`` int64, which of the S trajectories each position belongs to.
        indices: Positions of these trajectories in the step's batch (length S).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    versions: torch.Tensor
    advantages: torch.Tensor
    seq_index: torch.Tensor
    indices: list[int]

    @property
    def num_tokens(self) -> int:
        """Response tokens that count in the loss (tokens)."""
        return int(self.mask.sum().item())


def pack(trajectories: list[Trajectory], advantages: torch.Tensor, indices: list[int]) -> PackedBatch:
    """Pack ``trajectories[i] for i in indices`` into one :class:`PackedBatch`.

    Args:
        trajectories: The step's batch.
        advantages: ``[N]`` float, one scalar advantage per trajectory of the batch (outcome
            reward), broadcast over its response tokens.
        indices: Which trajectories go into this micro-batch.

    Raises:
        ValueError: a trajectory whose per-token lists disagree in length.
    """
    ids, pos, tgt, msk, blp, ver, adv, seq = [], [], [], [], [], [], [], []
    for s, i in enumerate(indices):
        t = trajectories[i]
        r = len(t.response_ids)
        if not (len(t.behaviour_logprobs) == len(t.versions) == r):
            raise ValueError(
                f"trajectory {t.sample.id}: response_ids ({r}), behaviour_logprobs "
                f"({len(t.behaviour_logprobs)}) and versions ({len(t.versions)}) differ in length"
            )
        p = len(t.prompt_ids)
        seq_ids = list(t.prompt_ids) + list(t.response_ids)
        n = len(seq_ids)
        ids += seq_ids
        pos += list(range(n))
        # target at j is seq_ids[j+1]; response token k sits at j = p + k - 1
        tgt += seq_ids[1:] + [0]
        m = [0.0] * n
        b = [0.0] * n
        v = [-1] * n
        for k in range(r):
            m[p + k - 1] = 1.0
            b[p + k - 1] = float(t.behaviour_logprobs[k])
            v[p + k - 1] = int(t.versions[k])
        msk += m
        blp += b
        ver += v
        a = float(advantages[i])
        adv += [a * x for x in m]
        seq += [s] * n

    def row(x, dtype):
        return torch.tensor(x, dtype=dtype).unsqueeze(0)

    return PackedBatch(
        input_ids=row(ids, torch.long),
        position_ids=row(pos, torch.long),
        targets=row(tgt, torch.long),
        mask=row(msk, torch.float32),
        behaviour_logprobs=row(blp, torch.float32),
        versions=row(ver, torch.long),
        advantages=row(adv, torch.float32),
        seq_index=row(seq, torch.long),
        indices=list(indices),
    )


def plan_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Split sequences into micro-batches of at most ``token_budget`` tokens (first-fit decreasing).

    Args:
        lengths: Total tokens (prompt + response) of each sequence.
        token_budget: Maximum tokens per micro-batch; a longer sequence gets a micro-batch alone.

    Returns:
        Lists of sequence indices; every index appears exactly once.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= token_budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]
