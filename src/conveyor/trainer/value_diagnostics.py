"""Does the critic predict the return? Pure diagnostics of a critic's values on trajectories it
did not train on (issue 45; MISSION.md sections 3-4: SAO's and AsyPPO's critics are only worth
their cost if their values carry information a group mean does not).

Everything here is a pure function of tensors and floats, computed without gradient, on the host:

* :func:`monte_carlo_returns` -- the discounted reward-to-go at each response token (the target a
  critic with ``lam = 1`` regresses on; with ``gamma = 1`` and one outcome reward it is the
  episode's reward at every action token).
* :func:`explained_variance` -- ``1 - Var(R - V) / Var(R)`` (verl's ``compute_explained_variance``
  / the ``critic/vf_explained_var`` of ``verl/trainer/ppo/metric_utils.py``, population variances).
* :func:`pearson` -- the Pearson correlation of two 1-D samples.
* :func:`calibration` -- equal-count bins of a prediction against the observed outcome (the
  reliability diagram of Niculescu-Mizil and Caruana 2005, with quantile bins).
* :func:`value_profile` -- the mean value at fractions of the response, for episodes that earned
  their reward and for those that did not: does the value move when the answer is written?
* :func:`value_diagnostics` -- all of the above over a set of :class:`ValueTrace`.

Names: a *trace* is one trajectory's values along its response. The *first-token value* is the
critic's value of the state in which the first response token is chosen (the prompt alone: a
prediction of the prompt's success rate). A prompt's *success rate* is the mean return over its
sampled responses in the set.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ValueTrace", "monte_carlo_returns", "explained_variance", "pearson", "calibration", "value_profile",
           "value_diagnostics"]


@dataclass
class ValueTrace:
    """One trajectory's values and returns along its response.

    Attributes:
        values: ``[T]`` float32, the critic's value of the state before each response token
            (``T`` = response tokens, observation tokens included; read only where ``action_mask``).
        returns: ``[T]`` float32, :func:`monte_carlo_returns` (0 on observation tokens).
        action_mask: ``[T]`` bool, True on tokens the policy generated.
        prompt_key: Which prompt the response answers (responses to one prompt share it).
    """

    values: Tensor
    returns: Tensor
    action_mask: Tensor
    prompt_key: str

    def __post_init__(self):
        t = self.values.shape
        if self.values.dim() != 1 or self.returns.shape != t or self.action_mask.shape != t:
            raise ValueError(f"ValueTrace: values, returns and action_mask must be 1-D of one length, got "
                             f"{list(self.values.shape)}, {list(self.returns.shape)}, {list(self.action_mask.shape)}")

    @property
    def first_action(self) -> int | None:
        """Index of the first action token (None: the response has none)."""
        idx = self.action_mask.nonzero()
        return int(idx[0, 0]) if idx.numel() else None

    @property
    def last_action(self) -> int | None:
        """Index of the last action token (None: the response has none)."""
        idx = self.action_mask.nonzero()
        return int(idx[-1, 0]) if idx.numel() else None


def monte_carlo_returns(reward: float, action_mask: Tensor, *, turn_rewards: Sequence[tuple[int, float]] | None = None,
                        gamma: float = 1.0) -> Tensor:
    """Discounted reward-to-go at each response token, the discount applied per action token
    (observation tokens are skipped, as SAO's skip-observation GAE does; MISSION.md section 3).

    ``G_t = sum_{k >= t, k action} gamma^(n(t, k)) r_k`` with ``n(t, k)`` the action tokens
    strictly between ``t`` and ``k``; ``r`` is ``reward`` on the last action token, or with
    ``turn_rewards`` each turn's reward on its token (as :meth:`conveyor.trainer.Trainer._gae`
    places them). This is GAE's return with ``lam = 1`` (``gae(values=0, lam=1)``).

    Args:
        reward: The episode's outcome reward (unitless).
        action_mask: ``[T]`` bool or 0/1, True on action tokens.
        turn_rewards: ``(response token, reward)`` pairs, each on an action token; replaces ``reward``.
        gamma: Discount per action token, in [0, 1].

    Returns:
        ``[T]`` float32; 0 on observation tokens and after the last rewarded token.

    Raises:
        ValueError: ``action_mask`` not 1-D, ``gamma`` outside [0, 1], a turn reward not on an action token.
    """
    if action_mask.dim() != 1:
        raise ValueError(f"action_mask must be 1-D [T], got shape {list(action_mask.shape)}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    act = action_mask != 0
    t = act.numel()
    r = torch.zeros(t, dtype=torch.float64)
    if turn_rewards:
        for k, rew in turn_rewards:
            if not (0 <= int(k) < t and bool(act[int(k)])):
                raise ValueError(f"turn reward at response token {k}, which is not an action token")
            r[int(k)] += float(rew)
    elif bool(act.any()):
        r[int(act.nonzero()[-1, 0])] = float(reward)
    out = torch.zeros(t, dtype=torch.float64)
    g = 0.0
    for i in range(t - 1, -1, -1):
        if act[i]:
            g = float(r[i]) + gamma * g
            out[i] = g
    return out.float()


def explained_variance(values: Tensor, returns: Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the elements (population variances): 1 = the values
    predict every return, 0 = no better than the mean return, < 0 = worse.

    Args:
        values: ``[N]`` predictions.
        returns: ``[N]`` targets.

    Returns:
        The explained variance; NaN when ``Var(R)`` < 1e-12 (nothing to explain) or ``N`` = 0.

    Raises:
        ValueError: shapes differ.
    """
    if values.shape != returns.shape:
        raise ValueError(f"values {list(values.shape)} and returns {list(returns.shape)} differ in shape")
    if values.numel() == 0:
        return float("nan")
    v, r = values.double().reshape(-1), returns.double().reshape(-1)
    var_r = float(r.var(unbiased=False))
    if var_r < 1e-12:
        return float("nan")
    return 1.0 - float((r - v).var(unbiased=False)) / var_r


