"""Per-token log-probabilities without materialising full-vocabulary log-softmax copies.

The transformer body runs once over the packed micro-batch; the vocabulary projection
(``lm_head``) and the log-sum-exp run in chunks of ``chunk_tokens`` positions under activation
checkpointing, so at most one ``[chunk, V]`` logits block is alive at a time, in the forward and in
the backward pass (V = vocabulary size, 49,152 for SmolLM2: a 3.5 k-token batch would otherwise hold
~690 MB per fp32 copy).

Truncated sampling (sampling-mask replay): a position whose token was sampled from a kept set
``S`` (top-k / top-p / min-p, recorded by the engine) gets ``log pi^S(a) = z_a - logsumexp_{v in
S} z_v`` with ``z = logits / T``: the chunk's logits are gathered at the ids of ``S`` (padded with
-inf) and reduced there, so the gradient flows through exactly those logits (docs/design.md,
"Truncated sampling: which log-probs"; DeepSeek-V3.2, arXiv 2512.02556 section 3.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_t: float) -> torch.Tensor:
    logits = F.linear(hidden, weight).float() * inv_t
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _entropy(logits: torch.Tensor, lse: torch.Tensor, grad: bool) -> torch.Tensor:
    """``H = lse - sum_v p_v z_v`` with ``p = softmax(z)``: the same value as ``-(p * log p).sum()``
    without a second ``[chunk, V]`` log-softmax copy; detached unless ``grad`` (entropy bonus)."""
    if grad:
        return lse - torch.linalg.vecdot(torch.exp(logits - lse.unsqueeze(-1)), logits)
    with torch.no_grad():
        z, m = logits.detach(), lse.detach()
        return m - torch.linalg.vecdot(torch.exp(z - m.unsqueeze(-1)), z)


def _chunk_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                            inv_t: float, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and the entropy (:func:`_entropy`) from one vocabulary projection
    (``z = logits / T``)."""
    logits = F.linear(hidden, weight).float() * inv_t
    lse = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    return lp, _entropy(logits, lse, entropy_grad)


