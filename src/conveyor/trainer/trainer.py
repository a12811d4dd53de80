"""The policy trainer: one call of :meth:`Trainer.train_step` is one policy update (one version).

A plain recipe in the torchtune sense: advantages (pure function) -> packed micro-batches ->
proximal log-probs (a forward pass with the parameters just before the update, AReaL's choice,
MISSION.md section 1) -> loss (pure function) with exact global token-mean normalisation across
micro-batches -> AdamW step with gradient clipping and a warm-up schedule.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from contextlib import nullcontext

import torch

from conveyor.config import LossConfig, ProximalConfig, TrainerConfig
from conveyor.faults import fault_point
from conveyor.hardware import resolve_bf16
from conveyor.memory import release_free_memory, set_malloc_mmap_threshold
from conveyor.sync import WeightUpdate
from conveyor.trainer import advantages as adv_lib
from conveyor.trainer import corrections as corr_lib
from conveyor.trainer import losses as loss_lib
from conveyor.trainer.batch import (
    PackedBatch,
    group_shared_prompts,
    pack,
    plan_micro_batches,
    unit_length,
    unit_members,
)
from conveyor.trainer.logprobs import token_logprobs
from conveyor.trainer.proximal import build_strategy
from conveyor.types import Trajectory

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """Raised after ``trainer.max_nonfinite_in_a_row`` consecutive steps with a non-finite loss or
    gradient norm (each such step is skipped and logged before).

    Attributes:
        metrics: The metrics of the step that raised it (skipped, ``train/skipped_nonfinite`` =
            1; the version was incremented), for the runtime to log before it stops, so the
            logs and the checkpoint agree on every step.
    """

    def __init__(self, message: str, metrics: dict[str, float] | None = None):
        super().__init__(message)
        self.metrics = metrics or {}


def compute_advantages(trajectories: list[Trajectory], estimator: str) -> torch.Tensor:
    """Scalar advantage per trajectory, ``[N]`` float32.

    Args:
        trajectories: The batch; ``group_id`` ties responses to the same prompt.
        estimator: ``"grpo"`` (group-normalised, arXiv 2402.03300), ``"dr_grpo"`` (no std division,
            arXiv 2503.20783) or ``"reinforce"`` (batch-mean baseline).
    """
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    if estimator == "reinforce":
        return adv_lib.reinforce_baseline_advantages(rewards)
    gid_of: dict[str, int] = {}
    gids = torch.tensor([gid_of.setdefault(t.group_id, len(gid_of)) for t in trajectories])
    if estimator not in ("grpo", "dr_grpo"):
        raise ValueError(f"loss.advantage: unknown estimator {estimator!r} (grpo, dr_grpo, reinforce)")
    return adv_lib.grpo_advantages(rewards, gids, scale_by_std=(estimator == "grpo"))


def staleness_metrics(trajectories: list[Trajectory], version: int) -> dict[str, float]:
    """Version lag of a batch consumed at trainer ``version``, measured from each trajectory's
    oldest token (MISSION.md section 1): ``staleness/max``, ``staleness/mean``,
    ``staleness/multi_version_share`` (share of trajectories spanning > 1 version)."""
    lags = [version - t.oldest_version for t in trajectories if t.versions]
    if not lags:
        return {"staleness/max": 0.0, "staleness/mean": 0.0, "staleness/multi_version_share": 0.0}
    return {
        "staleness/max": float(max(lags)),
        "staleness/mean": sum(lags) / len(lags),
        "staleness/multi_version_share": sum(t.num_versions > 1 for t in trajectories) / len(trajectories),
    }


class Trainer:
    """Owns the policy's parameters, the optimizer and the scheduler.

    Args:
        model: The policy (a transformers causal LM, fp32 parameters).
        trainer_cfg: Optimisation settings. loss_cfg: Loss and advantage settings.
        temperature: Rollout sampling temperature (log-probs are recomputed at it).
        version: Starting policy version.
        proximal_cfg: Where the old log-probs come from (``proximal.method``; default recompute).
        eta: The staleness bound (snapshot window, auto choice).
        max_new_tokens: Default constant of ``loss.aggregation = constant`` (tokens).

    The trainer never shares its parameters: :meth:`weight_update` returns copies.
    """

    def __init__(self, model: torch.nn.Module, trainer_cfg: TrainerConfig, loss_cfg: LossConfig, *, temperature: float = 1.0,
                 version: int = 0, proximal_cfg: ProximalConfig | None = None, eta: int | None = None,
                 max_new_tokens: int | None = None):
        self.model = model
        self.cfg = trainer_cfg
        # bf16 autocast where the hardware makes it faster (trainer.bf16=auto, conveyor.hardware)
        self.bf16, self.precision_note = resolve_bf16(trainer_cfg.bf16, "cpu")
        log.info(self.precision_note)
        self.loss_cfg = loss_cfg
        self.temperature = temperature if temperature > 0 else 1.0
        self.version = version
        self.nonfinite_in_a_row = 0
        pc = proximal_cfg or ProximalConfig()
        self.proximal, self.proximal_note = build_strategy(
            pc.method, model, eta=eta, version=version, interpolation=pc.interpolation, ewma_beta=pc.ewma_beta,
            ewma_reset_keep_rate=pc.ewma_reset_keep_rate, discrepancy_low=loss_cfg.discrepancy_low,
            discrepancy_high=loss_cfg.discrepancy_high, memory_budget_bytes=pc.memory_budget_bytes,
            dedicated_threads=pc.dedicated_threads,
        )
        if pc.method == "auto":
            log.info("proximal.method=auto chose %s: %s", self.proximal.name, self.proximal_note)
        self.events: list[dict] = []  # proximal-strategy events (e.g. EWMA resets) for the run log
        self.aggregation_constant = loss_cfg.aggregation_constant or max_new_tokens
        if loss_cfg.aggregation == "constant" and not self.aggregation_constant:
            raise ValueError("loss.aggregation=constant needs loss.aggregation_constant (tokens) or max_new_tokens")
        if loss_cfg.dis_preset is not None:
            self.dis_eps = loss_lib.DIS_PRESETS[loss_cfg.dis_preset]
        else:
            self.dis_eps = (loss_cfg.dis_eps_low, loss_cfg.dis_eps_high)
        self.ref_model = None
        if loss_cfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        # shared-prompt rows need an explicit 4-D attention mask, which sdpa and eager attention take
        # (flash-attention kernels do not): other implementations pack every response separately
        attn = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
        self._mask_capable = attn in ("sdpa", "eager")
        if trainer_cfg.share_prompts and not self._mask_capable:
            log.info("trainer.share_prompts: %s attention takes no 4-D mask; responses are packed separately", attn)
        if trainer_cfg.malloc_mmap_threshold is not None:
            set_malloc_mmap_threshold(trainer_cfg.malloc_mmap_threshold)
        params = [p for p in model.parameters() if p.requires_grad]
        # fused: one kernel per parameter, no multi-tensor temporaries (0.1 s vs 0.9 s for the
        # for-loop path on SmolLM2, 2 CPU threads; docs/results/performance.md)
        fused = trainer_cfg.use_fused_optimizer
        self.optimizer = torch.optim.AdamW(params, lr=trainer_cfg.lr, betas=trainer_cfg.betas, weight_decay=trainer_cfg.weight_decay,
                                           foreach=None if fused else trainer_cfg.optimizer_foreach, fused=fused or None)
        if trainer_cfg.activation_checkpointing:
            if not hasattr(model, "gradient_checkpointing_enable"):
                raise ValueError("trainer.activation_checkpointing needs a transformers model (gradient_checkpointing_enable)")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        total = max(1, trainer_cfg.total_steps * trainer_cfg.minibatches)
        warm = trainer_cfg.warmup_steps * trainer_cfg.minibatches

        def lr_lambda(step: int) -> float:
            if warm > 0 and step < warm:
                return (step + 1) / warm
            if trainer_cfg.schedule == "cosine":
                prog = min(1.0, (step - warm) / max(1, total - warm))
                return 0.5 * (1.0 + math.cos(math.pi * prog))
            return 1.0

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda)

    # ------------------------------------------------------------------ helpers
    def _autocast(self):
        # Without the weight cache every autocast matmul casts its fp32 weight afresh: under activation
        # checkpointing the cache would hold a bf16 copy of all weights (~270 MB for SmolLM2) through
        # the recomputation for little gain.
        if not self.bf16:
            return nullcontext()
        return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=self.cfg.use_autocast_weight_cache)

    def _logprobs(self, model, mb: PackedBatch, with_entropy: bool = False):
        with self._autocast():
            return token_logprobs(
                model, mb.input_ids, mb.position_ids, mb.targets, temperature=self.temperature,
                chunk_tokens=self.cfg.logprob_chunk_tokens, with_entropy=with_entropy, mask=mb.mask,
                attention_mask=mb.attention_mask, support=mb.support,  # sampling-mask replay
            )

    def weight_update(self) -> WeightUpdate:
        """The current parameters as a :class:`WeightUpdate` stamped with :attr:`version`."""
        return WeightUpdate.from_model(self.model, self.version)

    # ------------------------------------------------------------------ the update
    def train_step(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """One policy update on a batch of trajectories; increments :attr:`version` by one.

        A step whose loss or gradient norm is non-finite is skipped (no optimizer step, logged,
        ``train/skipped_nonfinite`` = 1) and still counts as a version, so the staleness
        accounting of the rollout controller stays exact.

        Returns:
            Metrics (floats): loss, clip fractions, importance-weight stats, KL, entropy, grad
            norm, learning rate, tokens, tokens/s, staleness, reward / advantage stats.

        Raises:
            ValueError: empty batch.
            NonFiniteLossError: ``max_nonfinite_in_a_row`` consecutive non-finite steps.
        """
        if not trajectories:
            raise ValueError("train_step: empty batch")
        t0 = time.perf_counter()
        cfg, lc = self.cfg, self.loss_cfg
        trim = release_free_memory if cfg.malloc_trim else (lambda: None)
        self.optimizer.zero_grad(set_to_none=True)  # the previous step's gradients are not needed any more
        trim()
        self.model.train()
        metrics: dict[str, float] = staleness_metrics(trajectories, self.version)
        advantages = compute_advantages(trajectories, lc.advantage)
        if cfg.share_prompts and self._mask_capable:  # a group's prompt once per row (batch.py, "Shared prompts")
            units = group_shared_prompts(trajectories, min(cfg.pack_row_tokens, cfg.micro_batch_tokens))
        else:
            units = list(range(len(trajectories)))
        lengths = [unit_length([trajectories[i] for i in unit_members(u)]) for u in units]
        plan = plan_micro_batches(lengths, cfg.micro_batch_tokens, cfg.pack_row_tokens)
        mbs = [pack(trajectories, advantages, [[units[k] for k in row] for row in rows]) for rows in plan]

        # proximal log-probs: the parameters just before the update (AReaL eq. 5)
        prox: list[torch.Tensor | None] = [None] * len(mbs)
        ents: list[torch.Tensor | None] = [None] * len(mbs)
        refs: list[torch.Tensor | None] = [None] * len(mbs)
        t_prox = time.perf_counter()
        # With one optimizer step per batch the parameters before the update are the ones of the
        # gradient forward pass, so pi_prox = that pass's log-probs, detached: identical values
        # (same parameters, same kernels), one forward pass fewer. With several minibatches the
        # parameters move between optimizer steps, so a separate pass runs first.
        reuse_forward = cfg.minibatches == 1 and not cfg.separate_proximal_pass
        needs_prox = lc.name in ("decoupled_ppo", "two_ratio")
        with torch.no_grad():
            for j, mb in enumerate(mbs):
                if needs_prox:
                    prox[j] = self.proximal.old_logprobs(self, mb)
                    if prox[j] is None and not reuse_forward:
                        cur, ents[j] = self._logprobs(self.model, mb, with_entropy=True)
                        prox[j] = self.proximal.from_forward(cur, mb, self.version)
                if self.ref_model is not None:
                    refs[j], _ = self._logprobs(self.ref_model, mb)
        metrics["time/proximal_s"] = time.perf_counter() - t_prox
        extra: dict[str, list[float]] = {}

        # minibatches: each is one optimizer step; the loss is a token-mean over the minibatch
        n_mini = min(cfg.minibatches, len(mbs))
        groups = [list(range(len(mbs)))[k::n_mini] for k in range(n_mini)]
        outs: list[loss_lib.LossOutput] = []
        kl_sum = 0.0
        ent_sum = 0.0
        grad_norms = []
        skipped = False
        aggs = [corr_lib.aggregation_weights(mb.mask, lc.aggregation, seq_index=mb.seq_index, constant=self.aggregation_constant)
                for mb in mbs]
        poison = fault_point("loss")  # chaos suite: a non-finite loss injected in this step
        for grp in groups:
            denom = sum(aggs[j][1] for j in grp)
            if denom == 0:
                continue
            self.optimizer.zero_grad(set_to_none=True)
            finite = True
            for j in grp:
                mb = mbs[j]
                lp, ent = self._logprobs(self.model, mb, with_entropy=ents[j] is None)
                if ents[j] is None:
                    ents[j] = ent
                tw = aggs[j][0]
                bw = None
                if needs_prox:
                    if prox[j] is None:
                        prox[j] = self.proximal.from_forward(lp.detach(), mb, self.version)
                    keep, rstats = corr_lib.rejection_stats(prox[j], mb.behaviour_logprobs, mb.mask, seq_index=mb.seq_index,
                                                            reject=lc.kl_reject, threshold=lc.kl_reject_threshold)
                    if lc.kl_reject is not None:
                        tw = tw * keep
                    for k, v in rstats.items():
                        extra.setdefault(k, []).append(v)
                    if lc.correction is not None and lc.name == "decoupled_ppo":
                        bw, cstats = corr_lib.mismatch_weights(
                            prox[j], mb.behaviour_logprobs, mb.mask, method=lc.correction, cap=lc.correction_cap,
                            low=lc.correction_low, high=lc.correction_high, seq_index=mb.seq_index)
                        for k, v in cstats.items():
                            extra.setdefault(k, []).append(v)
                if lc.name == "decoupled_ppo":
                    out = loss_lib.decoupled_ppo_loss(
                        lp, prox[j], mb.behaviour_logprobs, mb.advantages, mb.mask,
                        eps_low=lc.eps_low, eps_high=lc.eps_high, dual_clip=lc.dual_clip,
                        behaviour_weight_cap=lc.behaviour_weight_cap, cap_mode=lc.behaviour_weight_cap_mode,
                        token_weights=tw, behaviour_weights=bw,
                    )
                elif lc.name == "two_ratio":
                    out = loss_lib.two_ratio_loss(
                        lp, prox[j], mb.behaviour_logprobs, mb.advantages, mb.mask,
                        discrepancy_low=lc.discrepancy_low, discrepancy_high=lc.discrepancy_high,
                        eps_low=lc.eps_low, eps_high=lc.eps_high, dual_clip=lc.dual_clip, token_weights=tw,
                    )
                elif lc.name == "dis":
                    out = loss_lib.dis_loss(
                        lp, mb.behaviour_logprobs, mb.advantages, mb.mask,
                        eps_low=self.dis_eps[0], eps_high=self.dis_eps[1], token_weights=tw,
                    )
                else:
                    out = loss_lib.ppo_clip_loss(
                        lp, mb.behaviour_logprobs, mb.advantages, mb.mask,
                        eps_low=lc.eps_low, eps_high=lc.eps_high, dual_clip=lc.dual_clip, token_weights=tw,
                    )
                loss = out.loss_sum
                if refs[j] is not None:
                    # aggregated like the policy loss (loss.aggregation's weights and denominator;
                    # verl agg_loss on the KL term); not masked by loss.kl_reject (verl drops
                    # rejected tokens from its mask altogether); train/kl_ref: per-token mean
                    kl = loss_lib.kl_penalty(lp, refs[j], mb.mask, kind="k3",
                                             token_weights=aggs[j][0])
                    kl_sum += float(loss_lib.kl_penalty(lp.detach(), refs[j], mb.mask, kind="k3"))
                    loss = loss + lc.kl_coef * kl
                loss = loss / denom  # exact global normalisation over the minibatch (loss.aggregation)
                if poison:
                    loss = loss * float("nan")
                if not torch.isfinite(loss):
                    finite = False
                    break
                loss.backward()
                del loss, lp
                trim()  # this micro-batch's activations are freed
                outs.append(out)
            gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip or float("inf"))
            if not finite or not torch.isfinite(gn):
                self.optimizer.zero_grad(set_to_none=True)
                skipped = True
                break
            grad_norms.append(float(gn))
            fault_point("train_step")  # chaos suite: a kill inside a train step
            self.optimizer.step()
            self.scheduler.step()
            # per-optimiser-step proximal state (the EWMA); window: the batch's version window in
            # optimiser steps (MISSION.md section 2)
            t_ew = time.perf_counter()
            self.proximal.on_optimizer_step(self.model, int(metrics["staleness/max"]) * n_mini)
            metrics["time/proximal_s"] += time.perf_counter() - t_ew
        self.model.eval()

        self.version += 1
        stop: NonFiniteLossError | None = None
        if skipped:
            self.nonfinite_in_a_row += 1
            log.warning("step %d: non-finite loss or gradient norm, update skipped (%d in a row)", self.version, self.nonfinite_in_a_row)
            if self.nonfinite_in_a_row >= cfg.max_nonfinite_in_a_row:
                stop = NonFiniteLossError(  # raised with this step's metrics, below
                    f"{self.nonfinite_in_a_row} consecutive steps had a non-finite loss or gradient "
                    f"norm (trainer.max_nonfinite_in_a_row={cfg.max_nonfinite_in_a_row}); stopping. "
                    "Lower trainer.lr or check the rewards."
                )
        else:
            self.nonfinite_in_a_row = 0
        n_tok = sum(mb.num_tokens for mb in mbs)
        for j, mb in enumerate(mbs):
            if ents[j] is not None:
                ent_sum += float((ents[j] * mb.mask).sum())
        if outs:
            metrics.update({f"loss/{k}": v for k, v in loss_lib.aggregate(outs).items()})
        rewards = torch.tensor([t.reward for t in trajectories])
        metrics.update({
            "train/skipped_nonfinite": float(skipped),
            "train/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/tokens": float(n_tok),
            "train/micro_batches": float(len(mbs)),
            "train/entropy": ent_sum / max(1, n_tok),
            "train/kl_ref": kl_sum / max(1, n_tok),
            "train/advantage_abs_mean": float(advantages.abs().mean()),
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std(unbiased=False)),
            "time/train_step_s": time.perf_counter() - t0,
        })
        for k, v in extra.items():
            metrics[k] = sum(v) / len(v)
        t_after = time.perf_counter()
        st = self.proximal.after_update(self.model, self.version, metrics)
        metrics.update(st.values)
        self.events.extend(st.events)
        metrics["time/proximal_s"] += time.perf_counter() - t_after  # snapshot copy / EWMA update
        metrics["proximal/extra_bytes"] = float(self.proximal.extra_bytes())
        metrics["time/train_step_s"] = time.perf_counter() - t0
        metrics["train/tokens_per_s"] = n_tok / metrics["time/train_step_s"]
        if stop is not None:
            stop.metrics = metrics
            raise stop
        return metrics

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """Everything needed to continue exactly: model, optimizer, scheduler, version, counters."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "proximal": self.proximal.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        self.proximal.load_state_dict(state.get("proximal", {}))
        self.proximal.on_load(self.model, self.version)