def pearson(x: Tensor, y: Tensor) -> float:
    """Pearson correlation of two 1-D samples.

    Returns:
        In [-1, 1]; NaN with fewer than 2 points or a constant sample.

    Raises:
        ValueError: shapes differ.
    """
    if x.shape != y.shape:
        raise ValueError(f"x {list(x.shape)} and y {list(y.shape)} differ in shape")
    x, y = x.double().reshape(-1), y.double().reshape(-1)
    if x.numel() < 2:
        return float("nan")
    dx, dy = x - x.mean(), y - y.mean()
    den = math.sqrt(float((dx * dx).sum()) * float((dy * dy).sum()))
    return float((dx * dy).sum()) / den if den > 1e-12 else float("nan")


def calibration(pred: Tensor, outcome: Tensor, bins: int = 5) -> list[dict[str, float]]:
    """Equal-count bins of ``pred`` (sorted ascending; the first ``N mod bins`` bins one larger),
    each with its mean prediction and mean outcome: a calibrated critic has the two equal.

    Args:
        pred: ``[N]`` predictions (e.g. first-token values).
        outcome: ``[N]`` observed returns.
        bins: Number of bins (fewer when ``N`` < ``bins``).

    Returns:
        One dict per non-empty bin: ``value_mean``, ``return_mean``, ``count``.

    Raises:
        ValueError: shapes differ or ``bins`` < 1.
    """
    if pred.shape != outcome.shape:
        raise ValueError(f"pred {list(pred.shape)} and outcome {list(outcome.shape)} differ in shape")
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    p, o = pred.double().reshape(-1), outcome.double().reshape(-1)
    order = torch.argsort(p, stable=True)
    out = []
    for chunk in torch.tensor_split(order, min(bins, max(p.numel(), 1))):
        if chunk.numel():
            out.append({"value_mean": float(p[chunk].mean()), "return_mean": float(o[chunk].mean()),
                        "count": float(chunk.numel())})
    return out


