"""The critic's model-side building blocks: a value model, frozen attention, the value loss.

SAO (MISSION.md section 3; Single-rollout Asynchronous Optimization, arXiv 2607.07508) replaces
the group baseline with a token-level value model trained K = 2 times per policy update, whose
attention layers stay frozen: only the MLP / MoE blocks, the norms, the embeddings and the value
head train (without it the critic's gradient norms are much larger and training is unstable).
This module holds what the trainer needs for that, as model-level functions:

* :class:`ValueModel` -- a transformer backbone (a causal LM without its LM head) plus
  ``value_head = Linear(hidden_size, 1)``; :func:`token_values` runs it over a packed micro-batch
  with the conventions of :func:`conveyor.trainer.logprobs.token_logprobs`.
* :func:`build_value_model` -- a critic from the policy (a deep copy, or its first L decoder
  layers) or from any model reference :func:`conveyor.models.load_model` accepts.
* :func:`attention_modules` / :func:`mlp_modules` / :func:`freeze_attention` -- attention and
  MLP / MoE blocks found by module TYPE through :data:`FAMILIES` (never by parameter names).
* :func:`grad_norm_by_kind` / :func:`param_count_by_kind` -- the frozen / unfrozen ablation,
  visible in the logs.
* :func:`value_loss` / :func:`value_metrics` -- ``0.5 (V - R)^2`` token sums with optional
  PPO-style value clipping (verl's ``compute_value_loss``), clip fraction, explained variance.

**Value alignment.** ``values[r, j]`` is the value of the state ``input_ids[r, :j + 1]`` (the
sequence read up to and including position ``j``), computed from the same last hidden state the
policy uses to predict the next token ``input_ids[r, j + 1] = targets[r, j]``. It is therefore the
value of the state in which the token ``targets[r, j]`` is chosen, aligned with the targets like
every per-token tensor of :class:`conveyor.trainer.batch.PackedBatch` (and like the log-prob of
``targets[r, j]``, which comes from the logits at position ``j``): ``mask[r, j] = 1`` selects
exactly the states in which a response token was sampled. In unpacked ``[prompt | response]``
terms, the value of the state before response token ``k`` sits at position ``P - 1 + k``, which
is verl's ``values[:, -response_length - 1:-1]`` (``verl/workers/critic/dp_critic.py``) and
OpenRLHF's ``values[:, :-1]`` then ``[-num_actions:]`` (``openrlhf/models/model.py``,
``_get_critic_model``). The state after the last response token is terminal (value 0); GAE does
not need a value for it.

**Value-head init.** ``weight ~ N(0, (1 / (hidden_size + 1))^2)``, ``bias = 0``: OpenRLHF's
value-head init (``init_value_head``: ``normal_(mean=0.0, std=1 / (config.hidden_size + 1))``).
The final hidden state is RMS-normalised (per-coordinate RMS ~1), so initial values have a
standard deviation of about ``1 / sqrt(hidden_size)`` (0.04 for SmolLM2-135M's 576): the critic
starts at a near-zero, width-independent prediction instead of spending its cold-start updates
undoing random offsets. The alternatives: verl's ``AutoModelForTokenClassification(num_labels=1)``
gets transformers' ``_init_weights`` (``std = initializer_range`` = 0.02, bias 0: value std
~0.02 sqrt(d), 0.5 at d = 576, 1.3 at d = 4096); TRL's ``ValueHead`` keeps PyTorch's default
``Linear`` init (uniform +-1/sqrt(d): value std ~0.58 at any width). Zero init is not used: it
would give the backbone no gradient on the first update. A bias is kept (verl and TRL have one;
OpenRLHF does not) so the mean return is learnt by one scalar.

**How the backbone is found.** ``policy.get_base_model()`` first unwraps a PEFT wrapper; then the
body is ``getattr(policy, policy.base_model_prefix)`` (transformers' ``PreTrainedModel.base_model``:
``model`` for Llama / Qwen / Gemma ..., ``transformer`` for GPT-2-style models), the same module
:func:`conveyor.trainer.logprobs.token_logprobs` runs; a model that is already a base model (no
output embeddings) is its own body. The decoder-layer list that ``"policy:L"`` truncates is the
``ModuleList`` of the body with ``num_hidden_layers`` entries that holds the family's attention
modules.
"""

from __future__ import annotations

import copy
import importlib
import math
from collections.abc import Sequence
from functools import cache

import torch
from torch import Tensor, nn

from conveyor.trainer.losses import LossOutput, aggregate

__all__ = [
    "FAMILIES",
    "ValueModel",
    "HeadCritic",
    "token_values",
    "build_value_model",
    "attention_modules",
    "mlp_modules",
    "freeze_attention",
    "grad_norm_by_kind",
    "param_count_by_kind",
    "value_loss",
    "value_metrics",
]