def _masked_lse(logits: torch.Tensor, lse: torch.Tensor, sup_ids: torch.Tensor,
                sup_valid: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``[c]`` normaliser per position: ``logsumexp`` over the kept ids where a set is recorded,
    the full ``lse`` where ``full`` (no set). ``sup_ids [c, K]`` int64 (padding slots hold a valid
    id, masked by ``sup_valid [c, K]``; rows without a set hold their target in a valid slot, so
    the unused branch of the ``where`` is finite and its zero gradient stays finite)."""
    kept = logits.gather(-1, sup_ids).masked_fill(~sup_valid, float("-inf"))
    return torch.where(full, lse, torch.logsumexp(kept, dim=-1))


def _chunk_logprobs_masked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           inv_t: float, sup_ids: torch.Tensor, sup_valid: torch.Tensor,
                           full: torch.Tensor) -> torch.Tensor:
    """As :func:`_chunk_logprobs`, renormalised over the kept sets (:func:`_masked_lse`)."""
    logits = F.linear(hidden, weight).float() * inv_t
    lse = _masked_lse(logits, torch.logsumexp(logits, dim=-1), sup_ids, sup_valid, full)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse


def _chunk_logprobs_entropy_masked(hidden: torch.Tensor, weight: torch.Tensor,
                                   targets: torch.Tensor, inv_t: float, sup_ids: torch.Tensor,
                                   sup_valid: torch.Tensor, full: torch.Tensor,
                                   entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`_chunk_logprobs_entropy`; the log-probs are renormalised over the kept sets, the
    entropy stays that of the full ``softmax(z)``."""
    logits = F.linear(hidden, weight).float() * inv_t
    lse_full = torch.logsumexp(logits, dim=-1)
    lse = _masked_lse(logits, lse_full, sup_ids, sup_valid, full)
    lp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    return lp, _entropy(logits, lse_full, entropy_grad)


def _chunk_support(sup_ids: torch.Tensor, starts: torch.Tensor, sizes: torch.Tensor,
                   targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded ``(ids [c, K], valid [c, K], full [c])`` of a chunk's kept sets (``K`` = largest set
    in the chunk); a position without a set gets its target in slot 0 and ``full = True``."""
    k = int(sizes.max())
    cols = torch.arange(k, device=sizes.device)
    valid = cols.unsqueeze(0) < sizes.unsqueeze(1)
    idx = (starts.unsqueeze(1) + cols.unsqueeze(0)).clamp_(max=max(sup_ids.numel() - 1, 0))
    ids = torch.where(valid, sup_ids[idx], targets.unsqueeze(1))
    full = sizes == 0
    valid[:, 0] |= full
    return ids, valid, full


def _body_and_head(model: torch.nn.Module):
    body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = model.get_output_embeddings()
    if body is None or head is None:
        raise ValueError(f"{type(model).__name__}: cannot find the transformer body / lm_head")
    return body, head


def zero_loss(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """A scalar 0 whose backward pass reaches every parameter :func:`token_logprobs` uses (the
    body on ``input_ids [R, L]`` and the head's weight), with nothing vocabulary-sized computed:
    a micro-batch without loss tokens (its gradient is 0) still runs the passes a data-parallel
    process must run in step with the others (:mod:`conveyor.trainer.distributed`)."""
    body, head = _body_and_head(model)
    hidden = body(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                  use_cache=False).last_hidden_state
    return hidden.float().sum() * 0.0 + head.weight.float().sum() * 0.0


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 512,
    with_entropy: bool = False,
    mask: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    support: tuple[torch.Tensor, torch.Tensor] | None = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log pi(targets[j] | input_ids[:j+1])`` for every position of a packed row.

    Log-probs are of the temperature-scaled distribution ``softmax(z)``, ``z = logits / T``,
    renormalised over the position's kept set ``S`` when ``support`` records one (sampling-mask
    replay): ``log pi^S(a) = z_a - logsumexp_{v in S} z_v``; positions without a set use the full
    vocabulary. With the engine's sets replayed these equal the engine's behaviour log-probs for
    every sampling setting (temperature, min-p, top-k, top-p; see :mod:`conveyor.rollout.engine`
    and docs/design.md, "Truncated sampling: which log-probs").

    Args:
        model: A causal LM (transformers ``PreTrainedModel``).
        input_ids: ``[R, L]`` int64 packed token ids (R rows).
        position_ids: ``[R, L]`` int64, restarting at 0 per sequence (block-diagonal attention).
        targets: ``[R, L]`` int64 next-token ids.
        temperature: Sampling temperature T > 0 the rollouts used.
        chunk_tokens: Positions per lm_head chunk (memory / speed trade-off).
        with_entropy: Also return the per-token entropy (nats) of the FULL temperature-scaled
            distribution ``softmax(logits / T)`` (not of the truncated one), without gradient
            unless ``entropy_grad``.
        mask: Optional ``[R, L]``; only positions with mask > 0 are projected (others get 0),
            which skips the vocabulary projection of prompt tokens.
        attention_mask: Optional ``[R, 1, L, L]`` bool, True where a position may attend (packed
            rows with shared prompts, :mod:`conveyor.trainer.batch`); None = causal attention
            within each sequence, sequences told apart by ``position_ids``.
        support: Optional ``(ids [N] int64, offsets [R * L + 1] int64)``: the kept set of each
            position's target as CSR over the row-major positions (``PackedBatch.support``); an
            empty range = full vocabulary. Per chunk the logits are gathered at the kept ids
            (``[chunk, largest set]``, padded with -inf), so memory stays one ``[chunk, V]``
            block; a chunk without sets computes exactly as with ``support=None``.
        entropy_grad: Let gradients flow through the entropy (an entropy bonus in the loss;
            ``loss.entropy_coef``); only with ``with_entropy``.

    Returns:
        ``(logprobs [R, L] float32, entropy [R, L] float32 or None)``. Gradients flow into
        ``logprobs`` (through the gathered logits of the kept set) when grad is enabled.

    Raises:
        ValueError: shape mismatch, temperature <= 0, or a ``support`` whose offsets do not have
            ``R * L + 1`` entries or whose ids lie outside ``[0, vocabulary size)``.
    """
    if input_ids.shape != position_ids.shape or input_ids.shape != targets.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)}, position_ids {tuple(position_ids.shape)} and targets "
            f"{tuple(targets.shape)} must all be [R, L]"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    body, head = _body_and_head(model)
    R, L = input_ids.shape
    if attention_mask is not None and attention_mask.shape != (R, 1, L, L):
        raise ValueError(f"attention_mask must be [R, 1, L, L] = {[R, 1, L, L]}, got {list(attention_mask.shape)}")
    if support is not None:
        sup_ids, sup_off = support
        if sup_off.shape != (R * L + 1,):
            raise ValueError(f"support offsets must have R * L + 1 = {R * L + 1} entries, "
                             f"got {list(sup_off.shape)}")
        vocab = head.weight.shape[0]
        if sup_ids.numel() and (int(sup_ids.min()) < 0 or int(sup_ids.max()) >= vocab):
            raise ValueError(f"support ids must lie in [0, {vocab}), "
                             f"got [{int(sup_ids.min())}, {int(sup_ids.max())}]")
        sup_ids = sup_ids.long()
    hidden = body(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    hidden = hidden.reshape(R * L, -1)
    sel = torch.arange(R * L, device=hidden.device) if mask is None else mask.reshape(-1).nonzero().squeeze(-1)
    h = hidden.index_select(0, sel)
    tg = targets.reshape(-1).index_select(0, sel)
    if support is not None:
        sup_start = sup_off[:-1].index_select(0, sel)
        sup_size = sup_off.diff().index_select(0, sel)
    inv_t = 1.0 / temperature
    weight = head.weight
    if torch.is_autocast_enabled(hidden.device.type):
        # one cast of the projection for all chunks (autocast without its weight cache would cast the
        # [V, d] matrix again in every chunk and in every recomputation); gradients flow through it
        weight = weight.to(torch.get_autocast_dtype(hidden.device.type))
    parts = []
    ents = []
    grad = torch.is_grad_enabled()
    for s in range(0, h.shape[0], chunk_tokens):
        hs, ts = h[s : s + chunk_tokens], tg[s : s + chunk_tokens]
        args: tuple = (hs, weight, ts, inv_t)
        if support is not None and bool((sup_size[s : s + chunk_tokens] > 0).any()):
            st, sz = sup_start[s : s + chunk_tokens], sup_size[s : s + chunk_tokens]
            args += _chunk_support(sup_ids, st, sz, ts)
            fn = _chunk_logprobs_entropy_masked if with_entropy else _chunk_logprobs_masked
        else:
            fn = _chunk_logprobs_entropy if with_entropy else _chunk_logprobs
        if with_entropy and entropy_grad:
            args += (True,)
        out_c = checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args)
        if with_entropy:
            parts.append(out_c[0])
            ents.append(out_c[1])
        else:
            parts.append(out_c)
    lp_sel = torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
    out = torch.zeros(R * L, dtype=torch.float32, device=hidden.device).index_put((sel,), lp_sel)
    ent = None
    if with_entropy:
        e_sel = torch.cat(ents) if ents else hidden.new_zeros(0, dtype=torch.float32)
        ent = torch.zeros(R * L, dtype=torch.float32, device=hidden.device).index_put((sel,), e_sel)
        ent = ent.reshape(R, L)
    return out.reshape(R, L), ent


