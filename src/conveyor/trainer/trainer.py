"""The policy trainer: one call of :meth:`Trainer.train_step` is one policy update (one version).

A plain recipe in the torchtune sense: advantages (pure function) -> packed micro-batches ->
proximal log-probs (a forward pass with the parameters just before the update, AReaL's choice,
MISSION.md section 1) -> loss (pure function) with exact global token-mean normalisation across
micro-batches -> AdamW step with gradient clipping and a warm-up schedule.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conveyor import devices
from conveyor.config import (
    ConfigError,
    CriticConfig,
    LoraConfig,
    LossConfig,
    ProximalConfig,
    TrainConfig,
    TrainerConfig,
    data_parallel_unsupported,
)
from conveyor.faults import fault_point
from conveyor.hardware import resolve_bf16
from conveyor.memory import release_free_memory, set_malloc_mmap_threshold
from conveyor.sync import WeightUpdate
from conveyor.trainer import advantages as adv_lib
from conveyor.trainer import corrections as corr_lib
from conveyor.trainer import credit as credit_lib
from conveyor.trainer import critic as critic_lib
from conveyor.trainer import distributed as dp_lib
from conveyor.trainer import ensemble as ensemble_lib
from conveyor.trainer import gae as gae_lib
from conveyor.trainer import losses as loss_lib
from conveyor.trainer import value_diagnostics as vd_lib
from conveyor.trainer.batch import PackedBatch, pack_micro_batches
from conveyor.trainer.logprobs import ScoringSpec, token_logprobs, zero_loss
from conveyor.trainer.lora import inference_copy
from conveyor.trainer.objectives import ObjectiveInputs, get_objective
from conveyor.trainer.proximal import build_strategy
from conveyor.trainer.reference import reference_from_attached, score_reference
from conveyor.trainer.updater import Updater
from conveyor.trainer.value_diagnostics import ValueTrace
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


def _response_layout(mb: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Where a packed micro-batch's response tokens go in a ``[S, T]`` layout (one row per
    trajectory of ``mb.indices``, response token ``k`` in column ``k``).

    Returns:
        ``(pos, s_idx, k_idx, S, T)``: flat positions of ``mb``'s ``[R, L]`` tensors that hold a
        response token, their row and column, the rows (trajectories) and columns (the longest
        response, at least 1).
    """
    pos = (mb.response_index >= 0).reshape(-1).nonzero().squeeze(-1)
    s_idx = mb.seq_index.reshape(-1)[pos]
    k_idx = mb.response_index.reshape(-1)[pos]
    return pos, s_idx, k_idx, len(mb.indices), int(k_idx.max()) + 1 if k_idx.numel() else 1


@dataclass
class StepBatch:
    """One step's batch after :meth:`Trainer.pack`.

    Attributes:
        trajectories: The ``N`` trajectories of the step.
        micro_batches: Packed micro-batches covering them (``PackedBatch.indices`` map back).
        token_weights: Per micro-batch ``[R, L]`` aggregation weights (``loss.aggregation``).
        denominators: Per micro-batch share of the loss's normaliser (tokens or sequences).
        sequence_advantages: ``[N]`` scalar advantage per trajectory (outcome estimators), set by
            :meth:`Trainer.assign_advantages`.
        padded: Per micro-batch, whether it is a zero-weight copy that only keeps data-parallel
            processes' collectives in step (``trainer.world_size`` > 1; never trained on).
        total_denominator: With data parallelism, the sum of every process's ``denominators``
            (the whole batch's normaliser); None otherwise.
        total_micro_batches: Micro-batches of the whole batch over all processes (padding excluded).
    """

    trajectories: list[Trajectory]
    micro_batches: list[PackedBatch]
    token_weights: list[torch.Tensor]
    denominators: list[float]
    sequence_advantages: torch.Tensor | None = None
    padded: list[bool] = field(default_factory=list)
    total_denominator: float | None = None
    total_micro_batches: int = 0


@dataclass
class Scores:
    """What :meth:`Trainer.score` computed before the update, one entry per micro-batch (None
    where not needed or not yet computed); all ``[R, L]`` and detached.

    Attributes:
        proximal: ``log pi_prox`` of each target token (objectives that need it).
        reference: ``log pi_ref`` (the KL penalty's reference policy).
        entropy: Per-token entropy of the policy (nats), filled by whichever forward pass computes
            it first.
        values: The critic's values ``V`` before its update (``loss.advantage=gae``), on every
            response token (actions and observations).
        returns: The critic's regression targets, set with the advantages (GAE with the critic's
            lambda; :mod:`conveyor.trainer.gae`).
        value_std: With ``critic.num_critics`` >= 2: the critics' per-token std (``values`` is
            then their mean; AsyPPO, :mod:`conveyor.trainer.ensemble`).
        entropy_keep: With an ensemble: 1 on action tokens that keep the entropy bonus, 0 on the
            highest-std share ``critic.mask_high_frac`` (set with the advantages).
        critic_values: With an ensemble: ``[N, R, L]``, each critic's own pre-update values.
        ensemble_metrics: ``critic/ensemble_*`` statistics of the step.
        value_seconds: Wall-clock seconds of the critic's value forward passes in this phase.
        reference_seconds: Wall-clock seconds of the reference policy's forward passes (the KL
            penalty's ``log pi_ref``): not proximal-policy cost, logged as ``time/reference_s``.
        reference_tokens / reference_precomputed_tokens: Action tokens given ``log pi_ref``, and
            how many of them came scored before the update (``trainer.reference_scoring``,
            :mod:`conveyor.trainer.reference`) instead of from a forward pass of this phase.
    """

    proximal: list[torch.Tensor | None]
    reference: list[torch.Tensor | None]
    entropy: list[torch.Tensor | None]
    values: list[torch.Tensor | None] = field(default_factory=list)
    returns: list[torch.Tensor | None] = field(default_factory=list)
    value_seconds: float = 0.0
    reference_seconds: float = 0.0
    reference_tokens: int = 0
    reference_precomputed_tokens: int = 0
    value_std: list[torch.Tensor | None] = field(default_factory=list)
    entropy_keep: list[torch.Tensor | None] = field(default_factory=list)
    critic_values: list[torch.Tensor | None] = field(default_factory=list)
    ensemble_metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class PolicyUpdate:
    """What :meth:`Trainer.policy_update` did: loss outputs per micro-batch, gradient norms per
    optimiser step, the KL sum (nats, over tokens), rejection / correction statistics, whether it
    stopped on a non-finite value, and the seconds its proximal strategy spent."""

    outputs: list[loss_lib.LossOutput] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    kl_sum: float = 0.0
    extra: dict[str, list[float]] = field(default_factory=dict)
    skipped: bool = False
    proximal_seconds: float = 0.0
    entropy_sum: float = 0.0


def build_trainer(cfg: TrainConfig, model: torch.nn.Module, *, bf16_choice: bool | None = None,
                  data_parallel: dp_lib.DataParallel | None = None) -> Trainer:
    """The run's :class:`Trainer` from its configuration (``trainer``, ``loss``, ``proximal``,
    ``critic``, ``lora``; the rollout's temperature and length; ``async.eta``), the same in every
    trainer process.

    Raises:
        ConfigError: see :class:`Trainer`.
    """
    return Trainer(model, cfg.trainer, cfg.loss, temperature=cfg.rollout.temperature, proximal_cfg=cfg.proximal,
                   eta=cfg.asynchronous.eta, max_new_tokens=cfg.rollout.max_new_tokens, critic_cfg=cfg.critic,
                   bf16_choice=bf16_choice, lora_cfg=cfg.lora, data_parallel=data_parallel)