FAMILIES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    # model_type: (transformers.models.<module>.modeling_<module>, attention classes, MLP / MoE classes)
    "llama": ("llama", ("LlamaAttention",), ("LlamaMLP",)),
    "mistral": ("mistral", ("MistralAttention",), ("MistralMLP",)),
    "ministral": ("ministral", ("MinistralAttention",), ("MinistralMLP",)),
    "mixtral": ("mixtral", ("MixtralAttention",), ("MixtralSparseMoeBlock",)),
    "qwen2": ("qwen2", ("Qwen2Attention",), ("Qwen2MLP",)),
    "qwen2_moe": ("qwen2_moe", ("Qwen2MoeAttention",), ("Qwen2MoeSparseMoeBlock", "Qwen2MoeMLP")),
    "qwen3": ("qwen3", ("Qwen3Attention",), ("Qwen3MLP",)),
    "qwen3_moe": ("qwen3_moe", ("Qwen3MoeAttention",), ("Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP")),
    "gemma": ("gemma", ("GemmaAttention",), ("GemmaMLP",)),
    "gemma2": ("gemma2", ("Gemma2Attention",), ("Gemma2MLP",)),
    "gemma3_text": ("gemma3", ("Gemma3Attention",), ("Gemma3MLP",)),
    "gemma3": ("gemma3", ("Gemma3Attention",), ("Gemma3MLP",)),
    "phi3": ("phi3", ("Phi3Attention",), ("Phi3MLP",)),
    "olmo": ("olmo", ("OlmoAttention",), ("OlmoMLP",)),
    "olmo2": ("olmo2", ("Olmo2Attention",), ("Olmo2MLP",)),
    "olmoe": ("olmoe", ("OlmoeAttention",), ("OlmoeSparseMoeBlock",)),
    "granite": ("granite", ("GraniteAttention",), ("GraniteMLP",)),
    "smollm3": ("smollm3", ("SmolLM3Attention",), ("SmolLM3MLP",)),
}
"""Supported model families: ``config.model_type -> (module, attention classes, MLP / MoE classes)``.

The classes are resolved lazily in ``transformers.models.<module>.modeling_<module>``. A decoder
layer holds one attention module and one MLP or MoE block; only the outermost match is returned
(Qwen2-MoE's shared expert, a ``Qwen2MoeMLP`` inside ``Qwen2MoeSparseMoeBlock``, belongs to its
block; Qwen-MoE layers listed in ``mlp_only_layers`` hold a dense ``...MLP`` instead of the sparse
block, hence both names). A MoE block's router and experts are part of the block. ``gemma3`` is the
multimodal model: only its language model's attention (``Gemma3Attention``) is found, the vision
tower's ``SiglipAttention`` counts as "other". Add a family by adding a row here and one config to
``tests/test_critic_model.py::FAMILY_CONFIGS``."""

_PER_LAYER_CONFIG_LISTS = ("layer_types", "no_rope_layers")
"""Config lists with one entry per decoder layer, sliced with the layers by ``"policy:L"``."""


# --------------------------------------------------------------------------------------------
# Module types
# --------------------------------------------------------------------------------------------


@cache
def _family_classes(model_type: str) -> tuple[tuple[type, ...], tuple[type, ...]]:
    """The attention and MLP / MoE classes of a family (see :data:`FAMILIES`)."""
    if model_type not in FAMILIES:
        raise ValueError(
            f"model_type {model_type!r} is not a supported family for frozen attention; supported: "
            f"{sorted(FAMILIES)} (add a row to conveyor.trainer.critic.FAMILIES)"
        )
    module_name, attn_names, mlp_names = FAMILIES[model_type]
    import transformers

    try:
        mod = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    except ImportError as e:
        raise ValueError(
            f"model_type {model_type!r}: transformers {transformers.__version__} has no module "
            f"transformers.models.{module_name}.modeling_{module_name} ({e})"
        ) from e

    def resolve(names: tuple[str, ...]) -> tuple[type, ...]:
        missing = [n for n in names if not isinstance(getattr(mod, n, None), type)]
        if missing:
            raise ValueError(
                f"model_type {model_type!r}: transformers {transformers.__version__} has no class "
                f"{missing} in {mod.__name__} (update conveyor.trainer.critic.FAMILIES)"
            )
        return tuple(getattr(mod, n) for n in names)

    return resolve(attn_names), resolve(mlp_names)


