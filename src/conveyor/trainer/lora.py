"""LoRA training of the policy through ``peft`` (issue 15 section 2; ``lora.*`` config).

LoRA (Hu et al. 2021, arXiv 2106.09685) freezes each targeted weight ``W0`` (``[out, in]``) and
trains a low-rank update: ``h = W0 x + (alpha / r) B A x`` (eq. 3, with the ``alpha / r`` scaling
of section 4.1), ``A`` ``[r, in]`` (random init), ``B`` ``[out, r]`` (zero init, so training starts
from the base model). The adapted weight is ``W = W0 + (alpha / r) B A``.

The seam (:class:`LoraPolicy`):

- :func:`apply_lora` wraps the policy with ``peft.get_peft_model``. peft injects its LoRA layers
  into the model in place and freezes every other parameter; the trainer keeps training the same
  transformers model object (:attr:`LoraPolicy.model`, ``peft_model.get_base_model()``), so its
  log-prob code, proximal strategies and bf16 autocast run unchanged, and the optimizer holds
  only the ``A`` / ``B`` parameters.
- The KL penalty's reference policy is the base model: the same model under
  :meth:`LoraPolicy.reference` (peft's ``disable_adapter()``), no second copy.
- Weight sync (:meth:`LoraPolicy.weight_update`): the engine never holds peft modules.
  ``lora.sync=merged`` sends the adapted matrices ``W`` of the targeted weights under the base
  model's parameter names (the frozen weights never change, so they are not resent);
  ``lora.sync=adapter`` sends only ``A``, ``B`` and the scale
  (:class:`~conveyor.sync.LoraFactors`) and the engine merges them onto its own copy of ``W0``.
  Both merge with :meth:`conveyor.sync.LoraFactors.merge`, so the engine gets the same weights.
- Checkpoints hold the adapter (:meth:`LoraPolicy.adapter_state`) and the adapter-only optimizer
  state; the export holds a merged plain transformers model and the adapter in ``adapter/``
  (peft's ``save_pretrained``; :meth:`LoraPolicy.save_adapter`).

peft is imported only when LoRA is enabled (``pip install 'conveyor[lora]'``).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from torch import nn

from conveyor.config import ConfigError, LoraConfig
from conveyor.sync import LoraFactors, WeightUpdate

ADAPTER = "default"  # peft's adapter name
ADAPTER_DIR = "adapter"  # the export's sub-directory holding the peft adapter


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(module name, peft LoRA layer)`` of every LoRA layer in ``model`` (empty when peft is
    not imported: no model can hold one then)."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def _factors(layer: nn.Module, copy_: bool) -> LoraFactors:
    a = layer.lora_A[ADAPTER].weight.detach()
    b = layer.lora_B[ADAPTER].weight.detach()
    if copy_:
        a, b = a.to("cpu", copy=True).contiguous(), b.to("cpu", copy=True).contiguous()
    return LoraFactors(A=a, B=b, scale=float(layer.scaling[ADAPTER]))


def inference_copy(model: nn.Module, *, merged: bool = True) -> nn.Module:
    """A copy of ``model`` with every peft LoRA layer replaced by its base ``nn.Linear``: a plain
    transformers model (what engines, evaluations and the export hold). ``merged``: the base
    weight set to ``W0 + scale * B @ A`` (:meth:`~conveyor.sync.LoraFactors.merge`); False: ``W0``.
    A model without LoRA layers is deep-copied as it is. ``model`` is not changed."""
    layers = {name for name, _ in lora_layers(model)}
    out = copy.deepcopy(model)
    if not layers:
        return out
    with torch.no_grad():
        for name in sorted(layers, key=len, reverse=True):
            layer = out.get_submodule(name)
            base = layer.base_layer
            if merged:
                base.weight.copy_(_factors(layer, copy_=False).merge(base.weight))
            parent, _, attr = name.rpartition(".")
            setattr(out.get_submodule(parent) if parent else out, attr, base)
    return out


def _check_targets(model: nn.Module, targets: list[str]) -> None:
    """Each entry of ``lora.target_modules`` must match (peft's rule: the module's full name, or
    its name ending in ``"." + entry``) at least one module, and only ``nn.Linear`` modules whose
    weight is not tied to another parameter.

    Raises:
        ConfigError: the first entry that fails, with the model's linear module names.
    """
    modules = dict(model.named_modules())
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, nn.Linear)})
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[p.data_ptr()] = counts.get(p.data_ptr(), 0) + 1
    for key in targets:
        matched = [n for n in modules if n and (n == key or n.endswith("." + key))]
        if not matched:
            raise ConfigError(f"lora.target_modules: {key!r} matches no module of the model "
                              f"({type(model).__name__}); its linear modules are {', '.join(linear)}")
        for n in matched:
            m = modules[n]
            if not isinstance(m, nn.Linear):
                raise ConfigError(f"lora.target_modules: {key!r} matches {n!r}, a {type(m).__name__}, not a linear "
                                  f"layer; the model's linear modules are {', '.join(linear)}")
            if counts.get(m.weight.data_ptr(), 0) > 1:
                raise ConfigError(f"lora.target_modules: {key!r} matches {n!r}, whose weight is tied to another "
                                  "parameter (e.g. the output projection tied to the input embeddings); an adapter "
                                  "would untie them")


def apply_lora(model: nn.Module, cfg: LoraConfig, *, seed: int = 0) -> LoraPolicy:
    """Wrap ``model`` with ``peft.get_peft_model`` (adapters injected in place; every other
    parameter frozen). ``B`` starts at 0 (the policy starts as the base model), ``A`` with peft's
    random init (Kaiming-uniform), drawn from a forked RNG seeded with ``seed``: the same start for
    the same model and settings whatever ran before, and the caller's RNG stream is untouched.

    Args:
        model: The policy, a transformers causal LM with float32 parameters.
        cfg: ``lora.*`` (rank, alpha, dropout, target modules, sync).
        seed: Seed of ``A``'s initialisation.

    Returns:
        The :class:`LoraPolicy`; its ``model`` is ``model`` itself, now with LoRA layers.

    Raises:
        ConfigError: peft is not installed, or a target module matches nothing / a non-linear /
            a tied layer (the message names the model's linear modules).
    """
    try:
        import peft
    except ImportError as e:
        raise ConfigError("lora.enabled=true needs the peft library: pip install 'conveyor[lora]'") from e
    _check_targets(model, list(cfg.target_modules))
    pcfg = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                           target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = peft.get_peft_model(model, pcfg)
    return LoraPolicy(peft_model, cfg)


def merged_from_checkpoint(model: nn.Module, state: dict) -> nn.Module:
    """The policy of a LoRA run's checkpoint as a plain model: ``state`` is a
    ``Trainer.state_dict()`` with ``lora`` (rank, alpha, target modules) and the adapter under
    ``model``; ``model`` is the run's base model (``model.name`` / ``model.seed``; adapters are
    injected into it). Returns a new plain copy with the adapters merged.

    Raises:
        ValueError: the adapter does not fit ``model``.
    """
    spec = state["lora"]
    cfg = LoraConfig(enabled=True, rank=spec["rank"], alpha=spec["alpha"], target_modules=spec["target_modules"])
    policy = apply_lora(model, cfg)
    policy.load_adapter_state(state["model"])
    return policy.inference_model()


class LoraPolicy:
    """A policy trained through LoRA adapters (see the module docstring).

    Attributes:
        peft_model: The ``peft.PeftModel`` (adapter save, ``disable_adapter``).
        model: The transformers model with the LoRA layers in it (the trainer's policy).
        cfg: The ``lora.*`` settings.
        layers: ``(module name, LoRA layer)`` of each adapted linear module.
    """

    def __init__(self, peft_model, cfg: LoraConfig):
        self.peft_model = peft_model
        self.model = peft_model.get_base_model()
        self.cfg = cfg
        self.layers = lora_layers(self.model)
        # the adapter's parameter names (``...q_proj.lora_A.default.weight``), in module order
        self.adapter_keys = [k for k in self.model.state_dict() if ".lora_" in k]
        total = sum(p.numel() for p in self.model.parameters())
        self.trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        scale = float(self.layers[0][1].scaling[ADAPTER]) if self.layers else cfg.alpha / cfg.rank
        self.note = (f"LoRA: rank {cfg.rank}, alpha {cfg.alpha:g} (scale {scale:g}) on {len(self.layers)} linear "
                     f"modules ({', '.join(cfg.target_modules)}): {self.trainable:,} trainable parameters of "
                     f"{total:,} ({100 * self.trainable / max(1, total):.2f}%); the engine receives {cfg.sync} weights")

    def reference(self):
        """Context manager: the base model (adapters disabled, peft's ``disable_adapter()``),
        the KL penalty's reference policy."""
        return self.peft_model.disable_adapter()

    def factors(self) -> dict[str, LoraFactors]:
        """Base parameter name (``<module>.weight``) -> detached CPU copies of ``A`` ``[r, in]``,
        ``B`` ``[out, r]`` and the scale ``alpha / r``."""
        return {f"{name}.weight": _factors(layer, copy_=True) for name, layer in self.layers}

    def base_weights(self) -> dict[str, torch.Tensor]:
        """Base parameter name -> a CPU copy of its frozen ``W0`` ``[out, in]`` (what an engine
        receiving adapters keeps: its ``lora_base``)."""
        return {f"{name}.weight": layer.base_layer.weight.detach().to("cpu", copy=True) for name, layer in self.layers}

    def weight_update(self, version: int, sync: str | None = None) -> WeightUpdate:
        """The message for the engine (``sync``: default ``lora.sync``).

        - ``merged``: ``tensors`` = the adapted weights ``W0 + scale * B @ A`` (float32,
          ``[out, in]``) of the targeted modules under the base model's names
          (``model.layers.0.self_attn.q_proj.weight``); frozen weights are not resent.
        - ``adapter``: ``lora`` = :meth:`factors` only.

        Raises:
            ValueError: an unknown ``sync``.
        """
        sync = sync or self.cfg.sync
        if sync == "adapter":
            return WeightUpdate(version=version, tensors={}, lora=self.factors())
        if sync != "merged":
            raise ValueError(f"lora.sync must be merged or adapter, got {sync!r}")
        with torch.no_grad():
            tensors = {f"{name}.weight": _factors(layer, copy_=False).merge(layer.base_layer.weight.detach()).cpu()
                       for name, layer in self.layers}
        return WeightUpdate(version=version, tensors=tensors)

    def inference_model(self) -> nn.Module:
        """A plain transformers copy of the policy, adapters merged (:func:`inference_copy`)."""
        return inference_copy(self.model)

    # ---------------------------------------------------------------- checkpoint and export
    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors (``...q_proj.lora_A.default.weight`` etc.), cloned."""
        state = self.model.state_dict()
        return {k: state[k].detach().clone() for k in self.adapter_keys}

    def check_adapter_state(self, state: dict[str, torch.Tensor]) -> None:
        """Whether :meth:`adapter_state` output (of this process or gathered from several) fits
        this policy: the same names and shapes.

        Raises:
            ValueError: the names or shapes differ (another rank or target modules, or a fully
                fine-tuned checkpoint).
        """
        missing = sorted(set(self.adapter_keys) - set(state))
        unexpected = sorted(set(state) - set(self.adapter_keys))
        if missing or unexpected:
            raise ValueError(f"the checkpoint's LoRA adapter does not fit this policy's ({len(missing)} tensors "
                             f"missing, e.g. {missing[:1]}; {len(unexpected)} unexpected, e.g. {unexpected[:1]}): "
                             "lora.target_modules cannot change on resume")
        for k in self.adapter_keys:  # the global shape (a sharded parameter reports its full shape)
            want, got = tuple(self.model.get_parameter(k).shape), tuple(state[k].shape)
            if want != got:
                raise ValueError(f"the checkpoint's LoRA adapter does not fit this policy's (lora.rank cannot change "
                                 f"on resume): {k} has shape {got} in the checkpoint, {want} here")

    def load_adapter_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`adapter_state` output.

        Raises:
            ValueError: see :meth:`check_adapter_state`.
        """
        self.check_adapter_state(state)
        try:
            self.model.load_state_dict(state, strict=False)
        except RuntimeError as e:  # a shape mismatch: another rank
            raise ValueError(f"the checkpoint's LoRA adapter does not fit this policy's (lora.rank cannot change "
                             f"on resume): {e}") from e

    def save_adapter(self, directory: str | Path) -> Path:
        """The adapter as peft writes it (``adapter_config.json``, ``adapter_model.safetensors``),
        loadable with ``peft.PeftModel.from_pretrained(base_model, directory)``."""
        directory = Path(directory)
        self.peft_model.save_pretrained(str(directory))
        return directory
