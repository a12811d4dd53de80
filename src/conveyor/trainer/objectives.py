"""The policy objectives as a registry: each ``loss.name`` maps to the inputs it needs and the pure
loss function (:mod:`conveyor.trainer.losses`) that computes it.

The trainer asks the registry what to compute before the update (a proximal policy or not,
training-inference mismatch weights or not) and then calls :meth:`Objective.loss` with one
:class:`ObjectiveInputs` per micro-batch; it never dispatches on the objective's name. A new
objective is one :func:`register` call.

Sources: ``ppo`` (PPO-clip against the behaviour policy, arXiv 1707.06347 eq. 7),
``decoupled_ppo`` (AReaL, arXiv 2505.24298 eq. 5; MISSION.md section 1), ``two_ratio``
(arXiv 2605.12070; MISSION.md section 2), ``dis`` (SAO's double-sided mask; MISSION.md
section 3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from conveyor.config import LossConfig
from conveyor.trainer import losses as loss_lib


@dataclass
class ObjectiveInputs:
    """What an objective may read for one packed micro-batch (all ``[R, L]``, aligned with the
    targets of :class:`~conveyor.trainer.batch.PackedBatch`).

    Attributes:
        current: ``log pi_theta`` of each target token, with gradient.
        behaviour: ``log pi_behav`` recorded by the engine.
        advantages: Per-token advantages (0 off the action tokens).
        mask: 1.0 on action tokens (the loss's tokens).
        proximal: ``log pi_prox`` (detached) where the objective needs it, else None.
        token_weights: Aggregation weights x rejection mask (``loss.aggregation``,
            ``loss.kl_reject``), or None.
        behaviour_weights: Training-inference mismatch weights (``loss.correction``), or None.
        entropy: Per-token entropy (nats), with gradient, where an entropy bonus asks for it;
            None otherwise.
    """

    current: Tensor
    behaviour: Tensor
    advantages: Tensor
    mask: Tensor
    proximal: Tensor | None = None
    token_weights: Tensor | None = None
    behaviour_weights: Tensor | None = None
    entropy: Tensor | None = None


LossFn = Callable[[ObjectiveInputs, LossConfig, tuple[float, float]], loss_lib.LossOutput]


@dataclass(frozen=True)
class Objective:
    """One policy objective.

    Attributes:
        name: The ``loss.name`` that selects it.
        needs_proximal: Whether ``ObjectiveInputs.proximal`` must be computed (a forward pass or
            a proximal strategy; MISSION.md section 2).
        takes_correction: Whether ``loss.correction`` (mismatch weights on ``pi_prox /
            pi_behav``) applies to it.
        fn: ``fn(inputs, loss_cfg, dis_eps) -> LossOutput`` (the summed loss and its metrics;
            the trainer divides by the aggregation denominator).
    """

    name: str
    needs_proximal: bool
    takes_correction: bool
    fn: LossFn

    def loss(self, inputs: ObjectiveInputs, loss_cfg: LossConfig, dis_eps: tuple[float, float]) -> loss_lib.LossOutput:
        """The objective's :class:`~conveyor.trainer.losses.LossOutput` on one micro-batch.

        Raises:
            ValueError: ``inputs.proximal`` is None for an objective that needs it (and whatever
                the loss function raises for mismatched shapes).
        """
        if self.needs_proximal and inputs.proximal is None:
            raise ValueError(f"loss.name={self.name} needs proximal log-probs; none were computed")
        return self.fn(inputs, loss_cfg, dis_eps)


OBJECTIVES: dict[str, Objective] = {}


def register(objective: Objective) -> Objective:
    """Add ``objective`` to :data:`OBJECTIVES` (a later registration of a name replaces it)."""
    OBJECTIVES[objective.name] = objective
    return objective


def get_objective(name: str) -> Objective:
    """The registered objective called ``name``.

    Raises:
        ValueError: no such objective (the message lists the registered ones).
    """
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"loss.name: unknown objective {name!r} (registered: {', '.join(sorted(OBJECTIVES))})") from None


def _ppo(x: ObjectiveInputs, lc: LossConfig, dis_eps: tuple[float, float]) -> loss_lib.LossOutput:
    return loss_lib.ppo_clip_loss(x.current, x.behaviour, x.advantages, x.mask, eps_low=lc.eps_low,
                                  eps_high=lc.eps_high, dual_clip=lc.dual_clip, token_weights=x.token_weights)


def _decoupled_ppo(x: ObjectiveInputs, lc: LossConfig, dis_eps: tuple[float, float]) -> loss_lib.LossOutput:
    return loss_lib.decoupled_ppo_loss(
        x.current, x.proximal, x.behaviour, x.advantages, x.mask, eps_low=lc.eps_low, eps_high=lc.eps_high,
        dual_clip=lc.dual_clip, behaviour_weight_cap=lc.behaviour_weight_cap, cap_mode=lc.behaviour_weight_cap_mode,
        token_weights=x.token_weights, behaviour_weights=x.behaviour_weights,
    )


def _two_ratio(x: ObjectiveInputs, lc: LossConfig, dis_eps: tuple[float, float]) -> loss_lib.LossOutput:
    return loss_lib.two_ratio_loss(
        x.current, x.proximal, x.behaviour, x.advantages, x.mask, discrepancy_low=lc.discrepancy_low,
        discrepancy_high=lc.discrepancy_high, eps_low=lc.eps_low, eps_high=lc.eps_high, dual_clip=lc.dual_clip,
        token_weights=x.token_weights,
    )


def _dis(x: ObjectiveInputs, lc: LossConfig, dis_eps: tuple[float, float]) -> loss_lib.LossOutput:
    return loss_lib.dis_loss(x.current, x.behaviour, x.advantages, x.mask, eps_low=dis_eps[0], eps_high=dis_eps[1],
                             token_weights=x.token_weights)


register(Objective("ppo", needs_proximal=False, takes_correction=False, fn=_ppo))
register(Objective("decoupled_ppo", needs_proximal=True, takes_correction=True, fn=_decoupled_ppo))
register(Objective("two_ratio", needs_proximal=True, takes_correction=False, fn=_two_ratio))
register(Objective("dis", needs_proximal=False, takes_correction=False, fn=_dis))