def _model_type(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not model_type:
        raise ValueError(
            f"model ({type(model).__name__}) has no config.model_type: expected a transformers "
            "model or a ValueModel"
        )
    return str(model_type)


def _outermost(model: nn.Module, classes: tuple[type, ...]) -> list[nn.Module]:
    """Modules of ``classes`` in registration order, not descending into a match."""
    found: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, classes):
                found.append(child)
            else:
                walk(child)

    walk(model)
    return found


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of ``model``, found by class (MISSION.md section 3: frozen attention).

    The classes come from :data:`FAMILIES` for ``model.config.model_type``; one module per decoder
    layer (``num_hidden_layers`` of them for a transformers causal LM, its base model or a
    :class:`ValueModel`), in layer order. Parameter names (``self_attn``) are never matched.

    Args:
        model: A ``torch.nn.Module`` with a ``config.model_type`` (a transformers model, its base
            model, or a :class:`ValueModel`).

    Returns:
        A list of ``nn.Module`` (e.g. ``LlamaAttention``), outermost matches only.

    Raises:
        ValueError: ``model`` has no ``config.model_type``; the family is not in
            :data:`FAMILIES` (the message names the model_type and the supported list); the
            installed transformers lacks a class of the table; or no module of the family's
            attention classes is found in ``model``.
    """
    return _modules_of_kind(model, 0, "attention")


def mlp_modules(model: nn.Module) -> list[nn.Module]:
    """The MLP or MoE blocks of ``model``, found by class (one per decoder layer, in layer order).

    A MoE block (router + experts + shared expert) is returned whole; a dense MLP nested in a
    block is not returned separately. See :func:`attention_modules` for the lookup.

    Args:
        model: A ``torch.nn.Module`` with a ``config.model_type``.

    Returns:
        A list of ``nn.Module`` (e.g. ``LlamaMLP``, ``Qwen3MoeSparseMoeBlock``).

    Raises:
        ValueError: as :func:`attention_modules` (unknown family, missing class, none found).
    """
    return _modules_of_kind(model, 1, "MLP / MoE")


def _modules_of_kind(model: nn.Module, kind: int, label: str) -> list[nn.Module]:
    """The outermost modules of the family's attention (``kind`` 0) or MLP / MoE (1) classes
    (none in a :class:`HeadCritic`: its parameters are the head's, "other")."""
    if isinstance(model, HeadCritic):
        return []
    model_type = _model_type(model)
    classes = _family_classes(model_type)[kind]
    found = _outermost(model, classes)
    if not found:
        raise ValueError(
            f"model ({type(model).__name__}, model_type {model_type!r}) holds no module of the "
            f"{label} classes {[c.__name__ for c in classes]}"
        )
    return found


def _unique_params(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def freeze_attention(model: nn.Module) -> int:
    """Freeze every attention module of ``model`` (SAO frozen attention, MISSION.md section 3).

    Sets ``requires_grad = False`` and drops any existing ``.grad`` on every parameter of the
    modules :func:`attention_modules` finds (q/k/v/o projections, their biases, q/k norms that
    live inside the attention module). Everything else -- MLP / MoE blocks (router included),
    norms, embeddings, the value head -- is left as it is (trainable). Torch optimisers skip a
    parameter whose ``.grad`` is None, so a frozen parameter stays bit-identical even when it is
    in the optimiser's parameter list (no weight decay, no stale momentum step).

    Args:
        model: A ``torch.nn.Module`` with a ``config.model_type`` (usually a :class:`ValueModel`).

    Returns:
        The number of scalar parameters frozen (int, elements; equals
        ``param_count_by_kind(model)["attention"]``).

    Raises:
        ValueError: as :func:`attention_modules`.
    """
    n = 0
    for p in _unique_params(attention_modules(model)):
        p.requires_grad_(False)
        p.grad = None
        n += p.numel()
    return n


def apply_lora(critic: ValueModel, rank: int, alpha: float, *, freeze_attention: bool = True,
               targets: list[str] | None = None, seed: int = 0) -> int:
    """LoRA adapters on a critic's backbone (Hu et al. 2021, arXiv 2106.09685; peft's
    ``inject_adapter_in_model``, in place): ``W = W0 + (alpha / rank) B A`` on every linear module
    of the backbone whose last name is in ``targets`` (default the attention and MLP projections
    of :data:`conveyor.config.LORA_DEFAULT_TARGETS`), leaving out those inside an attention module
    when ``freeze_attention`` (SAO's frozen attention, MISSION.md section 3). Every backbone
    weight is then frozen: only the adapters and the value head train. ``B`` starts at 0, so the
    values are unchanged; ``A`` is drawn from a forked RNG seeded with ``seed`` (the caller's RNG
    stream untouched).

    Returns:
        The number of trainable scalar parameters (adapters + value head).

    Raises:
        ConfigError: peft is not installed.
        ValueError: ``critic`` is not a :class:`ValueModel`; rank < 1; no linear module to adapt.
    """
    from conveyor.config import LORA_DEFAULT_TARGETS, ConfigError

    if not isinstance(critic, ValueModel):
        raise ValueError(f"LoRA adapts a critic's own backbone; {type(critic).__name__} has none")
    if rank < 1:
        raise ValueError(f"critic LoRA rank must be >= 1, got {rank}")
    try:
        import peft
    except ImportError as e:
        raise ConfigError("critic.lora_rank > 0 needs the peft library: pip install 'conveyor[lora]'") from e
    wanted = set(targets or LORA_DEFAULT_TARGETS)
    in_attention = {id(m) for a in attention_modules(critic) for m in a.modules()} if freeze_attention else set()
    names = [name for name, m in critic.backbone.named_modules()
             if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in wanted and id(m) not in in_attention]
    if not names:
        raise ValueError(f"no linear module of the critic's backbone to adapt among {sorted(wanted)}"
                         + (" outside its attention (critic.freeze_attention)" if freeze_attention else ""))
    pcfg = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=names, bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft.inject_adapter_in_model(pcfg, critic.backbone)
    n = 0
    for name, p in critic.named_parameters():
        train = "lora_" in name or name.startswith("value_head.")
        p.requires_grad_(train)
        if not train:
            p.grad = None
        n += p.numel() if train else 0
    return n


def _params_by_kind(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    attn = {id(p) for p in _unique_params(attention_modules(model))}
    mlp = {id(p) for p in _unique_params(mlp_modules(model))}
    groups: dict[str, list[nn.Parameter]] = {"attention": [], "mlp": [], "other": []}
    for p in model.parameters():  # unique parameters
        kind = "attention" if id(p) in attn else "mlp" if id(p) in mlp else "other"
        groups[kind].append(p)
    return groups


def grad_norm_by_kind(model: nn.Module) -> dict[str, float]:
    """L2 norms of the gradients of the attention, MLP / MoE and other parameters.

    ``sqrt(sum_p ||p.grad||^2)`` per group, in float32, over the parameters that have a
    ``.grad``; a group without any gradient (frozen attention) reports ``0.0``. Call it after
    ``backward`` and before clipping to see the frozen / unfrozen ablation of MISSION.md
    section 3 in the logs (SAO: without frozen attention the critic's gradient norms are much
    larger).

    Args:
        model: A ``torch.nn.Module`` with a ``config.model_type`` (usually a :class:`ValueModel`).

    Returns:
        ``{"attention": float, "mlp": float, "other": float}`` (L2 norms, >= 0).

    Sharded parameters (FSDP2 ``DTensor`` gradients): the norms over every process's shards,
    a collective every process must call.

    Raises:
        ValueError: as :func:`attention_modules`.
    """
    sums, sharded = {}, False
    for kind, params in _params_by_kind(model).items():
        sq = []
        for p in params:
            if p.grad is None:
                continue
            g = p.grad.detach()
            if hasattr(g, "to_local"):  # an FSDP2 shard (DTensor): this process's part
                g, sharded = g.to_local(), True
            sq.append(g.float().pow(2).sum())
        sums[kind] = torch.stack(sq).sum() if sq else torch.zeros(())
    if sharded:  # data parallelism: every process's shards (collective)
        import torch.distributed as dist

        t = torch.stack([sums[k] for k in sums])
        dist.all_reduce(t)
        sums = dict(zip(sums, t, strict=True))
    return {kind: math.sqrt(float(v)) for kind, v in sums.items()}


def param_count_by_kind(model: nn.Module, *, trainable_only: bool = False) -> dict[str, int]:
    """Number of scalar parameters per group (attention, MLP / MoE, other).

    Args:
        model: A ``torch.nn.Module`` with a ``config.model_type``.
        trainable_only: Count only parameters with ``requires_grad`` (after
            :func:`freeze_attention`, ``"attention"`` is then 0).

    Returns:
        ``{"attention": int, "mlp": int, "other": int}`` (elements; shared parameters counted once).

    Raises:
        ValueError: as :func:`attention_modules`.
    """
    return {
        kind: sum(p.numel() for p in params if p.requires_grad or not trainable_only)
        for kind, params in _params_by_kind(model).items()
    }


# --------------------------------------------------------------------------------------------
# Value model
# --------------------------------------------------------------------------------------------


def _hidden_size(config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    if not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"backbone config ({type(config).__name__}) has no positive int hidden_size")
    return hidden


class ValueModel(nn.Module):
    """Token-level critic: a transformer backbone and a linear value head (MISSION.md section 3).

    Attributes:
        backbone: The base model (a causal LM without its LM head, e.g. ``LlamaModel``), called
            with ``input_ids``, ``position_ids``, ``attention_mask`` and ``use_cache=False``; its
            ``last_hidden_state`` feeds the head.
        value_head: ``nn.Linear(hidden_size, 1)`` with a bias, run in float32 (autocast off).
            Init ``weight ~ N(0, (1 / (hidden_size + 1))^2)``, ``bias = 0`` (OpenRLHF's
            value-head init; module docstring, "Value-head init").
        config: The backbone's config (``model_type`` selects the :data:`FAMILIES` row).

    Args:
        backbone: The base model (see above); it must have a ``config`` with ``hidden_size``
            (or a text config with one).
        seed: Seed of the value-head init (same seed, same head; the global RNG is not touched).

    Raises:
        ValueError: ``backbone`` has no ``config`` or no positive ``hidden_size``.
    """

    def __init__(self, backbone: nn.Module, *, seed: int = 0):
        super().__init__()
        config = getattr(backbone, "config", None)
        if config is None:
            raise ValueError(f"backbone ({type(backbone).__name__}) has no config: expected a transformers base model")
        hidden = _hidden_size(config)
        self.backbone = backbone
        self.config = config
        weight = next(backbone.parameters(), None)
        self.value_head = nn.Linear(hidden, 1, bias=True, dtype=torch.float32,
                                    device=weight.device if weight is not None else None)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            w = torch.randn(1, hidden, generator=g, dtype=torch.float32) / (hidden + 1)
            self.value_head.weight.copy_(w)
            self.value_head.bias.zero_()

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None,
                attention_mask: Tensor | None = None) -> Tensor:
        """Values of every state of the rows.

        ``values[b, t]`` is the value of the state ``input_ids[b, :t + 1]``, from the hidden state
        that predicts the next token ``input_ids[b, t + 1]`` (module docstring, "Value
        alignment").

        Args:
            input_ids: ``[B, T]`` int64 token ids.
            position_ids: Optional ``[B, T]`` int64, restarting at 0 for every sequence of a
                packed row (block-diagonal attention); None = ``0 .. T-1`` (one sequence a row).
            attention_mask: Optional ``[B, 1, T, T]`` bool, True where a position may attend
                (packed rows with shared prompts, :mod:`conveyor.trainer.batch`), or a ``[B, T]``
                padding mask; None = causal attention told apart by ``position_ids``.

        Returns:
            ``values [B, T]`` float32 (also under bf16 autocast); gradients flow into the head
            and the trainable backbone parameters when grad is enabled.

        Raises:
            ValueError: ``input_ids`` not 2-D, or ``position_ids`` / ``attention_mask`` of
                another shape.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got {list(input_ids.shape)}")
        B, T = input_ids.shape
        if position_ids is not None and position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids must be [B, T] = {[B, T]}, got {list(position_ids.shape)}")
        if attention_mask is not None and tuple(attention_mask.shape) not in ((B, 1, T, T), (B, T)):
            raise ValueError(
                f"attention_mask must be [B, 1, T, T] = {[B, 1, T, T]} or [B, T] = {[B, T]}, "
                f"got {list(attention_mask.shape)}"
            )
        hidden = self.backbone(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                               use_cache=False).last_hidden_state
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)
        return values.float()


class HeadCritic(nn.Module):
    """A lightweight critic (AsyPPO, arXiv 2510.01656; MISSION.md section 4): a two-layer value
    head on the POLICY's last hidden states, detached (no second backbone).

    ``V = fc2(gelu(fc1(h)))`` with ``h`` the policy body's last hidden state, computed without
    gradient: only the head trains, and its cost is one forward pass of the policy's body (no
    backward) plus two small matrix products, against a full critic's forward and backward
    through a copy of the whole model. The policy body is referenced, not owned: it is not a
    submodule (not in :meth:`parameters`, the critic's optimizer or its ``state_dict``), and it is
    the policy's CURRENT parameters that are read (so the values follow the policy as it trains).

    Init (seeded, the global RNG untouched): ``fc1.weight ~ N(0, 1 / d)`` (unit-variance
    activations for an RMS-normalised ``h``), ``fc2.weight ~ N(0, (1 / (H + 1))^2)`` as the full
    critic's head (OpenRLHF's value-head init), biases 0.

    Args:
        body: The policy's transformer body (the base model without the LM head).
        hidden: ``H``, the head's width (default: the policy's ``hidden_size`` ``d``).
        seed: Seed of the init.

    Raises:
        ValueError: ``body`` has no config with a positive ``hidden_size``; ``hidden`` < 1.
    """

    def __init__(self, body: nn.Module, hidden: int | None = None, *, seed: int = 0):
        super().__init__()
        config = getattr(body, "config", None)
        if config is None:
            raise ValueError(f"body ({type(body).__name__}) has no config: expected a transformers base model")
        d = _hidden_size(config)
        h = d if hidden is None else int(hidden)
        if h < 1:
            raise ValueError(f"head width must be >= 1, got {hidden}")
        self._body = (body,)  # a reference, not a submodule (module docstring)
        self.config = config
        self.fc1 = nn.Linear(d, h, dtype=torch.float32)
        self.fc2 = nn.Linear(h, 1, dtype=torch.float32)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.fc1.weight.copy_(torch.randn(h, d, generator=g) / math.sqrt(d))
            self.fc2.weight.copy_(torch.randn(1, h, generator=g) / (h + 1))
            self.fc1.bias.zero_()
            self.fc2.bias.zero_()

    @property
    def body(self) -> nn.Module:
        """The policy body the head reads (not owned)."""
        return self._body[0]

    def body_states(self, input_ids: Tensor, position_ids: Tensor | None = None,
                    attention_mask: Tensor | None = None) -> Tensor:
        """The policy body's last hidden states ``[B, T, d]``, without gradient: what the head
        reads. Every head critic of one policy reads the same states, so a caller may compute
        them once per batch and policy version and pass them to :meth:`forward` (``hidden``);
        the trainer does (``Trainer._values``).

        Raises:
            ValueError: ``input_ids`` not 2-D.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got {list(input_ids.shape)}")
        with torch.no_grad():
            return self.body(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                             use_cache=False).last_hidden_state

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None,
                attention_mask: Tensor | None = None, *, hidden: Tensor | None = None) -> Tensor:
        """Values of every state of the rows, aligned as :meth:`ValueModel.forward`.

        Args:
            hidden: Optional ``[B, T, d]``: :meth:`body_states` of these rows, computed before
                with the policy's current parameters (the body's forward is then skipped; the
                caller vouches that the parameters have not changed since).

        Returns:
            ``values [B, T]`` float32; gradients flow into the head only.

        Raises:
            ValueError: ``input_ids`` not 2-D; ``hidden`` not ``[B, T, d]``.
        """
        if hidden is None:
            hidden = self.body_states(input_ids, position_ids, attention_mask)
        elif input_ids.dim() != 2 or tuple(hidden.shape) != (*input_ids.shape, self.fc1.in_features):
            raise ValueError(f"hidden must be [B, T, d] = {[*input_ids.shape, self.fc1.in_features]} for input_ids "
                             f"{list(input_ids.shape)}, got {list(hidden.shape)}")
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            x = hidden.detach().float()
            values = self.fc2(nn.functional.gelu(self.fc1(x))).squeeze(-1)
        return values