@dataclass(frozen=True)
class ScoringSpec:
    """How the trainer computes log-probs, as a message: what another component (the paused
    engine, the dedicated old-logit worker) needs to score tokens with the trainer's exact
    numerics, without reaching into the trainer (issue 12, section 1).

    Attributes:
        temperature: Sampling temperature T > 0 (log-probs of ``softmax(logits / T)``).
        bf16: Run the forward under bf16 autocast (the trainer's ``trainer.bf16`` choice), on the
            scoring model's device type.
        autocast_weight_cache: autocast's weight cache (``trainer.use_autocast_weight_cache``).
        chunk_tokens: Positions per lm_head chunk (``trainer.logprob_chunk_tokens``).
        micro_batch_tokens / pack_row_tokens: Packing budgets (tokens) of the micro-batches.
    """

    temperature: float
    bf16: bool
    autocast_weight_cache: bool
    chunk_tokens: int
    micro_batch_tokens: int
    pack_row_tokens: int

    def logprobs(self, model: torch.nn.Module, mb) -> torch.Tensor:
        """``[R, L]`` log-probs (on the host) of ``mb``'s targets (a
        :class:`~conveyor.trainer.batch.PackedBatch`) under ``model``, on the model's device,
        without gradient, kept sets replayed (:func:`token_logprobs`)."""
        from conveyor.devices import autocast, module_device

        device = module_device(model)
        x = mb.model_inputs(device)
        with torch.no_grad(), autocast(device, self.bf16, cache_enabled=self.autocast_weight_cache):
            lp, _ = token_logprobs(model, x.input_ids, x.position_ids, x.targets, temperature=self.temperature,
                                   chunk_tokens=self.chunk_tokens, mask=x.mask, attention_mask=x.attention_mask,
                                   support=x.support)
        return lp.cpu()
