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


def _chunk_entropy(hidden: torch.Tensor, weight: torch.Tensor, inv_t: float) -> torch.Tensor:
    logits = F.linear(hidden, weight).float() * inv_t
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


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
    hidden = body(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    hidden = hidden.reshape(R * L, -1)
    sel = torch.arange(R * L) if mask is None else mask.reshape(-1).nonzero().squeeze(-1)
    h = hidden.index_select(0, sel)
    tg = targets.reshape(-1).index_select(0, sel)
    inv_t = 1.0 / temperature
    parts = []
    ents = []
    grad = torch.is_grad_enabled()
    for s in range(0, h.shape[0], chunk_tokens):
        hs, ts = h[s : s + chunk_tokens], tg[s : s + chunk_tokens]
        if grad:
            parts.append(checkpoint(_chunk_logprobs, hs, head.weight, ts, inv_t, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(hs, head.weight, ts, inv_t))
        if with_entropy:
            with torch.no_grad():
                ents.append(_chunk_entropy(hs.detach(), head.weight.detach(), inv_t))
    lp_sel = torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
    out = torch.zeros(R * L, dtype=torch.float32, device=hidden.device).index_put((sel,), lp_sel)
    ent = None
    if with_entropy:
        e_sel = torch.cat(ents) if ents else hidden.new_zeros(0, dtype=torch.float32)
        ent = torch.zeros(R * L, dtype=torch.float32, device=hidden.device).index_put((sel,), e_sel)
        ent = ent.reshape(R, L)
    return out.reshape(R, L), ent