def token_values(
    model: ValueModel,
    input_ids: Tensor,
    position_ids: Tensor,
    *,
    mask: Tensor | None = None,
    attention_mask: Tensor | None = None,
    hidden: Tensor | None = None,
) -> Tensor:
    """``V(input_ids[:j+1])`` for every position of a packed row, aligned with the targets.

    The critic's counterpart of :func:`conveyor.trainer.logprobs.token_logprobs`, called on the
    same :class:`conveyor.trainer.batch.PackedBatch`: ``token_values(critic, mb.input_ids,
    mb.position_ids, mask=mb.mask, attention_mask=mb.attention_mask)``. Position ``j`` holds the
    value of the state in which ``targets[j]`` is chosen (the log-prob of ``targets[j]`` sits at
    the same position), so ``values[mask > 0]`` are the values of the response tokens' states,
    in the order of the log-probs (verl's ``values[:, -response_length - 1:-1]``).

    Args:
        model: A :class:`ValueModel`.
        input_ids: ``[R, L]`` int64 packed token ids.
        position_ids: ``[R, L]`` int64, restarting at 0 per sequence.
        mask: Optional ``[R, L]`` (bool or numeric); positions with mask == 0 get 0.0 (and no
            gradient), as in ``token_logprobs``. None = every position.
        attention_mask: Optional ``[R, 1, L, L]`` bool, True where a position may attend
            (``PackedBatch.attention_mask``); None = block-diagonal causal attention from
            ``position_ids``.
        hidden: Optional ``[R, L, d]``, a :class:`HeadCritic` only: the policy body's states of
            these rows (:meth:`HeadCritic.body_states`), so that the body's forward is skipped.

    Returns:
        ``values [R, L]`` float32.

    Raises:
        ValueError: ``input_ids``, ``position_ids`` (and ``mask``) not all ``[R, L]``, an
            ``attention_mask`` that is not ``[R, 1, L, L]``, or ``hidden`` for a model that is not
            a :class:`HeadCritic`.
    """
    if input_ids.dim() != 2 or position_ids.shape != input_ids.shape or (
            mask is not None and mask.shape != input_ids.shape):
        raise ValueError(
            f"input_ids {list(input_ids.shape)}, position_ids {list(position_ids.shape)} and mask "
            f"{None if mask is None else list(mask.shape)} must all be [R, L]"
        )
    R, L = input_ids.shape
    if attention_mask is not None and tuple(attention_mask.shape) != (R, 1, L, L):
        raise ValueError(f"attention_mask must be [R, 1, L, L] = {[R, 1, L, L]}, got {list(attention_mask.shape)}")
    if hidden is not None:
        if not isinstance(model, HeadCritic):
            raise ValueError(f"hidden states are read by a HeadCritic only, not by {type(model).__name__}")
        values = model(input_ids, position_ids=position_ids, attention_mask=attention_mask, hidden=hidden)
    else:
        values = model(input_ids, position_ids=position_ids, attention_mask=attention_mask)
    if mask is not None:
        values = torch.where(mask != 0, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return values


def _policy_body(policy: nn.Module) -> nn.Module:
    """The transformer body of a causal LM (module docstring, "How the backbone is found")."""
    get_base = getattr(policy, "get_base_model", None)
    if callable(get_base):  # PEFT wrapper
        policy = get_base()
    prefix = getattr(policy, "base_model_prefix", None)
    body = getattr(policy, prefix, None) if prefix else None
    if isinstance(body, nn.Module) and body is not policy:
        return body
    get_out = getattr(policy, "get_output_embeddings", None)
    if getattr(policy, "config", None) is not None and callable(get_out) and get_out() is None:
        return policy  # already a base model
    raise ValueError(
        f"policy ({type(policy).__name__}) has no transformer body: expected a transformers causal LM "
        f"whose base_model_prefix ({prefix!r}) names its base model"
    )


def _decoder_layers(body: nn.Module) -> tuple[str, nn.ModuleList]:
    """(qualified name, ModuleList) of the decoder layers: the ModuleList of ``num_hidden_layers``
    entries that holds the family's attention modules."""
    n = getattr(body.config.get_text_config(), "num_hidden_layers", None)
    attn, _ = _family_classes(_model_type(body))
    cands = [(name, m) for name, m in body.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) == n and _outermost(m, attn)]
    if len(cands) != 1:
        raise ValueError(
            f"{type(body).__name__}: expected one ModuleList of num_hidden_layers = {n} decoder layers "
            f"holding {[c.__name__ for c in attn]}, found {[name for name, _ in cands]}"
        )
    return cands[0]


