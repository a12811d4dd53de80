"""AsyPPO's mini-critic ensemble: sharding, ensemble statistics, uncertainty masks.

AsyPPO ("Asymmetric PPO", arXiv 2510.01656; MISSION.md section 4; issue 13) replaces one large
critic by a few small ones (``N = 2`` by default):

* **Sharding.** Each critic is trained on a disjoint shard of every prompt's responses:
  response ``j`` of a prompt goes to critic ``j mod N`` (:func:`shard_of`,
  :func:`index_in_group`, :func:`critic_sample_masks`).
* **Value.** The value used for GAE is the mean of the critics; the per-token standard
  deviation between the critics measures their disagreement (:func:`ensemble_stats`).
* **Uncertainty masks.** Over the action tokens of the whole batch, the fraction ``low_frac``
  (``k``, default 0.1) with the LOWEST std get their advantage set to 0 (the critics agree: the
  token carries little learning signal), and the fraction ``high_frac`` (``h``, default 0.2)
  with the HIGHEST std are removed from the entropy bonus (the critics disagree: do not push
  exploration there) (:func:`uncertainty_masks`).

Pure functions of padded token tensors, computed without gradient. ``N`` = critics, ``B`` =
sequences (responses), ``T`` = padded response tokens. ``mask [B, T]`` (bool or numeric) is
non-zero on action tokens (the tokens the policy generated), 0 on observations and padding.
Values at positions outside ``mask`` are never read arithmetically (NaN / inf there change
nothing). Computation is float32 (float64 inputs stay float64).

Fractions are read as the decimal they print as (``Fraction(repr(x))``, so ``0.1`` is exactly
1/10 and ``floor(0.1 * 10)`` is exactly 1, never ``floor(0.9999...)``), and token counts use
exact rational arithmetic.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Sequence
from fractions import Fraction

import torch
from torch import Tensor

from conveyor.rollout.staleness import check_int

__all__ = [
    "shard_of",
    "index_in_group",
    "critic_sample_masks",
    "ensemble_stats",
    "uncertainty_counts",
    "uncertainty_masks",
]



def _check_mask(mask: Tensor) -> Tensor:
    """Validate ``mask [B, T]``; return it as bool."""
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        shape = list(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a tensor of shape [B, T], got {shape}")
    return mask != 0


def shard_of(index_in_group: int, n_critics: int) -> int:
    """The critic that trains on response ``index_in_group`` of its prompt: ``j mod N``.

    AsyPPO (arXiv 2510.01656): every critic sees a disjoint shard of each prompt's responses,
    so the critics are trained on different data and their disagreement is informative.

    Args:
        index_in_group: ``j``, the 0-based position of the response among the responses to its
            prompt (see :func:`index_in_group` for how it is counted in a batch).
        n_critics: ``N``, the number of critics (>= 1).

    Returns:
        The critic index in ``0 .. N - 1``; e.g. ``N = 2``: responses 0, 2, 4 -> critic 0 and
        1, 3, 5 -> critic 1.

    Raises:
        ValueError: naming the argument when ``index_in_group`` is not an int >= 0 or
            ``n_critics`` not an int >= 1.
    """
    check_int("index_in_group", index_in_group, 0)
    check_int("n_critics", n_critics, 1)
    return index_in_group % n_critics


def index_in_group(group_ids: Tensor | Sequence[Hashable]) -> Tensor:
    """Position of each response within its prompt's group, counted in batch order.

    Ordering: ``j`` of a response is the number of earlier responses in the batch (lower batch
    index) with the same group id, i.e. the ``j``-th response of each prompt in batch order
    (0-based). Groups need not be contiguous: ``["a", "b", "a", "a", "b"]`` -> ``[0, 0, 1, 2, 1]``.
    The shard of a response therefore depends on the batch order, which must be the same for
    the values used in training and in GAE (conveyor keeps a group's responses in the order
    the workflow returned them).

    Args:
        group_ids: ``[B]`` integer tensor, or a sequence of ``B`` hashable ids (e.g. the
            ``Trajectory.group_id`` strings).

    Returns:
        ``[B]`` int64 tensor (on ``group_ids``' device for a tensor, else CPU).

    Raises:
        ValueError: ``group_ids`` is not a 1-D integer tensor nor a (non-string) sequence.
    """
    device = torch.device("cpu")
    if isinstance(group_ids, Tensor):
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must have shape [B], got {list(group_ids.shape)}")
        if group_ids.is_floating_point() or group_ids.is_complex():
            raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
        device = group_ids.device
        ids: Sequence[Hashable] = group_ids.tolist()
    elif isinstance(group_ids, str | bytes) or not isinstance(group_ids, Sequence):
        raise ValueError(f"group_ids must be a Tensor[B] or a list of B hashable ids, "
                         f"got {type(group_ids).__name__}")
    else:
        ids = group_ids
    seen: dict[Hashable, int] = {}
    out = []
    for g in ids:
        j = seen.get(g, 0)
        out.append(j)
        seen[g] = j + 1
    return torch.tensor(out, dtype=torch.long, device=device)


def critic_sample_masks(group_ids: Tensor | Sequence[Hashable], n_critics: int) -> Tensor:
    """Which responses of a batch each critic trains on: ``[N, B]`` bool.

    ``masks[c, i]`` is True iff ``shard_of(index_in_group(group_ids)[i], N) == c``: response
    ``j`` of every prompt (``j``-th in batch order, :func:`index_in_group`) goes to critic
    ``j mod N``. Every response belongs to exactly one critic (the rows are disjoint and cover
    the batch). A prompt with fewer than ``N`` responses gives nothing to the last critics.
    Token masks for critic ``c``'s value loss: ``masks[c, :, None] & (action_mask != 0)``.

    Args:
        group_ids: ``[B]`` group (prompt) ids, as for :func:`index_in_group`.
        n_critics: ``N`` (>= 1).

    Returns:
        ``[N, B]`` bool tensor.

    Raises:
        ValueError: as :func:`index_in_group`; ``n_critics`` not an int >= 1.
    """
    check_int("n_critics", n_critics, 1)
    shard = index_in_group(group_ids) % n_critics
    critics = torch.arange(n_critics, device=shard.device)
    return shard.unsqueeze(0) == critics.unsqueeze(1)


@torch.no_grad()
def ensemble_stats(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and population standard deviation of the critics' values, per token.

    ``mean = (1/N) sum_c V_c`` and ``std = sqrt((1/N) sum_c (V_c - mean)^2)`` (population std:
    divide by ``N``, not ``N - 1``; the critics are the whole ensemble, not a sample, and
    ``N = 1`` gives std 0 rather than NaN). E.g. two critics with ``0`` and ``0.4``: mean 0.2,
    std 0.2.

    Args:
        values: ``[N, B, T]`` float, critic ``c``'s value at each token (``N >= 1``).
        mask: ``[B, T]`` non-zero on action tokens.

    Returns:
        ``(mean [B, T], std [B, T])`` float32 (float64 for float64 values), both exactly 0
        outside ``mask``.

    Raises:
        ValueError: ``values`` not a floating ``[N, B, T]`` tensor with ``N >= 1`` and
            ``[B, T]`` equal to ``mask``'s shape; ``mask`` not 2-D.
    """
    m = _check_mask(mask)
    if not isinstance(values, Tensor) or values.dim() != 3 or values.shape[1:] != m.shape \
            or values.shape[0] < 1:
        shape = list(values.shape) if isinstance(values, Tensor) else type(values).__name__
        raise ValueError(f"values must be a tensor of shape [N >= 1, B, T] with [B, T] = "
                         f"{list(m.shape)} (mask), got {shape}")
    if not values.is_floating_point():
        raise ValueError(f"values must be a floating tensor, got dtype {values.dtype}")
    dtype = torch.promote_types(values.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    v = values.to(dtype)                  # a NaN off mask stays in its own token, masked below
    mean = v.mean(dim=0)
    std = (v - mean).square().mean(dim=0).sqrt()
    return torch.where(m, mean, zero), torch.where(m, std, zero)


def _check_frac(name: str, value: object) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if not (math.isfinite(float(value)) and 0 <= float(value) <= 1):
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return Fraction(repr(float(value)))


def uncertainty_counts(n_tokens: int, *, low_frac: float = 0.1,
                       high_frac: float = 0.2) -> tuple[int, int]:
    """How many tokens :func:`uncertainty_masks` selects: ``(floor(k n), floor(h n))``.

    Rounding is down (floor) so that the masks never remove more than the requested share of
    the batch's tokens: with few tokens (``n < 10`` at ``k = 0.1``) nothing is masked, rather
    than one token standing for 20% or 50% of the batch. ``k n`` is computed exactly (the
    fraction as the decimal it prints as), so ``floor(0.29 * 100) = 29`` although
    ``0.29 * 100 == 28.999999999999996`` in floating point.

    Args:
        n_tokens: Action tokens in the batch (>= 0).
        low_frac: ``k`` in ``[0, 1]``: share of lowest-std tokens whose advantage is zeroed.
        high_frac: ``h`` in ``[0, 1]``: share of highest-std tokens left out of the entropy bonus.

    Returns:
        ``(n_low, n_high)``, each in ``0 .. n_tokens``.

    Raises:
        ValueError: naming the argument when ``n_tokens`` is not an int >= 0 or a fraction is
            not a real number in ``[0, 1]`` (NaN and inf included).
    """
    check_int("n_tokens", n_tokens, 0)
    low = _check_frac("low_frac", low_frac)
    high = _check_frac("high_frac", high_frac)
    return math.floor(low * n_tokens), math.floor(high * n_tokens)


@torch.no_grad()
def uncertainty_masks(
    std: Tensor, mask: Tensor, *, low_frac: float = 0.1, high_frac: float = 0.2
) -> tuple[Tensor, Tensor]:
    """AsyPPO's masks from the critics' disagreement (arXiv 2510.01656; MISSION.md section 4).

    Over the action tokens of the WHOLE batch (``n`` = number of non-zero ``mask`` entries,
    not per sequence):

    * the ``n_low = floor(low_frac * n)`` tokens with the LOWEST std get ``advantage_keep = 0``
      (multiply the advantages by it: their advantage becomes 0);
    * the ``n_high = floor(high_frac * n)`` tokens with the HIGHEST std get
      ``entropy_keep = 0`` (pass it as ``token_weights`` to
      :func:`conveyor.trainer.losses.entropy_bonus`: they leave the entropy bonus).

    Counts: :func:`uncertainty_counts` (floor, so never more than the requested share; e.g.
    10 tokens at the defaults: 1 and 2).

    Ties (equal std values, compared exactly): the action tokens are put in ONE total order,
    ascending std then ascending flat position ``b * T + t`` (row-major: batch row first, then
    token); the lowest ``n_low`` are the first of that order, the highest ``n_high`` the last.
    So among tied tokens the earlier ones are taken as "lowest" and the later ones as
    "highest", and the two sets are disjoint whenever ``n_low + n_high <= n`` (always at the
    defaults). With one critic every std is 0 and the rule degenerates to positions; pass
    fractions 0 to disable it.

    Args:
        std: ``[B, T]`` real per-token inter-critic std (:func:`ensemble_stats`); must be
            finite on ``mask`` (anything outside ``mask`` is ignored).
        mask: ``[B, T]`` non-zero on action tokens. Positions outside it are never selected
            and do not count in ``n``.
        low_frac: ``k`` in ``[0, 1]`` (default 0.1).
        high_frac: ``h`` in ``[0, 1]`` (default 0.2).

    Returns:
        ``(advantage_keep [B, T], entropy_keep [B, T])`` in std's floating dtype (float32 for
        other dtypes): 1.0 on action tokens that keep their advantage / entropy term, 0.0 on
        the selected tokens AND outside ``mask`` (so each is also a valid token mask). An
        all-zero ``mask`` gives all zeros.

    Raises:
        ValueError: naming the argument: ``std`` not a real tensor of ``mask``'s shape, or
            non-finite on ``mask``; ``mask`` not 2-D; a fraction not a real number in
            ``[0, 1]``.
    """
    m = _check_mask(mask)
    if not isinstance(std, Tensor) or std.shape != m.shape or std.is_complex():
        shape = list(std.shape) if isinstance(std, Tensor) else type(std).__name__
        raise ValueError(f"std must be a real tensor of shape [B, T] = {list(m.shape)} "
                         f"(mask), got {shape}")
    flat_mask = m.reshape(-1)
    positions = flat_mask.nonzero().squeeze(1)               # ascending flat positions
    n_low, n_high = uncertainty_counts(int(positions.numel()), low_frac=low_frac,
                                       high_frac=high_frac)
    dtype = std.dtype if std.is_floating_point() else torch.float32
    s = std.reshape(-1)[positions]
    if not bool(torch.isfinite(s).all()):
        raise ValueError("std must be finite (no NaN or inf) on mask tokens")
    # stable sort: equal std keep their ascending flat-position order
    order = positions[torch.sort(s, stable=True).indices]
    adv = flat_mask.to(dtype)
    ent = adv.clone()
    adv[order[:n_low]] = 0
    ent[order[order.numel() - n_high:]] = 0
    return adv.reshape(m.shape), ent.reshape(m.shape)