def value_profile(traces: Sequence[ValueTrace], bins: int = 5) -> dict[str, list[float]]:
    """The mean value at ``bins`` equal fractions of each response's action tokens (bin ``b``
    holds the action tokens at relative position ``[b / bins, (b + 1) / bins)``), averaged over
    the responses whose return at the first action token is > 0.5 (``success``) and the rest
    (``failure``): a critic that reads the answer rises on successes and falls on failures
    towards the end.

    Returns:
        ``{"success": [bins], "failure": [bins]}``; NaN where no response contributes.
    """
    sums = {k: torch.zeros(bins, dtype=torch.float64) for k in ("success", "failure")}
    counts = {k: torch.zeros(bins, dtype=torch.float64) for k in ("success", "failure")}
    for tr in traces:
        idx = tr.action_mask.nonzero().squeeze(-1)
        if not idx.numel():
            continue
        kind = "success" if float(tr.returns[idx[0]]) > 0.5 else "failure"
        v = tr.values[idx].double()
        b = (torch.arange(idx.numel()) * bins) // idx.numel()
        per = torch.zeros(bins, dtype=torch.float64).index_add_(0, b, v)
        n = torch.zeros(bins, dtype=torch.float64).index_add_(0, b, torch.ones_like(v))
        has = n > 0
        sums[kind][has] += per[has] / n[has]  # each response counts once per bin
        counts[kind][has] += 1
    return {k: [float(s / c) if c else float("nan") for s, c in zip(sums[k], counts[k], strict=True)]
            for k in sums}


def value_diagnostics(traces: Sequence[ValueTrace], *, bins: int = 5) -> dict[str, float | list]:
    """A critic's predictions against what happened, over trajectories it did not train on.

    Returns:
        ``explained_variance`` (every action token's value against its return),
        ``first_explained_variance`` (the first-token value against the episode's return),
        ``last_explained_variance`` (the value of the last action token's state against its
        return), ``first_value_corr`` (Pearson, first-token value vs the episode's return),
        ``prompt_corr`` (Pearson over prompts with 2 or more responses: the mean first-token value
        vs the prompt's success rate; NaN with fewer than 2 such prompts), ``prompt_explainable``
        (the share of the first-token return variance that the prompts' success rates explain:
        the most a value of the prompt alone can reach), ``value_mean``, ``return_mean``,
        ``value_abs_error`` (mean ``|V - R|`` over action tokens), ``trajectories``,
        ``calibration`` (:func:`calibration` of first-token values) and ``profile``
        (:func:`value_profile`); NaNs where undefined.
    """
    vals, rets, firsts, first_r, lasts, last_r, keys = [], [], [], [], [], [], []
    for tr in traces:
        a = tr.action_mask != 0
        if not bool(a.any()):
            continue
        vals.append(tr.values[a].float())
        rets.append(tr.returns[a].float())
        i, j = tr.first_action, tr.last_action
        firsts.append(float(tr.values[i]))
        first_r.append(float(tr.returns[i]))
        lasts.append(float(tr.values[j]))
        last_r.append(float(tr.returns[j]))
        keys.append(tr.prompt_key)
    nan = float("nan")
    if not vals:
        return {"explained_variance": nan, "first_explained_variance": nan, "last_explained_variance": nan,
                "first_value_corr": nan, "prompt_corr": nan, "prompt_explainable": nan, "value_mean": nan,
                "return_mean": nan, "value_abs_error": nan, "trajectories": 0.0, "calibration": [],
                "profile": value_profile([], bins)}
    v, r = torch.cat(vals), torch.cat(rets)
    f, fr = torch.tensor(firsts), torch.tensor(first_r)
    by: dict[str, list[int]] = defaultdict(list)
    for n, k in enumerate(keys):
        by[k].append(n)
    multi = [ix for ix in by.values() if len(ix) >= 2]
    if len(multi) >= 2:
        pv = torch.tensor([float(f[ix].mean()) for ix in multi])
        ps = torch.tensor([float(fr[ix].mean()) for ix in multi])
        prompt_corr = pearson(pv, ps)
        members = torch.tensor([n for ix in multi for n in ix])
        rate = torch.cat([fr[ix].mean().expand(len(ix)) for ix in multi])
        prompt_explainable = explained_variance(rate, fr[members])
    else:
        prompt_corr = prompt_explainable = nan
    return {
        "explained_variance": explained_variance(v, r),
        "first_explained_variance": explained_variance(f, fr),
        "last_explained_variance": explained_variance(torch.tensor(lasts), torch.tensor(last_r)),
        "first_value_corr": pearson(f, fr),
        "prompt_corr": prompt_corr,
        "prompt_explainable": prompt_explainable,
        "value_mean": float(v.mean()),
        "return_mean": float(r.mean()),
        "value_abs_error": float((v - r).abs().mean()),
        "trajectories": float(len(vals)),
        "calibration": calibration(f, fr, bins),
        "profile": value_profile(traces, bins),
    }