def _copy_first_layers(body: nn.Module, n_layers_spec: str) -> nn.Module:
    """A deep copy of ``body`` with only its first L decoder layers (``n_layers_spec`` = ``"L"``)."""
    name, layers = _decoder_layers(body)
    n = len(layers)
    try:
        keep = int(n_layers_spec)
    except ValueError:
        raise ValueError(f"backbone 'policy:L' needs an integer L, got {n_layers_spec!r}") from None
    if not 1 <= keep <= n:
        raise ValueError(f"backbone 'policy:{keep}': L must be in [1, {n}] (the policy's decoder layers)")
    memo: dict = {id(layer): None for layer in list(layers)[keep:]}  # never copy the dropped layers
    out = copy.deepcopy(body, memo)
    parent_name, _, attr = name.rpartition(".")
    parent = out.get_submodule(parent_name)
    setattr(parent, attr, nn.ModuleList(list(getattr(parent, attr))[:keep]))
    cfg = getattr(parent, "config", None)
    if cfg is None:
        cfg = out.config.get_text_config()
    cfg.num_hidden_layers = keep
    for key in _PER_LAYER_CONFIG_LISTS:
        value = getattr(cfg, key, None)
        if isinstance(value, list) and len(value) == n:
            setattr(cfg, key, value[:keep])
    return out


