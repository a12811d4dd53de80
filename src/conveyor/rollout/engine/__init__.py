"""Embedded inference engine: continuous batching with interruptible weight updates.

This is the rollout worker's generator (MISSION.md section 1, AReaL arXiv 2505.24298). One
background thread owns the model and runs a loop of forward passes over a *running batch*:

* **Continuous batching.** Requests join and leave the running batch between decode steps. New
  requests (and, after a weight update, every in-flight request) are *prefilled* in a separate
  forward pass over ``prompt + response-so-far`` and then merged into the running batch; finished
  requests are removed. The KV cache is kept across steps in preallocated per-layer buffers
  ``[B, H_kv, capacity, head_dim]`` that grow in chunks, so a decode step writes one column in
  place instead of re-concatenating the whole cache. Rows are *left padded*: the real tokens of
  row ``b`` occupy cache columns ``[pad[b], length)``; the engine passes its own 4-D boolean
  attention mask and per-row ``position_ids`` (= number of real tokens before the token), so
  results do not depend on which other requests share the batch. Merging (left-padding both
  caches to a common length) and removing rows (index-select plus trimming columns that are
  padding in every remaining row) copy the cache only when the batch composition changes.
* **Interruptible rollout.** :meth:`InferenceEngine.update_weights` hands new weights to the
  decode thread, which applies them *between* two steps: the tensors are copied into the model,
  the version is bumped, the KV cache of every in-flight request (computed with the old weights)
  is dropped, and ``prompt + partial response`` is re-encoded with the new weights before decoding
  continues. Each generated token records the policy version that produced it, so one response
  may span several versions; :attr:`GenerationOutput.num_interruptions` counts the updates a
  request lived through.
* **Sampling.** Per-request temperature / min-p / top-k / top-p / greedy, vectorised over the
  batch by parameter group. Every request draws its random numbers from its own ``torch.Generator``
  seeded from ``(engine seed, submission index)`` (or :attr:`SamplingParams.seed`), so the sampled
  tokens are reproducible for the same submission order no matter how requests were batched
  (log-probs agree up to float rounding, ~1e-6: padding and batch shapes change the arithmetic).
  Sampling is by inverse CDF: one uniform number per token.

Behaviour log-probs (``GenerationOutput.logprobs``) are natural-log probabilities of the sampled
token under the distribution actually sampled from: ``z = logits / T``, then min-p, top-k and
top-p truncation (in vLLM v1's order, ``vllm/v1/sample/sampler.py``) and renormalisation over
the kept set ``S_t``: ``log pi^S(a_t) = z_a - logsumexp_{v in S_t} z_v``. With any truncation
the engine also records ``S_t`` of every sampled token (``GenerationOutput.sampling_mask``, CSR
of token ids, :class:`~conveyor.types.SamplingMask`); the trainer replays it, renormalising the
proximal, current and reference log-probs over the same set
(:func:`conveyor.trainer.logprobs.token_logprobs`), so engine and trainer log-probs agree for
every sampling setting (sampling-mask replay, DeepSeek-V3.2 arXiv 2512.02556 section 3.1;
docs/design.md, "Truncated sampling: which log-probs"). Untruncated sampling (``top_p = 1``,
``top_k = 0``, ``min_p = 0``) stores no set (full vocabulary). Greedy decoding
(``temperature == 0``) records ``log_softmax(logits)`` of the argmax (i.e. at ``T = 1``) and no
set.

Threading: every public method is thread-safe. ``async generate`` may be awaited from any asyncio
event loop (the decode thread resolves the future with ``loop.call_soon_threadsafe``); results of
``generate_batch`` are delivered through :class:`concurrent.futures.Future`.

The engine supports full-attention decoder-only models from ``transformers`` whose attention
layers call ``cache.update(key, value, layer_idx)`` (the Llama family, e.g. SmolLM2).

Package layout (import from ``conveyor.rollout.engine``):

* :mod:`~conveyor.rollout.engine.types` -- ``SamplingParams``, ``GenerationOutput``,
  ``PartialRequest``, ``PromptTooLongError``, the finish reasons;
* :mod:`~conveyor.rollout.engine.sampling` -- ``sample_from_logits`` and the batched sampler;
* :mod:`~conveyor.rollout.engine.kv_cache` -- the KV cache and the running batch;
* :mod:`~conveyor.rollout.engine.local` -- ``InferenceEngine``;
* :mod:`~conveyor.rollout.engine.protocol` -- ``Engine``, what the rest of conveyor calls on an
  engine;
* :mod:`~conveyor.rollout.engine.router` -- ``EngineRouter``: several engines as one
  (``rollout.num_engines``; least-loaded routing with prompt / episode affinity, weights to every
  engine, a dead engine replaced and its requests run again);
* :mod:`~conveyor.rollout.engine.server` -- ``build_app`` / ``serve``: the engine over HTTP with
  SGLang's native API (``conveyor serve``; imports FastAPI, so not imported here);
* :mod:`~conveyor.rollout.engine.remote` -- ``HttpEngine`` (SGLang API) and ``VllmCompletionsEngine``
  (an OpenAI ``/v1/completions`` server, generation only): ``Engine`` clients of a server (import
  from there);
* :mod:`~conveyor.rollout.engine.vllm` -- ``VllmEngine`` (``rollout.engine=vllm``: a vLLM server
  with weight sync every version and exact per-token versions) and ``VllmServer`` (starts,
  health-checks and stops one).

Module-level tunables are read from the module that uses them (``kv_cache._KV_GROWTH``,
``local._PREFILL_MAX_TOKENS``, ``sampling._CDF_BLOCK`` / ``_TOP_P_CANDIDATES``): patch them there.
"""

from conveyor.rollout.engine.local import InferenceEngine
from conveyor.rollout.engine.protocol import Engine
from conveyor.rollout.engine.sampling import sample_from_logits
from conveyor.rollout.engine.types import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    PartialRequest,
    PromptTooLongError,
    SamplingParams,
)

__all__ = [
    "FINISH_ABORT",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "Engine",
    "GenerationOutput",
    "InferenceEngine",
    "PartialRequest",
    "PromptTooLongError",
    "SamplingParams",
    "sample_from_logits",
]
