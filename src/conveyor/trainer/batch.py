"""Packing trajectories into micro-batches by token budget (no padding).

Several trajectories are concatenated into one row; ``position_ids`` restart at 0 for every
sequence, which transformers' mask utilities turn into a block-diagonal causal mask (with sdpa,
when no attention mask is passed). All per-token tensors are aligned with the *targets*: position
``j`` holds what is needed to score token ``input_ids[j + 1]``, so the response-token mask is zero
on prompt tokens and at sequence boundaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from conveyor.types import Trajectory


@dataclass
class PackedBatch:
    """One packed micro-batch of ``S`` trajectories in ``R`` rows of ``L`` tokens.

    Attributes:
        input_ids: ``[R, L]`` int64, prompt + response of the row's trajectories, concatenated.
        position_ids: ``[R, L]`` int64, restarting at 0 for each trajectory (and for padding).
        targets: ``[R, L]`` int64, ``input_ids`` shifted left by one (last slot of each
            sequence holds 0 and is masked).
        mask: ``[R, L]`` float32, 1.0 where the target is a response token.
        behaviour_logprobs: ``[R, L]`` float32, engine log-probs of the target tokens (0 elsewhere).
        versions: ``[R, L]`` int64, policy version of the target token (-1 elsewhere).
        advantages: ``[R, L]`` float32, per-token advantage (0 elsewhere).
        seq_index: ``[R, L]`` int64, which of the S trajectories each position belongs to
            (-1 on padding).
        indices: Positions of these trajectories in the step's batch (length S).
        old_logprobs: ``[R, L]`` float32, training-side log-probs of the target token under the
            version that sampled it, where partial-rollout sync recorded one
            (``trajectory.metadata["old_logprobs"]``); NaN elsewhere.
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
    old_logprobs: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Response tokens that count in the loss (tokens)."""
        return int(self.mask.sum().item())


def _pack_row(trajectories: list[Trajectory], advantages: torch.Tensor, indices: list[int], s0: int) -> dict[str, list]:
    row: dict[str, list] = {k: [] for k in ("ids", "pos", "tgt", "msk", "blp", "ver", "adv", "seq", "old")}
    for s, i in enumerate(indices, start=s0):
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
        row["ids"] += seq_ids
        row["pos"] += list(range(n))
        # target at j is seq_ids[j+1]; response token k sits at j = p + k - 1
        row["tgt"] += seq_ids[1:] + [0]
        m, b, v, o = [0.0] * n, [0.0] * n, [-1] * n, [math.nan] * n
        old = t.metadata.get("old_logprobs") or ()
        act = t.action_mask
        if act is not None and len(act) != r:
            raise ValueError(f"trajectory {t.sample.id}: action_mask ({len(act)}) and response_ids ({r}) differ in length")
        for k in range(r):
            m[p + k - 1] = 1.0 if act is None or act[k] else 0.0  # observations carry no loss
            b[p + k - 1] = float(t.behaviour_logprobs[k])
            v[p + k - 1] = int(t.versions[k])
            if k < len(old):
                o[p + k - 1] = float(old[k])
        row["msk"] += m
        row["blp"] += b
        row["ver"] += v
        row["old"] += o
        a = float(advantages[i])
        row["adv"] += [a * x for x in m]
        row["seq"] += [s] * n
    return row


def pack(trajectories: list[Trajectory], advantages: torch.Tensor, rows: list[list[int]]) -> PackedBatch:
    """Pack trajectories into a ``[R, L]`` micro-batch: row ``r`` concatenates
    ``trajectories[i] for i in rows[r]``; shorter rows are padded at the end with a separate
    dummy segment (position ids restarting at 0, mask 0), so padding never attends to real tokens.

    Args:
        trajectories: The step's batch.
        advantages: ``[N]`` float, one scalar advantage per trajectory of the batch (outcome
            reward), broadcast over its response tokens.
        rows: Which trajectories go into each row (a list of ints is taken as a single row).

    Raises:
        ValueError: a trajectory whose per-token lists disagree in length, or no rows.
    """
    if rows and isinstance(rows[0], int):
        rows = [rows]  # type: ignore[list-item]
    if not rows:
        raise ValueError("pack: no rows")
    built = []
    s0 = 0
    for idx in rows:
        built.append(_pack_row(trajectories, advantages, idx, s0))
        s0 += len(idx)
    L = max(len(r["ids"]) for r in built)
    pad_vals = {"ids": 0, "tgt": 0, "msk": 0.0, "blp": 0.0, "ver": -1, "adv": 0.0, "seq": -1, "old": math.nan}
    for r in built:
        n_pad = L - len(r["ids"])
        for k, v in pad_vals.items():
            r[k] += [v] * n_pad
        r["pos"] += list(range(n_pad))

    def mat(key, dtype):
        return torch.tensor([r[key] for r in built], dtype=dtype)

    return PackedBatch(
        input_ids=mat("ids", torch.long),
        position_ids=mat("pos", torch.long),
        targets=mat("tgt", torch.long),
        mask=mat("msk", torch.float32),
        behaviour_logprobs=mat("blp", torch.float32),
        versions=mat("ver", torch.long),
        advantages=mat("adv", torch.float32),
        seq_index=mat("seq", torch.long),
        indices=[i for idx in rows for i in idx],
        old_logprobs=mat("old", torch.float32),
    )


def _first_fit_decreasing(lengths: list[int], order: list[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def plan_micro_batches(lengths: list[int], token_budget: int, row_tokens: int | None = None) -> list[list[list[int]]]:
    """Split sequences into micro-batches of packed rows (first-fit decreasing, twice).

    Sequences are first packed into rows of at most ``row_tokens`` tokens (attention inside a
    packed row costs O(row length^2), so rows stay short: on SmolLM2 a 1,920-token batch took
    18.8 s forward + backward as one packed row and 9-10 s as rows of 120-480 tokens), then rows
    are grouped into micro-batches whose padded size ``rows x longest row`` stays within
    ``token_budget``.

    Args:
        lengths: Total tokens (prompt + response) of each sequence.
        token_budget: Maximum padded tokens per micro-batch; a longer row gets one alone.
        row_tokens: Maximum tokens per packed row (default: ``token_budget``, i.e. one row).

    Returns:
        Micro-batches, each a list of rows, each a list of sequence indices; every index
        appears exactly once.

    Raises:
        ValueError: non-positive budgets.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    row_tokens = row_tokens or token_budget
    if row_tokens < 1:
        raise ValueError(f"row_tokens must be >= 1, got {row_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows = [sorted(r) for r in _first_fit_decreasing(lengths, order, min(row_tokens, token_budget))]
    row_len = [sum(lengths[i] for i in r) for r in rows]
    # group rows (longest first) while rows x longest row fits the budget
    mbs: list[list[list[int]]] = []
    cur: list[list[int]] = []
    cur_max = 0
    for r in sorted(range(len(rows)), key=lambda k: -row_len[k]):
        new_max = max(cur_max, row_len[r])
        if cur and new_max * (len(cur) + 1) > token_budget:
            mbs.append(cur)
            cur, cur_max = [], 0
            new_max = row_len[r]
        cur.append(rows[r])
        cur_max = new_max
    if cur:
        mbs.append(cur)
    return mbs