def _embedding_rows(body: nn.Module) -> int:
    return int(body.get_input_embeddings().weight.shape[0])


def build_value_model(policy: nn.Module, backbone: str = "policy", *, seed: int = 0,
                      tokenizer=None) -> ValueModel | HeadCritic:
    """Build the critic (MISSION.md section 3; SAO arXiv 2607.07508) for ``policy``.

    Args:
        policy: The policy, a transformers causal LM (e.g. ``load_model("tiny").model``); it is
            never modified, and the critic shares no parameter or buffer storage with it.
        backbone: Where the critic's backbone comes from:

            * ``"policy"`` (default): a deep copy of the policy's body (the base model without
              the LM head).
            * ``"policy:L"``: a copy of the policy's embeddings, first ``L`` decoder layers and
              final norm (``config.num_hidden_layers`` and per-layer config lists such as
              ``layer_types`` are cut to ``L`` in the copy); the dropped layers are not copied.
            * ``"head"`` / ``"head:H"``: a :class:`HeadCritic` (AsyPPO's lightweight critic: a
              two-layer head of width ``H``, default the hidden size, on the policy's own
              detached hidden states; no copy of the policy).
            * any other string: a reference :func:`conveyor.models.load_model` accepts (``"tiny"``,
              a preset, a local Hugging Face directory, a ``.gguf`` file), loaded with ``seed``;
              its body is used. It must read the policy's token ids: its input-embedding rows
              must equal the policy's, or, when ``tokenizer`` is given, its tokenizer must have
              exactly that tokenizer's vocabulary and embed every id of it.
        seed: Seed of the value-head init (and of the ``tiny`` preset's random init).
        tokenizer: Optional, the policy's tokenizer, for the vocabulary check of a loaded backbone.

    Returns:
        A :class:`HeadCritic` for ``"head[:H]"``; otherwise a :class:`ValueModel` with float32
        parameters, all trainable (apply
        :func:`freeze_attention` for SAO), gradients cleared, in the train / eval mode of the
        source body (:func:`conveyor.models.load_model` returns eval mode).

    Raises:
        ValueError: ``policy`` has no transformer body; ``"policy:L"`` with L not an integer in
            ``[1, number of decoder layers]`` (or whose family is not in :data:`FAMILIES`, needed
            to find the decoder layers); a loaded backbone whose vocabulary does not match the
            policy's.
        conveyor.models.ModelLoadError: the reference cannot be loaded.
    """
    body = _policy_body(policy)
    if backbone == "head" or backbone.startswith("head:"):
        width = backbone.removeprefix("head").removeprefix(":")
        if width and (not width.isdigit() or int(width) < 1):
            raise ValueError(f"head:H takes the head's width H, an integer >= 1; got {backbone!r}")
        return HeadCritic(body, int(width) if width else None, seed=seed)
    if backbone == "policy":
        copied = copy.deepcopy(body)
    elif backbone.startswith("policy:"):
        copied = _copy_first_layers(body, backbone.removeprefix("policy:"))
    else:
        from conveyor.models import load_model

        loaded = load_model(backbone, seed=seed)
        copied = _policy_body(loaded.model)
        rows, policy_rows = _embedding_rows(copied), _embedding_rows(body)
        if tokenizer is None:
            if rows != policy_rows:
                raise ValueError(
                    f"backbone {backbone!r} has a vocabulary of {rows} token embeddings, the policy "
                    f"{policy_rows}: the critic must read the policy's token ids (same tokenizer); pass "
                    "the policy's tokenizer= to accept a padded vocabulary of the same tokenizer"
                )
        else:
            if loaded.tokenizer.get_vocab() != tokenizer.get_vocab():
                raise ValueError(
                    f"backbone {backbone!r} has another tokenizer vocabulary than the policy "
                    f"({len(loaded.tokenizer)} vs {len(tokenizer)} tokens): the critic must read the "
                    "policy's token ids"
                )
            if rows < len(tokenizer):
                raise ValueError(
                    f"backbone {backbone!r} embeds {rows} token ids, fewer than the policy's "
                    f"tokenizer ({len(tokenizer)} tokens)"
                )
        del loaded
    copied = copied.float()
    for p in copied.parameters():
        p.requires_grad_(True)
        p.grad = None
    model = ValueModel(copied, seed=seed)
    model.train(copied.training)
    return model


