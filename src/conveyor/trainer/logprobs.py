"""Per-token log-probabilities without materialising full-vocabulary log-softmax copies.

The transformer body runs once over the packed micro-batch; the vocabulary projection
(``lm_head``) and the log-sum-exp run in chunks of ``chunk_tokens`` positions under activation
checkpointing, so at most one ``[chunk, V]`` logits block is alive at a time, in the forward and in
the backward pass (V = vocabulary size, 49,152 for SmolLM2: a 3.5 k-token batch would otherwise hold
~690 MB per fp32 copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_t: float) -> torch.Tensor:
    logits = F.linear(hidden, weight).float() * inv_t
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _chunk_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                            inv_t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and the entropy (detached) from one vocabulary projection.

    ``H = lse - sum_v p_v z_v`` with ``p = softmax(z)``, ``z = logits / T``: the same value as
    ``-(p * log p).sum()`` without a second ``[chunk, V]`` log-softmax copy or a second projection.
    """
    logits = F.linear(hidden, weight).float() * inv_t
    lse = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    with torch.no_grad():
        z, m = logits.detach(), lse.detach()
        ent = m - torch.linalg.vecdot(torch.exp(z - m.unsqueeze(-1)), z)
    return lp, ent


def _body_and_head(model: torch.nn.Module):
    body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = model.get_output_embeddings()
    if body is None or head is None:
        raise ValueError(f"{type(model).__name__}: cannot find the transformer body / lm_head")
    return body, head


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log pi(targets[j] | input_ids[:j+1])`` for every position of a packed row.

    Log-probs are of the temperature-scaled distribution ``softmax(logits / T)`` with no top-p /
    top-k truncation (the engine's recorded log-probs equal these when it samples with
    top_p = 1, top_k = 0; see :mod:`conveyor.rollout.engine`).

    Args:
        model: A causal LM (transformers ``PreTrainedModel``).
        input_ids: ``[R, L]`` int64 packed token ids (R rows).
        position_ids: ``[R, L]`` int64, restarting at 0 per sequence (block-diagonal attention).
        targets: ``[R, L]`` int64 next-token ids.
        temperature: Sampling temperature T > 0 the rollouts used.
        chunk_tokens: Positions per lm_head chunk (memory / speed trade-off).
        with_entropy: Also return the per-token entropy (nats) of ``softmax(logits / T)``,
            computed without gradient.
        mask: Optional ``[R, L]``; only positions with mask > 0 are projected (others get 0),
            which skips the vocabulary projection of prompt tokens.
        attention_mask: Optional ``[R, 1, L, L]`` bool, True where a position may attend (packed
            rows with shared prompts, :mod:`conveyor.trainer.batch`); None = causal attention
            within each sequence, sequences told apart by ``position_ids``.

    Returns:
        ``(logprobs [R, L] float32, entropy [R, L] float32 or None)``. Gradients flow into
        ``logprobs`` when grad is enabled.

    Raises:
        ValueError: shape mismatch or temperature <= 0.
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
    hidden = body(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    hidden = hidden.reshape(R * L, -1)
    sel = torch.arange(R * L) if mask is None else mask.reshape(-1).nonzero().squeeze(-1)
    h = hidden.index_select(0, sel)
    tg = targets.reshape(-1).index_select(0, sel)
    inv_t = 1.0 / temperature
    weight = head.weight
    if hidden.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        # one cast of the projection for all chunks (autocast without its weight cache would cast the
        # [V, d] matrix again in every chunk and in every recomputation); gradients flow through it
        weight = weight.to(torch.get_autocast_dtype("cpu"))
    parts = []
    ents = []
    grad = torch.is_grad_enabled()
    for s in range(0, h.shape[0], chunk_tokens):
        hs, ts = h[s : s + chunk_tokens], tg[s : s + chunk_tokens]
        fn = _chunk_logprobs_entropy if with_entropy else _chunk_logprobs
        out_c = checkpoint(fn, hs, weight, ts, inv_t, use_reentrant=False) if grad else fn(hs, weight, ts, inv_t)
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