class Trainer:
    """Owns the policy's parameters and the updaters that train them (:attr:`updaters`: the
    policy's optimizer and schedule; :class:`~conveyor.trainer.updater.Updater`).

    Args:
        model: The policy (a transformers causal LM, fp32 parameters).
        trainer_cfg: Optimisation settings. loss_cfg: Loss and advantage settings.
        temperature: Rollout sampling temperature (log-probs are recomputed at it).
        version: Starting policy version.
        proximal_cfg: Where the old log-probs come from (``proximal.method``; default recompute).
        eta: The staleness bound (snapshot window, auto choice).
        max_new_tokens: Default constant of ``loss.aggregation = constant`` (tokens).
        critic_cfg: The value model's settings, used when ``loss_cfg.advantage == "gae"``
            (default :class:`~conveyor.config.CriticConfig`).
        bf16_choice: ``trainer.bf16=auto``'s choice made earlier in this run (a resume keeps it:
            :func:`conveyor.rundir.recorded_bf16`), used instead of measuring; None: measure
            (:func:`conveyor.hardware.resolve_bf16`). Ignored when ``trainer.bf16`` is true / false.
        data_parallel: This process's place among ``trainer.world_size`` trainer processes
            (:mod:`conveyor.trainer.distributed`; torch.distributed must be initialised): the
            policy is sharded with FSDP2 and each process trains on its share of every batch's
            micro-batches (with LoRA the adapters are sharded with their frozen base weights;
            rank 0 gathers only the adapters to publish, checkpoint and export). None: one process.
        lora_cfg: ``lora.*``; with ``enabled`` the policy is wrapped with peft
            (:func:`conveyor.trainer.lora.apply_lora`, in place: ``model`` gets LoRA layers), the
            optimizer holds only the adapters, the KL reference is the base model (adapters
            disabled) and :meth:`weight_update` sends merged weights or the adapter
            (``lora.sync``). The critic (``loss.advantage=gae``) is built from the base model and
            trains fully, as without LoRA.

    Raises:
        ConfigError: a bad ``critic.backbone``, LoRA target modules that do not fit the model, or
            an option data parallelism does not support yet (:meth:`_check_data_parallel`).

    The trainer never shares its parameters: :meth:`weight_update` returns copies.
    """

    def __init__(self, model: torch.nn.Module, trainer_cfg: TrainerConfig, loss_cfg: LossConfig, *, temperature: float = 1.0,
                 version: int = 0, proximal_cfg: ProximalConfig | None = None, eta: int | None = None,
                 max_new_tokens: int | None = None, critic_cfg: CriticConfig | None = None,
                 bf16_choice: bool | None = None, lora_cfg: LoraConfig | None = None,
                 data_parallel: dp_lib.DataParallel | None = None):
        self.dp = data_parallel
        if data_parallel is not None:
            self._check_data_parallel(trainer_cfg, loss_cfg, proximal_cfg or ProximalConfig(), lora_cfg, critic_cfg)
        # where the models run (trainer.device; conveyor.devices): the policy, its reference copy and
        # the critics move there; packing, advantages and losses stay on the host
        # (data parallelism runs on gloo processes: auto means the CPU there)
        setting = "cpu" if data_parallel is not None and trainer_cfg.device == "auto" else trainer_cfg.device
        try:
            self.device = devices.resolve(setting, "trainer.device")
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if data_parallel is not None and self.device.type != "cpu":
            raise ConfigError(f"trainer.world_size={data_parallel.world_size} with trainer.device={trainer_cfg.device} "
                              f"({self.device}): data parallelism runs on the CPU (gloo) only so far; set "
                              "trainer.device=cpu or trainer.world_size=1")
        model.to(self.device)
        log.info("trainer: models on %s", self.device)
        # where weight updates are staged for the engine (the runtime sets it: build_rollout):
        # None / the host: pinned host copies from a GPU; a GPU: copies on this trainer's GPU
        self.publish_device: torch.device | None = None
        self.lora = None  # conveyor.trainer.lora.LoraPolicy with lora.enabled
        if lora_cfg is not None and lora_cfg.enabled:
            from conveyor.trainer.lora import apply_lora

            self.lora = apply_lora(model, lora_cfg)  # adapters injected into `model` itself
            log.info(self.lora.note)
        self.model = model
        self.cfg = trainer_cfg
        # bf16 autocast where the hardware makes it faster (trainer.bf16=auto, conveyor.hardware)
        self.bf16, self.precision_note = resolve_bf16(trainer_cfg.bf16, self.device.type, recorded=bf16_choice)
        log.info(self.precision_note)
        self.loss_cfg = loss_cfg
        self.temperature = temperature if temperature > 0 else 1.0
        self.version = version
        self.nonfinite_in_a_row = 0
        self.settings_taken: list[str] = []  # optimizer settings a resume changed (load_state_dict)
        pc = proximal_cfg or ProximalConfig()
        self.proximal, self.proximal_note = build_strategy(
            pc.method, model, eta=eta, version=version, interpolation=pc.interpolation, ewma_beta=pc.ewma_beta,
            ewma_reset_keep_rate=pc.ewma_reset_keep_rate, discrepancy_low=loss_cfg.discrepancy_low,
            discrepancy_high=loss_cfg.discrepancy_high, memory_budget_bytes=pc.memory_budget_bytes,
            dedicated_threads=pc.dedicated_threads,
            lora_base=self.engine_lora_base() if pc.method == "dedicated" else None,
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
        # the KL penalty's reference: a frozen copy of the initial policy; with LoRA the base model
        # itself under peft's disable_adapter() (the initial policy too: B starts at 0), no copy
        self.ref_model = None
        if loss_cfg.kl_coef > 0 and self.lora is None:
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
        # fused: one kernel per parameter, no multi-tensor temporaries (0.1 s vs 0.9 s for the
        # for-loop path on SmolLM2, 2 CPU threads; docs/results/performance.md)
        if trainer_cfg.activation_checkpointing:
            if not hasattr(model, "gradient_checkpointing_enable"):
                raise ValueError("trainer.activation_checkpointing needs a transformers model (gradient_checkpointing_enable)")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._unsharded = None
        self._roots: dict[int, dp_lib.ShardedRoot] = {}  # id(model) -> its FSDP2 root
        # the critic (MISSION.md section 3): its own model and updater; K updates per policy update
        self.critic_cfg = critic_cfg or CriticConfig()
        self.critic: critic_lib.ValueModel | critic_lib.HeadCritic | None = None  # critics[0]
        self.critic_updater: Updater | None = None  # critic_updaters[0]
        # AsyPPO's ensemble (MISSION.md section 4): critic.num_critics critics, each its own updater
        self.critics: list = []
        self.critic_updaters: list[Updater] = []
        self.critic_warmup_done = 0  # critic-only steps taken before RL (critic.warmup_steps)
        self.critic_note = ""
        if loss_cfg.advantage == "gae":
            cc = self.critic_cfg
            k = cc.updates_per_step
            frozen = 0
            # with LoRA a copied backbone comes from the base model (no LoRA layers); a head
            # critic reads the policy's own hidden states; built before the policy is sharded
            # (data parallelism), so that a copied backbone copies plain tensors
            source = (inference_copy(model, merged=False) if self.lora is not None and not cc.backbone.startswith("head")
                      else model)
            for i in range(cc.num_critics):
                try:  # seed i: each critic its own value-head init
                    critic = critic_lib.build_value_model(source, cc.backbone, seed=i)
                except (ValueError, RuntimeError) as e:  # e.g. policy:L beyond the policy's layers, an unknown model
                    raise ConfigError(f"critic.backbone={cc.backbone}: {e}") from e
                critic.to(self.device)  # (a preset's backbone and every value head are made on the host)
                frozen = critic_lib.freeze_attention(critic) if cc.freeze_attention else 0
                if cc.lora_rank > 0:  # adapters on the backbone; its weights frozen (critic.lora_rank)
                    try:
                        critic_lib.apply_lora(critic, cc.lora_rank, cc.lora_alpha, freeze_attention=cc.freeze_attention,
                                              seed=i)
                    except ValueError as e:
                        raise ConfigError(f"critic.lora_rank={cc.lora_rank}: {e}") from e
                if self.dp is not None:  # sharded like the policy (frozen attention stays frozen)
                    try:
                        self._roots[id(critic)] = dp_lib.shard_model(critic)
                    except ValueError as e:
                        raise ConfigError(f"critic.backbone={cc.backbone}: {e}") from e
                up = Updater.adamw(
                    "critic" if i == 0 else f"critic{i}", critic, lr=cc.lr, betas=cc.betas,
                    weight_decay=cc.weight_decay, grad_clip=cc.grad_clip,
                    total_steps=(trainer_cfg.total_steps + cc.warmup_steps) * k, fused=trainer_cfg.use_fused_optimizer,
                    foreach=trainer_cfg.optimizer_foreach,
                )
                self.critics.append(critic)
                self.critic_updaters.append(up)
            self.critic, self.critic_updater = self.critics[0], self.critic_updaters[0]
            counts = critic_lib.param_count_by_kind(self.critic)
            ens = (f"{cc.num_critics} critics (AsyPPO ensemble: mask k {cc.mask_low_frac}, h {cc.mask_high_frac}), each "
                   if cc.num_critics > 1 else "")
            trainable = sum(p.numel() for p in self.critic.parameters() if p.requires_grad)
            lora_note = (f", LoRA rank {cc.lora_rank} alpha {cc.lora_alpha:g}: {trainable:,} trainable"
                         if cc.lora_rank > 0 else "")
            self.critic_note = (f"critic: {ens}backbone {cc.backbone} ({sum(counts.values()):,} parameters, "
                                f"{frozen:,} of them in frozen attention{lora_note}), K = {k} updates per policy update")
            log.info(self.critic_note)

        # data parallelism: an unsharded twin (rank 0) to hand plain weights to engines and
        # evaluations, then FSDP2 shards the policy before its optimizer is built
        # (with LoRA: a copy of the peft model, whose adapters each publish gathers: the base
        # weights never change)
        self._twin_lora = None  # with LoRA: a LoraPolicy over rank 0's unsharded twin
        if self.dp is not None:
            if self.dp.leader:
                if self.lora is not None:
                    from conveyor.trainer.lora import LoraPolicy

                    self._twin_lora = LoraPolicy(copy.deepcopy(self.lora.peft_model), self.lora.cfg)
                    self._unsharded = self._twin_lora.model.eval()
                else:
                    self._unsharded = copy.deepcopy(model).eval()
                for p in self._unsharded.parameters():
                    p.requires_grad_(False)
            try:
                self._roots[id(model)] = dp_lib.shard_model(model)
                if self.ref_model is not None:  # the KL reference: sharded alike, forward only
                    self._roots[id(self.ref_model)] = dp_lib.shard_model(self.ref_model)
            except ValueError as e:
                raise ConfigError(str(e)) from e
            log.info("trainer: rank %d of %d, policy sharded with FSDP2", self.dp.rank, self.dp.world_size)
        self.policy = Updater.adamw(
            "policy", model, lr=trainer_cfg.lr, betas=trainer_cfg.betas, weight_decay=trainer_cfg.weight_decay,
            grad_clip=trainer_cfg.grad_clip, total_steps=trainer_cfg.total_steps * trainer_cfg.minibatches,
            warmup_steps=trainer_cfg.warmup_steps * trainer_cfg.minibatches, schedule=trainer_cfg.schedule,
            fused=trainer_cfg.use_fused_optimizer, foreach=trainer_cfg.optimizer_foreach,
        )
        self.updaters: list[Updater] = [self.policy, *self.critic_updaters]
        self.objective = get_objective(loss_cfg.name)
        self.baseline = gae_lib.SlidingWindowBaseline(loss_cfg.baseline_window) if loss_cfg.advantage == "sliding_window" else None

    @staticmethod
    def _check_data_parallel(tc: TrainerConfig, lc: LossConfig, pc: ProximalConfig, lora_cfg: LoraConfig | None,
                             critic_cfg: CriticConfig | None) -> None:
        """Refuse, naming the key, what ``trainer.world_size`` > 1 does not support yet: an
        ensemble of critics or a head critic, several minibatches, proximal strategies that keep
        model copies (:func:`conveyor.config.data_parallel_unsupported`; LoRA is supported).

        Raises:
            ConfigError: one of the above, naming every offending key."""
        bad = data_parallel_unsupported(tc, lc, pc, lora_cfg, critic_cfg)
        if bad:
            raise ConfigError("trainer.world_size > 1 (FSDP2 data parallelism) does not support: " + "; ".join(bad))

    @property
    def folds_value_pass(self) -> bool:
        """Whether the critic's pre-update values come from its first update's forward pass
        (:meth:`critic_phase`): one critic with a backbone of its own and
        ``critic.separate_value_pass=false``. An ensemble needs every critic's values before any
        return is known (the returns regress on their mean); a head critic reads the policy's
        hidden states, which the policy update changes."""
        cc = self.critic_cfg
        return (self.critic is not None and len(self.critics) == 1 and not cc.separate_value_pass
                and not isinstance(self.critic, critic_lib.HeadCritic))

    @property
    def in_critic_warmup(self) -> bool:
        """Whether critic-only warm-up steps remain (``critic.warmup_steps``; the policy waits at
        version 0 until they are done)."""
        return self.critic is not None and self.critic_warmup_done < self.critic_cfg.warmup_steps

    @property
    def log_step(self) -> int:
        """The step the run's logs key the latest row by: the policy version, or ``k - W`` after
        critic warm-up step ``k`` of ``W`` (so warm-up rows are at steps ``1 - W .. 0``, before
        the first policy update at step 1, and a resume supersedes what came after its
        checkpoint with one rule)."""
        if self.critic is not None and self.version == 0:
            return self.critic_warmup_done - self.critic_cfg.warmup_steps
        return self.version

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The policy's optimizer."""
        return self.policy.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        """The policy's learning-rate schedule."""
        return self.policy.scheduler

    # ------------------------------------------------------------------ helpers
    def _autocast(self):
        # Without the weight cache every autocast matmul casts its fp32 weight afresh: under activation
        # checkpointing the cache would hold a bf16 copy of all weights (~270 MB for SmolLM2) through
        # the recomputation for little gain.
        return devices.autocast(self.device, self.bf16, cache_enabled=self.cfg.use_autocast_weight_cache)

    def _trim(self) -> None:
        if self.cfg.malloc_trim:
            release_free_memory()

    def _logprobs(self, model, mb: PackedBatch, with_entropy: bool = False, entropy_grad: bool = False):
        """``(log-probs [R, L], entropy [R, L] or None)`` of ``mb``'s targets under ``model``
        (:func:`~conveyor.trainer.logprobs.token_logprobs` on the trainer's device; the results on
        the host, differentiable: the loss's gradient flows back to the device)."""
        root = self._roots.get(id(model))
        call = token_logprobs if root is None else (lambda m, *a, **k: root(token_logprobs, *a, **k))
        x = mb.model_inputs(self.device)
        with self._autocast():
            lp, ent = call(
                model, x.input_ids, x.position_ids, x.targets, temperature=self.temperature,
                chunk_tokens=self.cfg.logprob_chunk_tokens, with_entropy=with_entropy, mask=x.mask,
                attention_mask=x.attention_mask, support=x.support,  # sampling-mask replay
                entropy_grad=entropy_grad,
            )
        return devices.to_host((lp, ent))

    def _values(self, mb: PackedBatch, mask: torch.Tensor, critic=None, *,
                body_states: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """A critic's values ``[R, L]`` (float32) at the positions where ``mask`` > 0
        (``critic``: default the first); through its FSDP2 root with data parallelism.

        ``body_states``: for a head critic (``critic.backbone=head``), the policy body's hidden
        states of each micro-batch by ``id(mb)``, filled on first use: every head critic of an
        ensemble and every one of the K updates reads them instead of running the policy body
        again. The caller scopes the dict to one state of the policy's parameters (a phase that
        takes no policy step); the values are the same as without it."""
        critic = critic if critic is not None else self.critic
        root = self._roots.get(id(critic))
        fn = critic_lib.token_values
        call = fn if root is None else (lambda m, *a, **k: root(fn, *a, **k))
        x = mb.model_inputs(self.device)
        with self._autocast():
            hidden = None  # (on the device, as the critic)
            if body_states is not None and isinstance(critic, critic_lib.HeadCritic):
                hidden = body_states.get(id(mb))
                if hidden is None:
                    hidden = body_states[id(mb)] = critic.body_states(x.input_ids, x.position_ids, x.attention_mask)
            values = call(critic, x.input_ids, x.position_ids, mask=devices.to(mask, self.device),
                          attention_mask=x.attention_mask, hidden=hidden)
        return devices.to_host((values,))[0]

    @dp_lib.collective()
    def weight_update(self) -> WeightUpdate:
        """The current parameters as a :class:`WeightUpdate` stamped with :attr:`version`: every
        tensor (full fine-tuning), or with LoRA the merged targeted weights (``lora.sync=merged``)
        or the adapter factors (``adapter``; :meth:`conveyor.trainer.lora.LoraPolicy.weight_update`).
        A trainer on a GPU stages full weights on its own GPU when :attr:`publish_device` is a GPU
        (an engine in this process on a GPU copies them device to device), else in pinned host
        memory (:meth:`conveyor.sync.WeightUpdate.from_model`)."""
        if self.dp is not None:  # collective: every process calls it; rank 0 gets the weights
            policy = self._unsharded_policy()
            if policy is None:
                return None
            if self.lora is not None:
                return self._twin_lora.weight_update(self.version)
            return WeightUpdate.from_model(policy, self.version)
        if self.lora is not None:
            return self.lora.weight_update(self.version)
        if self.device.type == "cuda":  # staged for the engine: on this GPU, or pinned on the host
            if self.publish_device is not None and torch.device(self.publish_device).type == "cuda":
                return WeightUpdate.from_model(self.model, self.version, device=self.device)
            return WeightUpdate.from_model(self.model, self.version, pin_memory=True)
        return WeightUpdate.from_model(self.model, self.version)

    def _unsharded_policy(self) -> torch.nn.Module | None:
        """Data parallelism: the full weights gathered into rank 0's unsharded twin (collective;
        None on other ranks). With LoRA only the adapters are gathered (the frozen base weights
        are the twin's own)."""
        if self.lora is not None:
            state = dp_lib.gather_params(self.model, self.lora.adapter_keys)
            if not self.dp.leader:
                return None
            with torch.no_grad():
                for name, t in state.items():
                    self._unsharded.get_parameter(name).copy_(t)
            return self._unsharded
        state = dp_lib.full_model_state(self.model)
        if not self.dp.leader:
            return None
        self._unsharded.load_state_dict(state)
        return self._unsharded

    @dp_lib.collective()
    def inference_policy(self) -> torch.nn.Module:
        """The policy as a plain transformers model for engines, evaluations and the export: the
        trained model itself (full fine-tuning; callers copy it), or with LoRA a new copy with
        the adapters merged and no peft modules. With data parallelism: an unsharded model with
        the gathered weights at rank 0 (collective; None on other ranks; callers copy it)."""
        if self.dp is not None:  # a copy: the twin is overwritten by every later gather
            twin = self._unsharded_policy()
            if twin is None:
                return None
            return self._twin_lora.inference_model() if self.lora is not None else copy.deepcopy(twin)
        return self.lora.inference_model() if self.lora is not None else self.model

    def save_adapter(self, directory: str | Path) -> Path | None:
        """With LoRA: the adapter as peft writes it (``adapter_config.json``,
        ``adapter_model.safetensors``; :meth:`conveyor.trainer.lora.LoraPolicy.save_adapter`),
        loadable with ``peft.PeftModel.from_pretrained(base_model, directory)``. With data
        parallelism (collective) rank 0 gathers the adapters and writes them; other ranks write
        nothing and get None.

        Raises:
            ValueError: the policy has no LoRA adapters (``lora.enabled=false``).
        """
        if self.lora is None:  # checked before the collective: the followers are never told
            raise ValueError("save_adapter: the policy is fully fine-tuned (lora.enabled=false), it has no adapter")
        return self._save_adapter(directory)

    @dp_lib.collective()
    def _save_adapter(self, directory: str | Path) -> Path | None:
        """:meth:`save_adapter` once LoRA is known to be on (collective with data parallelism)."""
        if self.dp is None:
            return self.lora.save_adapter(directory)
        if self._unsharded_policy() is None:
            return None
        return self._twin_lora.save_adapter(directory)

    def engine_lora_base(self) -> dict[str, torch.Tensor] | None:
        """The base weights ``W0`` an engine receiving adapters keeps (``lora.sync=adapter``:
        its ``lora_base``, copies); None otherwise."""
        if self.lora is None or self.lora.cfg.sync != "adapter":
            return None
        if self.dp is not None:  # the frozen W0: rank 0's twin holds them whole (None elsewhere)
            return self._twin_lora.base_weights() if self._twin_lora is not None else None
        return self.lora.base_weights()

    @property
    def has_reference(self) -> bool:
        """Whether the KL penalty has a reference policy (``loss.kl_coef > 0``): the frozen copy,
        or with LoRA the base model itself."""
        return self.ref_model is not None or (self.lora is not None and self.loss_cfg.kl_coef > 0)

    def _reference_logprobs(self, mb: PackedBatch) -> torch.Tensor:
        """``log pi_ref`` ``[R, L]`` of the KL penalty: the frozen copy, or the base model
        (adapters disabled) with LoRA."""
        if self.lora is not None:
            with self.lora.reference():
                lp, _ = self._logprobs(self.model, mb)
            return lp
        lp, _ = self._logprobs(self.ref_model, mb)
        return lp

    @property
    def shares_prompts(self) -> bool:
        """Whether a group's responses are packed with their prompt once per row
        (``trainer.share_prompts`` and an attention implementation that takes a 4-D mask)."""
        return self.cfg.share_prompts and self._mask_capable

    @property
    def reference_model(self) -> torch.nn.Module | None:
        """The KL penalty's frozen reference policy (a copy of the initial policy; eval mode, no
        gradients), for a component that scores it elsewhere (:mod:`conveyor.trainer.reference`:
        it only runs forward passes on it). None without ``loss.kl_coef > 0`` and with LoRA (the
        reference is then the policy itself with its adapters disabled)."""
        return self.ref_model

    def _attached_reference(self, mb: PackedBatch, trajectories: list[Trajectory]) -> tuple[torch.Tensor, int] | None:
        """``mb``'s reference log-probs from the values scored before the update
        (``trainer.reference_scoring=idle_engine`` / ``background``), the trajectories without them scored here
        with the frozen copy, and the precomputed action tokens; None when none came attached,
        and always with data parallelism or LoRA (the whole micro-batch then runs
        :meth:`_reference_logprobs`)."""
        if self.dp is not None or self.ref_model is None:
            return None
        return reference_from_attached(mb, lambda seqs: score_reference(
            self.scoring_spec(), self.ref_model, [trajectories[mb.indices[s]] for s in seqs],
            share_prompts=self.shares_prompts))

    def scoring_spec(self) -> ScoringSpec:
        """How this trainer computes log-probs (temperature, precision, chunking, packing), for
        the components that score old log-probs with other weights (the paused engine, the
        dedicated worker) with the trainer's exact numerics."""
        return ScoringSpec(temperature=self.temperature, bf16=self.bf16,
                           autocast_weight_cache=self.cfg.use_autocast_weight_cache,
                           chunk_tokens=self.cfg.logprob_chunk_tokens,
                           micro_batch_tokens=self.cfg.micro_batch_tokens, pack_row_tokens=self.cfg.pack_row_tokens)

    def scale_lr(self, factor: float) -> None:
        """Multiply the learning rate of every updater (policy and critics) by ``factor`` from
        now on (the run monitor's ``lr_scale`` action, MISSION.md section 4)."""
        for up in self.updaters:
            up.scale_lr(factor)

    def take_events(self) -> list[dict]:
        """The proximal strategy's events since the previous call (each ``{"event": name,
        ...}``, e.g. an EWMA reset), for the run log; the list is emptied."""
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------------ the update
    @dp_lib.collective()
    def train_step(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """One policy update on a batch of trajectories; increments :attr:`version` by one.

        The recipe, one method per phase: :meth:`pack` (micro-batches by token budget) ->
        :meth:`score` (everything computed with the parameters before the update: proximal and
        reference log-probs, the critic's values) -> :meth:`assign_advantages` (per token) ->
        :meth:`policy_update` (one optimiser step per minibatch) -> :meth:`critic_update` (K
        critic steps, ``loss.advantage=gae``) -> :meth:`step_metrics`. With one critic of its own
        backbone and ``critic.separate_value_pass=false`` (the default) the values come from the
        first critic update's forward pass instead of a pass of their own: :meth:`critic_phase`
        runs the values, the advantages and the K critic updates before the policy update (the
        critic and the policy share no parameter, so the order changes nothing computed).

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
        self.policy.zero_grad()  # the previous step's gradients are not needed any more
        self._trim()
        self.model.train()
        metrics: dict[str, float] = staleness_metrics(trajectories, self.version)
        batch = self.pack(trajectories)
        t_prox = time.perf_counter()
        fold = self.folds_value_pass
        scores = self.score(batch, skip_values=fold)
        # the score phase minus the critic's and the reference policy's forward passes (their own keys)
        metrics["time/proximal_s"] = time.perf_counter() - t_prox - scores.value_seconds - scores.reference_seconds
        if self.has_reference:
            metrics["time/reference_s"] = scores.reference_seconds
            # share of the KL reference's log-probs scored before the update (trainer.reference_scoring)
            metrics["reference/precomputed_frac"] = scores.reference_precomputed_tokens / max(1, scores.reference_tokens)
        if fold:  # values, advantages and the K critic updates in one phase, before the policy update
            t_critic = time.perf_counter()
            metrics.update(self.critic_phase(batch, scores))
            metrics["time/critic_s"] = time.perf_counter() - t_critic
        else:
            self.assign_advantages(batch, scores)
        update = self.policy_update(batch, scores, window=int(metrics["staleness/max"]))
        metrics["time/proximal_s"] += update.proximal_seconds
        self.model.eval()
        if self.critic is not None and not fold:
            t_critic = time.perf_counter()
            metrics.update(self.critic_update(batch, scores))
            # the K updates and the pre-update value forward of the score phase
            metrics["time/critic_s"] = time.perf_counter() - t_critic + scores.value_seconds
            metrics["time/critic_values_s"] = scores.value_seconds
        if self.critic is not None:
            metrics.update(self._value_metrics(batch, scores))
        self.version += 1
        stop = self._count_nonfinite(update.skipped)
        metrics.update(self.step_metrics(batch, scores, update))
        t_after = time.perf_counter()
        st = self.proximal.after_update(self.model, self.version, metrics)
        metrics.update(st.values)
        self.events.extend(st.events)
        metrics["time/proximal_s"] += time.perf_counter() - t_after  # snapshot copy / EWMA update
        metrics["proximal/extra_bytes"] = float(self.proximal.extra_bytes())
        metrics["time/train_step_s"] = time.perf_counter() - t0
        metrics["train/tokens_per_s"] = metrics["train/tokens"] / metrics["time/train_step_s"]
        if stop is not None:
            stop.metrics = metrics
            raise stop
        return metrics

    # ------------------------------------------------------------------ phases
    def pack(self, trajectories: list[Trajectory]) -> StepBatch:
        """Phase 1: the batch as packed micro-batches (advantages still 0) with their loss
        aggregation weights (``loss.aggregation``)."""
        cfg, lc = self.cfg, self.loss_cfg
        # a group's prompt once per row (batch.py, "Shared prompts")
        mbs = pack_micro_batches(trajectories, cfg.micro_batch_tokens, cfg.pack_row_tokens, share_prompts=self.shares_prompts)
        aggs = [corr_lib.aggregation_weights(mb.mask, lc.aggregation, seq_index=mb.seq_index, constant=self.aggregation_constant)
                for mb in mbs]
        weights, denoms = [a[0] for a in aggs], [a[1] for a in aggs]
        if self.dp is None:
            return StepBatch(trajectories, mbs, weights, denoms, padded=[False] * len(mbs), total_micro_batches=len(mbs))
        # data parallelism: every process packed the same batch; it keeps its share, padded with
        # zero-weight copies so every process runs as many passes (distributed.py)
        mine = dp_lib.assign_micro_batches([mb.input_ids.numel() for mb in mbs], self.dp.world_size)[self.dp.rank]
        n_pass = -(-len(mbs) // self.dp.world_size)
        smallest = min(range(len(mbs)), key=lambda j: mbs[j].input_ids.numel())
        pad = n_pass - len(mine)
        return StepBatch(
            trajectories,
            [mbs[j] for j in mine] + [dp_lib.padding_batch(mbs[smallest]) for _ in range(pad)],
            [weights[j] for j in mine] + [torch.zeros_like(weights[smallest]) for _ in range(pad)],
            [denoms[j] for j in mine] + [0.0] * pad,
            padded=[False] * len(mine) + [True] * pad, total_denominator=float(sum(denoms)),
            total_micro_batches=len(mbs),
        )

    def score(self, batch: StepBatch, *, values_only: bool = False, skip_values: bool = False,
              body_states: dict[int, torch.Tensor] | None = None) -> Scores:
        """Phase 2: what the update needs from the parameters before it (no gradient):
        proximal log-probs (the objective's choice, ``proximal.method``; AReaL eq. 5), the
        reference policy's log-probs (``loss.kl_coef > 0``) and the critic's values on every
        response token (``loss.advantage=gae``; observation tokens included, for the naive-GAE
        ablation). ``values_only``: the critic's values alone (a critic warm-up step).
        ``skip_values``: no value pass (:meth:`critic_phase` computes them). ``body_states``: the
        head critics' shared policy-body states (:meth:`_values`; default: this phase's own)."""
        n = len(batch.micro_batches)
        body_states = {} if body_states is None else body_states
        scores = Scores([None] * n, [None] * n, [None] * n, [None] * n, [None] * n, value_std=[None] * n,
                        entropy_keep=[None] * n, critic_values=[None] * n)
        # With one optimizer step per batch the parameters before the update are the ones of the
        # gradient forward pass, so pi_prox = that pass's log-probs, detached: identical values
        # (same parameters, same kernels), one forward pass fewer. With several minibatches the
        # parameters move between optimizer steps, so a separate pass runs first.
        reuse_forward = self.cfg.minibatches == 1 and not self.cfg.separate_proximal_pass
        with torch.no_grad():
            for j, mb in enumerate(batch.micro_batches):
                if self.objective.needs_proximal and not values_only:
                    scores.proximal[j] = self.proximal.old_logprobs(self, mb)
                    if scores.proximal[j] is None and not reuse_forward:
                        cur, scores.entropy[j] = self._logprobs(self.model, mb, with_entropy=True)
                        scores.proximal[j] = self.proximal.from_forward(cur, mb, self.version)
                if self.has_reference and not values_only:
                    t_r = time.perf_counter()
                    got = self._attached_reference(mb, batch.trajectories)  # scored before the update
                    if got is None:
                        scores.reference[j] = self._reference_logprobs(mb)
                    else:
                        scores.reference[j], pre = got
                        scores.reference_precomputed_tokens += pre
                    scores.reference_tokens += mb.num_tokens
                    scores.reference_seconds += time.perf_counter() - t_r
                if self.critic is not None and not skip_values:
                    t_v = time.perf_counter()
                    resp = (mb.response_index >= 0).float()
                    if len(self.critics) == 1:
                        scores.values[j] = self._values(mb, mask=resp, body_states=body_states)
                    else:  # the ensemble's mean, and its per-token std (AsyPPO)
                        each = torch.stack([self._values(mb, mask=resp, critic=c, body_states=body_states)
                                            for c in self.critics])
                        mean, std = ensemble_lib.ensemble_stats(each, resp)
                        scores.values[j], scores.value_std[j] = mean * resp, std * resp
                        scores.critic_values[j] = each  # [N, R, L]: each critic's own (value clipping)
                    scores.value_seconds += time.perf_counter() - t_v
        # FSDP2 keeps a root's parameters gathered after its forward (for the backward pass, which
        # the frozen reference never has and the critic's values had none of): free them
        # (embeddings, head)
        for m in ([self.ref_model] if self.ref_model is not None else []) + self.critics:
            if id(m) in self._roots:
                self._roots[id(m)].reshard()
        return scores

    def assign_advantages(self, batch: StepBatch, scores: Scores) -> None:
        """Phase 3: per-token advantages into each micro-batch's ``advantages`` (``loss.advantage``).

        Outcome estimators (grpo, dr_grpo, reinforce, sliding_window) give one scalar per
        trajectory, broadcast over its action tokens; ``gae`` runs token-level GAE per trajectory
        on the critic's values (:meth:`_gae`), which also sets ``scores.returns``.
        """
        lc = self.loss_cfg
        if lc.advantage == "gae":
            self._gae(batch, scores)
            return
        if lc.advantage == "sliding_window":
            adv = self.baseline.advantages(torch.tensor([t.reward for t in batch.trajectories], dtype=torch.float32))
        else:
            adv = compute_advantages(batch.trajectories, lc.advantage)
        batch.sequence_advantages = adv
        for mb in batch.micro_batches:
            idx = torch.tensor(mb.indices, dtype=torch.long)
            per_pos = adv[idx][mb.seq_index.clamp(min=0)]
            mb.advantages = per_pos * mb.mask

    def _gae(self, batch: StepBatch, scores: Scores) -> None:
        """Token-level GAE on every micro-batch (MISSION.md section 3; :mod:`conveyor.trainer.gae`).

        Each trajectory's response is laid out as one row ``[S, R_max]`` (``response_index``):
        the outcome reward on its last action token (a multi-turn episode: each turn's reward on
        its last action token, ``Trajectory.turn_rewards``), the pre-update values, its action mask
        (observation tokens 0). Advantages use the policy lambda (fixed, or length-adaptive
        ``1 - 1 / (alpha * l)``, l = action tokens), returns the critic lambda (VAPO's decoupled
        GAE); with ``critic.values=turn`` one value per action segment instead. The values are
        clamped to ``critic.value_bounds`` first where set (:func:`conveyor.trainer.gae.clamp_values`).
        Optional whitening over the batch's action tokens (``critic.whiten_advantages``).
        """
        seq_adv = torch.zeros(len(batch.trajectories))
        for j in range(len(batch.micro_batches)):
            self._gae_micro_batch(batch, scores, j, seq_adv)
        self._gae_finish(batch, scores, seq_adv)

    def _gae_micro_batch(self, batch: StepBatch, scores: Scores, j: int, seq_adv: torch.Tensor) -> None:
        """:meth:`_gae` on micro-batch ``j`` alone (its advantages and ``scores.returns[j]`` need
        ``scores.values[j]`` only); each of its trajectories' mean advantage into ``seq_adv [B]``."""
        cc = self.critic_cfg
        mb = batch.micro_batches[j]
        pos, s_idx, k_idx, S, T = _response_layout(mb)
        action = torch.zeros(S, T)
        action[s_idx, k_idx] = mb.mask.reshape(-1)[pos]
        valid = torch.zeros(S, T)
        valid[s_idx, k_idx] = 1.0
        values = torch.zeros(S, T)
        values[s_idx, k_idx] = scores.values[j].reshape(-1)[pos]
        values = gae_lib.clamp_values(values, cc.value_bounds)  # critic.value_bounds (null: unchanged)
        rewards = torch.zeros(S, T)
        n_act = action.sum(-1)
        has = n_act > 0
        last = (action * torch.arange(1, T + 1)).argmax(-1)  # last action token of each row
        r = torch.tensor([float(batch.trajectories[i].reward) for i in mb.indices])
        rewards[has.nonzero().squeeze(-1), last[has]] = r[has]
        padded = bool(batch.padded and batch.padded[j])  # a zero-weight copy: no action token
        for s_, i in enumerate([] if padded else mb.indices):  # multi-turn: each turn's reward on its token
            turns = batch.trajectories[i].turn_rewards
            if turns:
                rewards[s_] = 0.0
                for k, rew in turns:
                    if not (0 <= int(k) < T and action[s_, int(k)] > 0):
                        raise ValueError(f"trajectory {batch.trajectories[i].sample.id}: turn reward at response "
                                         f"token {k}, which is not an action token")
                    rewards[s_, int(k)] += float(rew)
        policy_lam = (gae_lib.adaptive_lambda(n_act, cc.lam_alpha) if cc.policy_lam == "adaptive"
                      else float(cc.policy_lam))
        if cc.values == "turn":
            adv, _ = gae_lib.turn_level_gae(rewards, values, action, gamma=cc.gamma, lam=policy_lam)
            _, ret = gae_lib.turn_level_gae(rewards, values, action, gamma=cc.gamma, lam=cc.lam)
        else:
            adv, ret = gae_lib.decoupled_gae(rewards, values, action, gamma=cc.gamma, policy_lam=policy_lam,
                                             critic_lam=cc.lam, skip_observations=cc.skip_observations,
                                             valid_mask=valid)
        flat_adv = torch.zeros(mb.mask.numel())
        flat_adv[pos] = adv[s_idx, k_idx]
        flat_ret = torch.zeros(mb.mask.numel())
        flat_ret[pos] = ret[s_idx, k_idx]
        mb.advantages = flat_adv.reshape(mb.mask.shape) * mb.mask
        scores.returns[j] = flat_ret.reshape(mb.mask.shape) * mb.mask
        if not padded:  # a padding copy's trajectories are another's
            idx = torch.tensor(mb.indices, dtype=torch.long)
            seq_adv[idx] = (adv * action).sum(-1) / n_act.clamp(min=1)

    def _gae_finish(self, batch: StepBatch, scores: Scores, seq_adv: torch.Tensor) -> None:
        """:meth:`_gae`'s batch-wide part, after every micro-batch: the per-trajectory means of all
        processes, whitening, an ensemble's uncertainty masks."""
        cc = self.critic_cfg
        if self.dp is not None:  # every trajectory's figure comes from the one process that has it
            seq_adv = torch.stack(dp_lib.all_gather(seq_adv, self.dp.world_size)).sum(0)
        if cc.whiten_advantages:
            flat = torch.cat([mb.advantages[mb.mask > 0] for mb in batch.micro_batches])
            if self.dp is not None:  # the whole batch's action tokens (padding copies have none)
                flat = torch.cat(dp_lib.all_gather(flat, self.dp.world_size))
            if flat.numel() > 1:
                mean, std = flat.mean(), flat.std(unbiased=False)
                for mb in batch.micro_batches:
                    mb.advantages = (mb.advantages - mean) / (std + 1e-8) * mb.mask
        if len(self.critics) > 1:
            self._uncertainty_masks(batch, scores)
        batch.sequence_advantages = seq_adv

    def _uncertainty_masks(self, batch: StepBatch, scores: Scores) -> None:
        """AsyPPO's masks from the critics' disagreement (MISSION.md section 4;
        :func:`conveyor.trainer.ensemble.uncertainty_masks`) over the action tokens of the WHOLE
        batch: the ``critic.mask_low_frac`` share with the lowest inter-critic std get advantage
        0, the ``critic.mask_high_frac`` share with the highest leave the entropy bonus
        (``scores.entropy_keep``)."""
        cc = self.critic_cfg
        mbs = batch.micro_batches
        sel = [mb.mask > 0 for mb in mbs]
        std = torch.cat([scores.value_std[j][sel[j]] for j in range(len(mbs))]).unsqueeze(0)
        adv_keep, ent_keep = ensemble_lib.uncertainty_masks(std, torch.ones_like(std), low_frac=cc.mask_low_frac,
                                                            high_frac=cc.mask_high_frac)
        o = 0
        for j, mb in enumerate(mbs):
            n = int(sel[j].sum())
            a = torch.zeros_like(mb.mask)
            e = torch.zeros_like(mb.mask)
            a[sel[j]] = adv_keep[0, o:o + n].to(a.dtype)
            e[sel[j]] = ent_keep[0, o:o + n].to(e.dtype)
            mb.advantages = mb.advantages * a
            scores.entropy_keep[j] = e
            o += n
        n_tok = max(1, std.numel())
        scores.ensemble_metrics = {
            "critic/ensemble_std_mean": float(std.mean()) if std.numel() else 0.0,
            "critic/advantage_masked_frac": float((adv_keep == 0).sum()) / n_tok,
            "critic/entropy_masked_frac": float((ent_keep == 0).sum()) / n_tok,
        }

    def critic_update(self, batch: StepBatch, scores: Scores, *,
                      body_states: dict[int, torch.Tensor] | None = None) -> dict[str, float]:
        """Phase 5 (``loss.advantage=gae``): ``critic.updates_per_step`` (K) optimiser steps of the
        critic on the returns computed once with the pre-update critic (SAO, MISSION.md section 3),
        each over the whole batch: ``0.5 (V - R)^2``, a token-mean over action tokens (observation
        tokens carry no value loss), optionally clipped around the pre-update values. With
        ``critic.num_critics`` N >= 2 (AsyPPO, MISSION.md section 4) critic ``c`` trains on its
        shard only: response ``j`` of each prompt goes to critic ``j mod N``
        (:func:`conveyor.trainer.ensemble.critic_sample_masks`); with one response per prompt
        (single-rollout streaming) the batch position takes the place of ``j``. Head critics
        (``critic.backbone=head``) read the policy body's states of each micro-batch computed
        once for all K updates and all N critics (``body_states``, :meth:`_values`; default: this
        phase's own, the policy's parameters being those after its update).

        Returns:
            ``critic/*`` metrics: value loss of the first and last update, explained variance of
            the pre-update critic, value / return means, clip fraction, gradient norm per block
            kind (attention, mlp, other; before clipping, mean over the K updates), lr, steps
            (means over the critics of an ensemble, plus ``critic/ensemble_*``). An update with a
            non-finite loss or gradient norm is skipped and counted.
        """
        mbs = batch.micro_batches
        n = len(self.critics)
        body_states = {} if body_states is None else body_states
        if n == 1:  # (no counted token: {} from the update itself, whose denominator is the same sum)
            return self._critic_update_one(self.critic, self.critic_updater, mbs, scores, [mb.mask for mb in mbs],
                                           scores.values, body_states=body_states)
        if sum(float(mb.mask.sum()) for mb in mbs) == 0:  # (an ensemble: never data-parallel)
            return {}
        trajs = batch.trajectories
        groups = [t.group_id for t in trajs]
        if len(set(groups)) == len(groups):  # one response per prompt: shard by batch position
            groups = [0] * len(groups)
        shard = ensemble_lib.critic_sample_masks(groups, n)  # [N, B] over the batch's trajectories
        per: list[dict[str, float]] = []
        for c in range(n):
            masks = []
            for mb in mbs:
                own = shard[c][torch.tensor(mb.indices, dtype=torch.long)].float()  # [S] of this micro-batch
                masks.append(mb.mask * own[mb.seq_index.clamp(min=0)] * (mb.seq_index >= 0))
            old = [scores.critic_values[j][c] for j in range(len(mbs))]
            per.append(self._critic_update_one(self.critics[c], self.critic_updaters[c], mbs, scores, masks, old,
                                               body_states=body_states))
        keys = {k for m in per for k in m}
        metrics = {k: sum(m[k] for m in per if k in m) / sum(1 for m in per if k in m) for k in keys}
        metrics["critic/updates"] = sum(m.get("critic/updates", 0.0) for m in per)
        metrics["critic/skipped_nonfinite"] = sum(m.get("critic/skipped_nonfinite", 0.0) for m in per)
        metrics.update(scores.ensemble_metrics)
        return metrics

    def critic_phase(self, batch: StepBatch, scores: Scores) -> dict[str, float]:
        """Phases 2-3 and 5 in one (:attr:`folds_value_pass`): the critic's pre-update values,
        the advantages and returns (:meth:`_gae`) and the K critic updates, the values taken from
        the first update's forward pass (with gradient) instead of a value pass of their own.
        Micro-batch ``j``'s returns need only its own values, so each micro-batch's GAE runs
        right after its forward pass and before its backward pass. The values and everything
        computed from them are those of the separate pass (same parameters, same inputs); one
        critic forward pass per step fewer (~10% of an SAO step of SmolLM2 on this CPU,
        docs/results/sao.md). A micro-batch after a non-finite loss (the update is skipped) gets
        its values from a pass without gradient. The first update's forward runs in train mode:
        a critic whose backbone has active dropout would see values that differ from an
        eval-mode pass (SmolLM2 and the presets have none; ``critic.separate_value_pass=true``
        otherwise).

        Returns:
            :meth:`critic_update`'s metrics.
        """
        mbs = batch.micro_batches
        seq_adv = torch.zeros(len(batch.trajectories))

        def first_pass(j: int, grad: bool) -> torch.Tensor:
            mb = mbs[j]
            resp = (mb.response_index >= 0).float()  # every response token (the naive-GAE ablation reads observations)
            with torch.set_grad_enabled(grad):
                v = self._values(mb, mask=resp)
            scores.values[j] = v.detach()
            self._gae_micro_batch(batch, scores, j, seq_adv)
            return torch.where(mb.mask != 0, v, torch.zeros((), dtype=v.dtype))  # action tokens (the value loss's)

        metrics = self._critic_update_one(self.critic, self.critic_updater, mbs, scores, [mb.mask for mb in mbs],
                                          scores.values, first_pass=first_pass)
        for j in range(len(mbs)):  # (only when the update had no counted token at all)
            if scores.values[j] is None:
                first_pass(j, grad=False)
        if id(self.critic) in self._roots:  # FSDP2: a forward without backward leaves the root gathered
            self._roots[id(self.critic)].reshard()
        self._gae_finish(batch, scores, seq_adv)
        return metrics

    def _critic_update_one(self, critic, up: Updater, mbs: list[PackedBatch], scores: Scores,
                           masks: list[torch.Tensor], old_values: list[torch.Tensor | None], *,
                           first_pass: Callable[[int, bool], torch.Tensor] | None = None,
                           body_states: dict[int, torch.Tensor] | None = None) -> dict[str, float]:
        """K optimiser steps of one critic on the tokens of ``masks`` (one ``[R, L]`` per
        micro-batch), value clipping around its own pre-update ``old_values``. With data
        parallelism every process runs a pass on each of its micro-batches (one without a
        counted token with a zero loss), the token-mean's denominator and the finite check are
        the whole batch's, and the metrics combine every process's sums.

        ``first_pass(j, grad)`` (:meth:`critic_phase`): the first update's values of micro-batch
        ``j`` (masked to ``masks[j]``), which also fills ``old_values[j]`` and ``scores.returns[j]``;
        every micro-batch goes through it once (without gradient after a non-finite loss)."""
        cc = self.critic_cfg
        dp = self.dp
        denom = sum(float(m.sum()) for m in masks)
        if dp is not None:
            denom = dp_lib.all_sum(denom)
        metrics: dict[str, float] = {}
        if denom == 0:
            return metrics  # (critic_phase then runs first_pass without gradient)
        critic.train()
        kinds: dict[str, float] = {"attention": 0.0, "mlp": 0.0, "other": 0.0}
        losses, skipped, norms = [], 0, []
        first = None
        for u in range(cc.updates_per_step):
            up.zero_grad()
            outs = []
            finite = True
            folded = first_pass is not None and u == 0  # the values come from this pass
            for j, mb in enumerate(mbs):
                m = masks[j]
                if not finite and dp is None:  # (folded: the values the advantages still need)
                    first_pass(j, False)
                    continue
                if not bool((m > 0).any()) and dp is None:
                    if folded:
                        first_pass(j, False)
                    continue  # (data parallelism: a zero-loss pass keeps the collectives in step)
                v = first_pass(j, True) if folded else self._values(mb, mask=m, critic=critic, body_states=body_states)
                # (old_values[j] read after first_pass, which sets it)
                out = critic_lib.value_loss(v, scores.returns[j], m, old_values=old_values[j] * m,
                                            clip=cc.value_clip)
                loss = out.loss_sum / denom
                if dp is not None:  # FSDP2 averages gradients over the processes; the sum is wanted
                    loss = loss * dp.world_size
                if not torch.isfinite(loss):
                    finite = False
                    if dp is None:
                        if not folded:
                            break
                        del loss, v
                        continue
                    loss = loss * 0.0  # keep the collectives in step; the update is skipped below
                loss.backward()
                outs.append(dataclasses.replace(out, loss_sum=out.loss_sum.detach()))
                del loss, v
                self._trim()
            if dp is not None:
                finite = dp_lib.all_true(finite)
                outs = [o for share in dp_lib.all_gather(outs, dp.world_size) for o in share]
            if finite:
                for name, g in critic_lib.grad_norm_by_kind(critic).items():
                    kinds[name] += g / cc.updates_per_step
            gn = up.clip_grad_norm()
            if not finite or not torch.isfinite(gn):
                up.zero_grad()
                skipped += 1
                continue
            norms.append(float(gn))
            up.step()
            vm = critic_lib.value_metrics(outs)
            losses.append(vm["loss"])
            if first is None:
                first = vm
        critic.eval()
        if first is not None:
            metrics.update({
                "critic/value_loss": first["loss"], "critic/value_loss_last": losses[-1],
                "critic/explained_variance": first["explained_variance"], "critic/value_mean": first["value_mean"],
                "critic/return_mean": first["return_mean"], "critic/clip_frac": first.get("clip_frac", 0.0),
            })
        metrics.update({f"critic/grad_norm_{name}": g for name, g in kinds.items()})
        metrics.update({
            "critic/grad_norm": sum(norms) / len(norms) if norms else float("nan"),
            "critic/lr": up.applied_lr if up.applied_lr is not None else up.lr, "critic/updates": float(len(norms)), "critic/skipped_nonfinite": float(skipped),
        })
        return metrics

    @dp_lib.collective()
    def critic_warmup_step(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """One critic-only step before RL (``critic.warmup_steps``; SAO's cold start, MISSION.md
        section 3): values, GAE returns and K critic updates on rollouts of the frozen initial
        policy. The policy, its optimizer and :attr:`version` are untouched;
        :attr:`critic_warmup_done` counts the step.

        Raises:
            ValueError: empty batch, or no critic (``loss.advantage`` is not ``gae``).
        """
        if self.critic is None:
            raise ValueError("critic_warmup_step: no critic (loss.advantage must be gae)")
        if not trajectories:
            raise ValueError("critic_warmup_step: empty batch")
        t0 = time.perf_counter()
        batch = self.pack(trajectories)
        if self.folds_value_pass:
            scores = self.score(batch, values_only=True, skip_values=True)
            metrics = self.critic_phase(batch, scores)
        else:  # no policy step in a warm-up step: one set of policy-body states for the head critics
            body_states: dict[int, torch.Tensor] = {}
            scores = self.score(batch, values_only=True, body_states=body_states)
            self._gae(batch, scores)
            metrics = self.critic_update(batch, scores, body_states=body_states)
        self.critic_warmup_done += 1
        metrics.update(self._value_metrics(batch, scores))
        rewards = torch.tensor([t.reward for t in trajectories])
        tokens = float(sum(mb.num_tokens for mb in batch.micro_batches))
        if self.dp is not None:
            tokens = dp_lib.all_sum(tokens)
        metrics.update({"reward/mean": float(rewards.mean()), "train/tokens": tokens,
                        "time/critic_warmup_step_s": time.perf_counter() - t0})
        return metrics

    def _value_traces(self, batch: StepBatch, scores: Scores) -> list[ValueTrace]:
        """:class:`ValueTrace` of each trajectory of ``batch`` from ``scores.values`` (the values
        before this step's critic updates; :meth:`trajectory_values` without a forward pass)."""
        trajectories = batch.trajectories
        per: list[torch.Tensor | None] = [None] * len(trajectories)
        for j, mb in enumerate(batch.micro_batches):
            if (batch.padded and batch.padded[j]) or scores.values[j] is None:
                continue
            pos, s_idx, k_idx, S, T = _response_layout(mb)
            grid = torch.zeros(S, T)
            grid[s_idx, k_idx] = scores.values[j].reshape(-1)[pos].float()
            for s_, i in enumerate(mb.indices):
                per[i] = grid[s_, : len(trajectories[i].response_ids)].clone()
        out = []
        for t, v in zip(trajectories, per, strict=True):
            if v is None:  # (another process's share under data parallelism)
                continue
            act = torch.tensor(t.action_mask if t.action_mask is not None else [1] * len(t.response_ids)) != 0
            ret = vd_lib.monte_carlo_returns(float(t.reward), act, turn_rewards=t.turn_rewards,
                                             gamma=self.critic_cfg.gamma)
            out.append(ValueTrace(v, ret, act, str(t.sample.id)))
        return out

    def _value_metrics(self, batch: StepBatch, scores: Scores) -> dict[str, float]:
        """``value/*``: :func:`~conveyor.trainer.value_diagnostics.value_diagnostics` of the values
        the critic gave this batch before training on it (trajectories it had not seen): the
        first-token value against the return (correlation, explained variance), the last action
        token's, the prompts' success rates (groups of 2 or more responses), and the calibration
        bins ``value/calib{b}_value`` / ``_return`` / ``_count`` (5 equal-count bins of the
        first-token values; the report's calibration panel); under data parallelism over every
        process's share (gathered)."""
        traces = self._value_traces(batch, scores)
        if self.dp is not None:  # every process's share: each computes the whole batch's figures
            traces = [t for share in dp_lib.all_gather(traces, self.dp.world_size) for t in share]
        d = vd_lib.value_diagnostics(traces)
        out = {f"value/{k}": float(d[k]) for k in ("explained_variance", "first_explained_variance",
                                                   "last_explained_variance", "first_value_corr", "prompt_corr",
                                                   "prompt_explainable", "value_abs_error")}
        out["value/first_value_mean"] = (sum(b["value_mean"] * b["count"] for b in d["calibration"])
                                         / max(1.0, d["trajectories"]))
        for b, row in enumerate(d["calibration"]):
            out[f"value/calib{b}_value"] = row["value_mean"]
            out[f"value/calib{b}_return"] = row["return_mean"]
            out[f"value/calib{b}_count"] = row["count"]
        return out

    def trajectory_values(self, trajectories: list[Trajectory]) -> list[ValueTrace]:
        """The critic's values along each trajectory's response, without gradient and without
        training (the ensemble's mean with ``critic.num_critics`` >= 2), with the Monte-Carlo
        returns they predict (:func:`conveyor.trainer.value_diagnostics.monte_carlo_returns`,
        ``critic.gamma``): the input of :func:`~conveyor.trainer.value_diagnostics.value_diagnostics`
        on trajectories the critic did not train on (issue 45).

        Returns:
            One :class:`~conveyor.trainer.value_diagnostics.ValueTrace` per trajectory, in order;
            ``prompt_key`` is the sample id.

        Raises:
            ValueError: no critic (``loss.advantage`` is not ``gae``), or data parallelism
                (each process holds a share of the batch).
        """
        if self.critic is None:
            raise ValueError("trajectory_values: no critic (loss.advantage must be gae)")
        if self.dp is not None:
            raise ValueError("trajectory_values: not with data parallelism (trainer.world_size > 1)")
        if not trajectories:
            return []
        batch = self.pack(trajectories)
        return self._value_traces(batch, self.score(batch, values_only=True))

    def policy_update(self, batch: StepBatch, scores: Scores, *, window: int) -> PolicyUpdate:
        """Phase 4: the policy's optimiser steps, one per minibatch (micro-batches ``k::n``), each
        with the loss normalised by the minibatch's aggregation denominator (exact across
        micro-batches). Stops at the first non-finite loss or gradient norm (no step taken for
        that minibatch; ``skipped``).

        Args:
            window: The batch's largest staleness (versions), the proximal strategy's window.
        """
        cfg, lc = self.cfg, self.loss_cfg
        mbs = batch.micro_batches
        n_mini = min(cfg.minibatches, len(mbs))
        groups = [list(range(len(mbs)))[k::n_mini] for k in range(n_mini)]
        up = PolicyUpdate()
        poison = fault_point("loss")  # chaos suite: a non-finite loss injected in this step
        for grp in groups:
            denom = batch.total_denominator if self.dp is not None else sum(batch.denominators[j] for j in grp)
            if denom == 0:
                continue
            self.policy.zero_grad()
            finite = True
            for j in grp:
                mb = mbs[j]
                padded = bool(batch.padded[j]) if batch.padded else False
                if padded or mb.num_tokens == 0:  # no loss token (padding, or every response filtered)
                    if self.dp is not None:  # a zero-gradient pass keeps the collectives in step
                        self._padding_pass(mb)
                    continue
                bonus = lc.entropy_coef > 0
                lp, ent = self._logprobs(self.model, mb, with_entropy=bonus or scores.entropy[j] is None,
                                         **({"entropy_grad": True} if bonus else {}))
                if scores.entropy[j] is None:
                    scores.entropy[j] = ent.detach()
                inputs = self._objective_inputs(mb, lp, scores, j, batch.token_weights[j], up.extra)
                out = self.objective.loss(inputs, lc, self.dis_eps)
                loss = out.loss_sum
                if bonus:  # aggregated like the loss (its token weights and denominator)
                    # an ensemble's highest-disagreement tokens leave the bonus (AsyPPO)
                    ent_mask = mb.mask if scores.entropy_keep[j] is None else mb.mask * scores.entropy_keep[j]
                    loss = loss - lc.entropy_coef * loss_lib.entropy_bonus(ent, ent_mask, token_weights=batch.token_weights[j])
                if scores.reference[j] is not None:
                    # aggregated like the policy loss (loss.aggregation's weights and denominator;
                    # verl agg_loss on the KL term); not masked by loss.kl_reject (verl drops
                    # rejected tokens from its mask altogether); train/kl_ref: per-token mean
                    ref = scores.reference[j]
                    kl = loss_lib.kl_penalty(lp, ref, mb.mask, kind="k3", token_weights=batch.token_weights[j])
                    up.kl_sum += float(loss_lib.kl_penalty(lp.detach(), ref, mb.mask, kind="k3"))
                    loss = loss + lc.kl_coef * kl
                loss = loss / denom  # exact global normalisation over the minibatch (loss.aggregation)
                if self.dp is not None:  # FSDP2 averages gradients over the processes; the sum is wanted
                    loss = loss * self.dp.world_size
                if poison:
                    loss = loss * float("nan")
                if not torch.isfinite(loss):
                    finite = False
                    if self.dp is None:
                        break
                    loss = loss * 0.0  # keep the collectives in step; the step is skipped below
                loss.backward()
                del loss, lp
                self._trim()  # this micro-batch's activations are freed
                up.outputs.append(out)
            if self.dp is not None:
                finite = dp_lib.all_true(finite)
            gn = self.policy.clip_grad_norm()
            if not finite or not torch.isfinite(gn):
                self.policy.zero_grad()
                up.skipped = True
                break
            up.grad_norms.append(float(gn))
            fault_point("train_step")  # chaos suite: a kill inside a train step
            self.policy.step()
            # per-optimiser-step proximal state (the EWMA); window: the batch's version window in
            # optimiser steps (MISSION.md section 2)
            t_ew = time.perf_counter()
            self.proximal.on_optimizer_step(self.model, window * n_mini)
            up.proximal_seconds += time.perf_counter() - t_ew
        return up

    def _padding_pass(self, mb: PackedBatch) -> None:
        """Data parallelism: a forward and backward pass of the policy with a zero loss
        (:func:`conveyor.trainer.logprobs.zero_loss`) on a micro-batch without loss tokens (a
        padding copy, :func:`conveyor.trainer.distributed.padding_batch`, or one whose responses
        were all filtered), so this process gathers and reduce-scatters every FSDP2 unit as often
        as the others."""
        root = self._roots[id(self.model)]
        x = mb.model_inputs(self.device)
        with self._autocast():
            zero = root(zero_loss, x.input_ids, x.position_ids, attention_mask=x.attention_mask)
        zero.backward()

    def _objective_inputs(self, mb: PackedBatch, lp: torch.Tensor, scores: Scores, j: int,
                          token_weights: torch.Tensor, extra: dict[str, list[float]]) -> ObjectiveInputs:
        """The objective's inputs for micro-batch ``j``: the proximal log-probs (from this forward
        pass where the strategy derives them from it), the rejection mask (``loss.kl_reject``)
        folded into the token weights, and the mismatch weights (``loss.correction``); their
        statistics go to ``extra``."""
        lc = self.loss_cfg
        tw, bw = token_weights, None
        if self.objective.needs_proximal:
            if scores.proximal[j] is None:
                scores.proximal[j] = self.proximal.from_forward(lp.detach(), mb, self.version)
            prox = scores.proximal[j]
            keep, rstats = corr_lib.rejection_stats(prox, mb.behaviour_logprobs, mb.mask, seq_index=mb.seq_index,
                                                    reject=lc.kl_reject, threshold=lc.kl_reject_threshold)
            if lc.kl_reject is not None:
                tw = tw * keep
            for k, v in rstats.items():
                extra.setdefault(k, []).append(v)
            if lc.correction is not None and self.objective.takes_correction:
                bw, cstats = corr_lib.mismatch_weights(
                    prox, mb.behaviour_logprobs, mb.mask, method=lc.correction, cap=lc.correction_cap,
                    low=lc.correction_low, high=lc.correction_high, seq_index=mb.seq_index)
                for k, v in cstats.items():
                    extra.setdefault(k, []).append(v)
        return ObjectiveInputs(current=lp, behaviour=mb.behaviour_logprobs, advantages=mb.advantages, mask=mb.mask,
                               proximal=scores.proximal[j], token_weights=tw, behaviour_weights=bw)

    def _count_nonfinite(self, skipped: bool) -> NonFiniteLossError | None:
        """Count a skipped step; the error to raise (after the step's metrics are logged) once
        ``trainer.max_nonfinite_in_a_row`` steps in a row were skipped."""
        if not skipped:
            self.nonfinite_in_a_row = 0
            return None
        self.nonfinite_in_a_row += 1
        log.warning("step %d: non-finite loss or gradient norm, update skipped (%d in a row)", self.version, self.nonfinite_in_a_row)
        if self.nonfinite_in_a_row < self.cfg.max_nonfinite_in_a_row:
            return None
        return NonFiniteLossError(
            f"{self.nonfinite_in_a_row} consecutive steps had a non-finite loss or gradient "
            f"norm (trainer.max_nonfinite_in_a_row={self.cfg.max_nonfinite_in_a_row}); stopping. "
            "Lower trainer.lr or check the rewards."
        )

    def step_metrics(self, batch: StepBatch, scores: Scores, update: PolicyUpdate) -> dict[str, float]:
        """Phase 5: the step's metrics (loss terms, grad norm, lr, tokens, entropy, KL, rewards)."""
        metrics: dict[str, float] = {}
        mbs = batch.micro_batches
        n_tok = sum(mb.num_tokens for mb in mbs)
        ent_sum = 0.0
        for j, mb in enumerate(mbs):
            if scores.entropy[j] is not None:
                ent_sum += float((scores.entropy[j] * mb.mask).sum())
        outputs, extra, kl_sum = update.outputs, update.extra, update.kl_sum
        adv_sum = float(sum(float(mb.advantages.sum()) for mb in mbs))  # padding copies: advantages 0
        credit = self._credit(batch)
        if self.dp is not None:  # the whole batch's figures: every process's share combined
            shares = dp_lib.all_gather((n_tok, ent_sum, kl_sum, adv_sum, outputs, extra, credit), self.dp.world_size)
            n_tok, ent_sum, kl_sum, adv_sum, credit = (sum(s[i] for s in shares) for i in (0, 1, 2, 3, 6))
            outputs = [o for s in shares for o in s[4]]
            extra = {}
            for s in shares:
                for k, v in s[5].items():
                    extra.setdefault(k, []).extend(v)
        if outputs:
            metrics.update({f"loss/{k}": v for k, v in loss_lib.aggregate(outputs).items()})
        rewards = torch.tensor([t.reward for t in batch.trajectories])
        grad_norms = update.grad_norms
        metrics.update({
            "train/skipped_nonfinite": float(update.skipped),
            # no loss token in the batch (e.g. every response filtered by reward.overlong=filter): no
            # optimiser step and no gradient, 0 rather than NaN; NaN still marks a skipped non-finite step
            "train/grad_norm": (sum(grad_norms) / len(grad_norms) if grad_norms
                                else 0.0 if n_tok == 0 and not update.skipped else float("nan")),
            "train/optimizer_steps": float(len(grad_norms)),
            "train/lr": self.policy.applied_lr if self.policy.applied_lr is not None else self.policy.lr,
            "train/tokens": float(n_tok),
            "train/micro_batches": float(batch.total_micro_batches or len(mbs)),
            "train/entropy": ent_sum / max(1, n_tok),
            "train/kl_ref": kl_sum / max(1, n_tok),
            "train/advantage_abs_mean": float(batch.sequence_advantages.abs().mean()),
            **({"train/advantage_token_mean": adv_sum / max(1, n_tok)} if self.critic is not None else {}),
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std(unbiased=False)),
        })
        metrics.update(credit_lib.credit_metrics(credit, rewards))
        for k, v in extra.items():
            metrics[k] = sum(v) / len(v)
        return metrics

    @staticmethod
    def _credit(batch: StepBatch) -> torch.Tensor:
        """``[N, 4]`` per-trajectory credit of the advantages the loss used (after whitening and
        masking; :func:`conveyor.trainer.credit.per_response_credit`) from this process's
        micro-batches; zero rows for trajectories it does not hold (padding copies skipped)."""
        out = torch.zeros(len(batch.trajectories), 4, dtype=torch.float64)
        for j, mb in enumerate(batch.micro_batches):
            if (batch.padded and batch.padded[j]) or mb.response_index is None or mb.advantages is None:
                continue
            pos, s_idx, k_idx, S, T = _response_layout(mb)
            adv, action = torch.zeros(S, T), torch.zeros(S, T)
            adv[s_idx, k_idx] = mb.advantages.reshape(-1)[pos].float()
            action[s_idx, k_idx] = mb.mask.reshape(-1)[pos].float()
            out[torch.tensor(mb.indices, dtype=torch.long)] += credit_lib.per_response_credit(adv, action)
        return out

    # ------------------------------------------------------------------ checkpointing
    @dp_lib.collective()
    def state_dict(self) -> dict:
        """Everything needed to continue exactly: model, optimizer, scheduler, version, counters;
        the critic's model, optimizer, schedule and warm-up count (``loss.advantage=gae``); the
        sliding-window baseline's history. With LoRA ``model`` holds only the adapter (the base
        weights are ``model.name``'s) and ``lora`` its rank, alpha and target modules. With data
        parallelism (collective) the full model and the optimizer state keyed by parameter name
        (``optimizer_format`` ``by_name``, loadable by any number of processes) at rank 0."""
        if self.dp is not None:
            if self.lora is not None:  # the adapters only, gathered (the base weights are model.name's)
                policy = {"model": dp_lib.gather_params(self.model, self.lora.adapter_keys), **self._lora_spec(),
                          "optimizer": dp_lib.full_optimizer_state(self.model, self.optimizer),
                          "optimizer_format": "by_name"}
            else:
                policy = _full_state(self.model, self.optimizer)
            return {
                **policy,
                "scheduler": self.scheduler.state_dict(), "optimizer_settings": dict(self.policy.settings),
                "version": self.version,
                "nonfinite_in_a_row": self.nonfinite_in_a_row, "proximal": self.proximal.state_dict(),
                **self._critic_states(),
                **({"baseline": self.baseline.state_dict()} if self.baseline is not None else {}),
            }
        return {
            "model": self.lora.adapter_state() if self.lora is not None else self.model.state_dict(),
            **self._lora_spec(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "optimizer_settings": dict(self.policy.settings),  # a resume with other values takes them
            "version": self.version,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "proximal": self.proximal.state_dict(),
            **self._critic_states(),
            **({"baseline": self.baseline.state_dict()} if self.baseline is not None else {}),
        }

    def _lora_spec(self) -> dict:
        """``{"lora": rank, alpha, target modules}`` of a LoRA policy's checkpoint (empty without)."""
        if self.lora is None:
            return {}
        return {"lora": {"rank": self.lora.cfg.rank, "alpha": self.lora.cfg.alpha,
                         "target_modules": list(self.lora.cfg.target_modules)}}

    def _critic_states(self) -> dict:
        """The critics' part of :meth:`state_dict`: ``critic`` (the first updater's state),
        ``critics_more`` (an ensemble's others), ``critic_warmup_done``; with data parallelism
        (collective) each holds the full model and its optimizer state keyed by parameter name
        at rank 0, as the policy's."""
        if not self.critic_updaters:
            return {}
        if self.dp is None:
            states = [u.state_dict() for u in self.critic_updaters]
        else:
            states = [{**_full_state(u.model, u.optimizer), "scheduler": u.scheduler.state_dict(), "steps": u.steps,
                       "optimizer_settings": dict(u.settings)} for u in self.critic_updaters]
        return {"critic": states[0], "critic_warmup_done": self.critic_warmup_done,
                "critic_lora_rank": self.critic_cfg.lora_rank,
                **({"critics_more": states[1:]} if len(states) > 1 else {})}

    def _load_updater(self, up: Updater, state: dict) -> None:
        """Restore a critic's :meth:`_critic_states` entry, written by any number of processes
        (collective with data parallelism: rank 0's full state is broadcast, followers get none)."""
        if self.dp is not None:  # collective; rank 0's state is broadcast (followers get none)
            dp_lib.load_full_model_state(up.model, state.get("model", {}))
        else:
            up.model.load_state_dict(state["model"])
        self._load_optimizer(up.model, up.optimizer, state)
        up.scheduler.load_state_dict(state["scheduler"])
        up.steps = int(state.get("steps", 0))
        self.settings_taken += [f"{up.name} {c}" for c in up.apply_settings(state.get("optimizer_settings"))]

    def _load_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load ``state["optimizer"]`` written by one process (keyed by position) or by several
        (``optimizer_format`` ``by_name``) into ``optimizer`` of ``model``; collective with data
        parallelism (rank 0's state is broadcast, followers get none)."""
        by_name = state.get("optimizer_format") == "by_name"
        if self.dp is None and not by_name:  # one process, its own format
            optimizer.load_state_dict(state["optimizer"])
            return
        opt = state.get("optimizer", {}) if self.dp is not None else state["optimizer"]
        if self.dp is not None and self.dp.leader and not by_name:  # one process wrote it: keyed by position
            opt = dp_lib.optimizer_state_by_name(opt, [n for n, p in model.named_parameters() if p.requires_grad])
        dp_lib.load_full_optimizer_state(model, optimizer, opt)

    @dp_lib.collective(light=lambda a, k: ((_light_state(a[0]),), k))
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output. With data parallelism torch's distributed
        state-dict loaders turn ``state``'s tensors into shards in place: pass a copy where the
        dict is used again.

        Raises:
            ValueError: a LoRA checkpoint into a fully fine-tuned policy or the reverse, or an
                adapter of another shape; a checkpoint without the critic(s) this run has. A
                checkpoint of any ``trainer.world_size`` loads into any other.
        """
        if (self.lora is not None) != ("lora" in state):
            raise ValueError("the checkpoint holds " + ("a LoRA adapter (lora.enabled=true)" if "lora" in state else
                                                        "a fully fine-tuned policy (lora.enabled=false)")
                             + "; resume it with the same lora.enabled")
        if self.lora is not None and self.dp is not None:  # collective: rank 0 checks, then sends its shards
            refused = None
            if self.dp.leader:
                try:
                    self.lora.check_adapter_state(state["model"])
                except Exception as e:  # noqa: BLE001 - any failure must reach the followers too
                    refused = e if isinstance(e, ValueError) else ValueError(
                        f"the checkpoint's LoRA adapter cannot be read ({type(e).__name__}: {e})")
            if not dp_lib.all_true(refused is None):  # every process refuses together
                raise refused or ValueError("the checkpoint's LoRA adapter does not fit this policy (rank 0's "
                                            "error says why)")
            dp_lib.scatter_params(self.model, self.lora.adapter_keys, state.get("model", {}))
        elif self.lora is not None:
            self.lora.load_adapter_state(state["model"])
        elif self.dp is not None:  # collective; rank 0's state is broadcast (followers get none)
            dp_lib.load_full_model_state(self.model, state.get("model", {}))
        else:
            self.model.load_state_dict(state["model"])
        self._load_optimizer(self.model, self.optimizer, state)
        self.scheduler.load_state_dict(state["scheduler"])
        # a resume with another trainer.lr / betas / weight_decay takes them (the optimizer's
        # loaded state holds the checkpoint's); the critics' likewise in _load_updater
        self.settings_taken = [f"policy {c}" for c in self.policy.apply_settings(state.get("optimizer_settings"))]
        self.version = int(state["version"])
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        self.proximal.load_state_dict(state.get("proximal", {}))
        self.proximal.on_load(self.model, self.version)
        if self.critic_updater is not None:
            if "critic" not in state:
                raise ValueError("the checkpoint has no critic (it was written with loss.advantage != gae); "
                                 "resume it with its own loss.advantage")
            more = state.get("critics_more", [])
            if len(more) != len(self.critic_updaters) - 1:
                raise ValueError(f"the checkpoint holds {len(more) + 1} critic(s), this run {len(self.critic_updaters)} "
                                 "(critic.num_critics cannot change on resume)")
            saved_rank = int(state.get("critic_lora_rank", 0))  # (checkpoints before the option: 0)
            if saved_rank != self.critic_cfg.lora_rank:
                raise ValueError(f"the checkpoint's critic has LoRA rank {saved_rank}, this run "
                                 f"critic.lora_rank={self.critic_cfg.lora_rank} (it cannot change on resume)")
            for u, st in zip(self.critic_updaters, [state["critic"], *more], strict=True):
                self._load_updater(u, st)
            self.critic_warmup_done = int(state.get("critic_warmup_done", 0))
        if self.baseline is not None and "baseline" in state:
            self.baseline.load_state_dict(state["baseline"])


def _full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """A sharded model's full weights and its optimizer state keyed by parameter name, at rank 0
    (collective; loadable by any number of processes)."""
    return {"model": dp_lib.full_model_state(model), "optimizer": dp_lib.full_optimizer_state(model, optimizer),
            "optimizer_format": "by_name"}


def _light_state(state: dict) -> dict:
    """A checkpoint's state as rank 0 announces it to data-parallel followers: without the full
    tensors (policy and critic models and optimizer states), which rank 0 broadcasts itself."""
    heavy = ("model", "optimizer")
    out = {k: v for k, v in state.items() if k not in heavy}
    if isinstance(out.get("critic"), dict):
        out["critic"] = {k: v for k, v in out["critic"].items() if k not in heavy}
    if isinstance(out.get("critics_more"), list):
        out["critics_more"] = [{k: v for k, v in st.items() if k not in heavy} for st in out["critics_more"]]
    return out