# --------------------------------------------------------------------------------------------
# Value loss
# --------------------------------------------------------------------------------------------


def value_loss(values: Tensor, returns: Tensor, mask: Tensor, *, old_values: Tensor | None = None,
               clip: float | None = None) -> LossOutput:
    """Critic regression loss ``0.5 (V - R)^2``, as token SUMS over the action tokens.

    Without clipping the per-token loss is ``0.5 (V - R)^2``. With ``clip`` (PPO value clipping,
    verl's ``compute_value_loss`` in ``verl/trainer/ppo/core_algos.py``, itself from TRL's
    ``PPOTrainer``): ``V_c = old_values + clamp(V - old_values, -clip, clip)`` and the per-token
    loss is ``0.5 max((V - R)^2, (V_c - R)^2)``; a token counts as clipped when the clipped term
    is strictly the larger (verl's ``vf_clipfrac``), and its gradient is then zero when ``V`` lies
    outside ``old_values +- clip``. Like the policy losses (:mod:`conveyor.trainer.losses`) the
    result holds sums: divide ``loss_sum`` by the step's global count of action tokens for a
    token-mean (MISSION.md section 3: SAO trains the critic K = 2 times per policy update).

    Args:
        values: ``[B, T]`` float, the critic's values (carries the gradient); e.g. from
            :func:`token_values`, aligned with the targets.
        returns: ``[B, T]`` float, the regression targets (lambda-returns; detached).
        mask: ``[B, T]`` bool or numeric, non-zero on the action tokens that count; masked
            positions are ignored entirely, even NaN / inf.
        old_values: ``[B, T]`` float, the values recorded before this update (detached); only
            used with ``clip``.
        clip: Value clip range (> 0), or None for no clipping.

    Returns:
        :class:`conveyor.trainer.losses.LossOutput` ``(loss_sum, num_tokens, metrics)`` computed in
        float32 (float64 stays float64); metrics (detached sums, combined by
        :func:`value_metrics` / ``aggregate``): ``clip_count``, ``value_sum`` /
        ``value_sq_sum``, ``return_sum`` / ``return_sq_sum``, ``error_sum`` / ``error_sq_sum``
        (error = R - V).

    Raises:
        ValueError: a tensor that is not ``[B, T]`` like ``mask`` or not floating; ``clip`` not
            > 0; ``clip`` without ``old_values``.
    """
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        raise ValueError(f"mask must be a tensor of shape [B, T], got "
                         f"{list(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__}")
    named = {"values": values, "returns": returns}
    if old_values is not None:
        named["old_values"] = old_values
    for name, t in named.items():
        if not isinstance(t, Tensor) or t.shape != mask.shape or not t.is_floating_point():
            got = f"{list(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a floating tensor of the shape of mask {list(mask.shape)}, got {got}")
    if clip is not None:
        if not clip > 0:
            raise ValueError(f"clip must be > 0 or None, got {clip}")
        if old_values is None:
            raise ValueError("clip needs old_values (the values before this update)")
    m = mask != 0
    dtype = torch.promote_types(values.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    v = torch.where(m, values.to(dtype), zero)  # masked NaN / inf never reach the gradient
    r = torch.where(m, returns.detach().to(dtype), zero)
    err1 = (v - r).square()
    if clip is not None:
        old = torch.where(m, old_values.detach().to(dtype), zero)
        v_clipped = old + (v - old).clamp(-clip, clip)
        err2 = (v_clipped - r).square()
        per_token = 0.5 * torch.maximum(err1, err2)
        clipped = m & (err2 > err1)
    else:
        per_token = 0.5 * err1
        clipped = torch.zeros_like(m)
    vd, error = v.detach(), (r - v).detach()

    def s(x: Tensor) -> Tensor:
        return torch.where(m, x, zero).sum()

    metrics = {
        "clip_count": clipped.sum().to(dtype),
        "value_sum": s(vd), "value_sq_sum": s(vd.square()),
        "return_sum": s(r), "return_sq_sum": s(r.square()),
        "error_sum": s(error), "error_sq_sum": s(error.square()),
    }
    return LossOutput(loss_sum=s(per_token), num_tokens=m.sum().to(dtype), metrics=metrics)


def value_metrics(outputs: Sequence[LossOutput]) -> dict[str, float]:
    """Loggable critic metrics of one or several :func:`value_loss` outputs (micro-batches).

    ``conveyor.trainer.losses.aggregate`` (exact global token-means: ``loss``, ``num_tokens``,
    ``clip_frac``, ``value_mean`` / ``value_std``, ``return_mean`` / ``return_std``,
    ``error_mean`` / ``error_std``) plus ``explained_variance = 1 - Var(R - V) / Var(R)`` over
    all counted tokens (population variances; verl's ``critic/vf_explained_var`` up to its 1e-5
    in the denominator): 1 for a perfect critic, 0 for one that predicts the mean return, < 0
    for worse. Reported as ``0.0`` when ``Var(R) < 1e-12`` (constant returns: undefined) or no
    token counts.

    Args:
        outputs: One ``LossOutput`` of :func:`value_loss` per micro-batch.

    Returns:
        ``dict[str, float]`` as above.

    Raises:
        ValueError: ``outputs`` empty or with differing metric names (from ``aggregate``), or
            outputs that are not from :func:`value_loss` (no ``error_sq_sum`` / ``return_sq_sum``).
    """
    agg = aggregate(outputs)
    if "error_std" not in agg or "return_std" not in agg:
        raise ValueError("outputs must come from value_loss (metrics error_sum / error_sq_sum / return_sum / "
                         f"return_sq_sum), got metric names {sorted(outputs[0].metrics)}")
    var_r, var_e = agg["return_std"] ** 2, agg["error_std"] ** 2
    agg["explained_variance"] = 1.0 - var_e / var_r if var_r >= 1e-12 else 0.0
    return agg
