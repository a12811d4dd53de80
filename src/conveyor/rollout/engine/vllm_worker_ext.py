"""conveyor's vLLM worker extension (``--worker-extension-cls
conveyor_vllm_worker_ext.ConveyorWorkerExtension``): methods a vLLM worker gains, called through
``POST /collective_rpc``. This file runs inside the vLLM server's interpreter, so it imports
nothing from conveyor; :class:`conveyor.rollout.engine.vllm.VllmServer` copies it into a
directory of its own on the server's ``PYTHONPATH`` under the module name
``conveyor_vllm_worker_ext``.

Why it exists: vLLM 0.32's ``reload_weights`` (the in-place layerwise reload) re-processes only
the layers whose weights the checkpoint names. A model with tied word embeddings (SmolLM2,
Qwen2.5-0.5B, Llama-3.2-1B) names only the input embeddings; its output head keeps what it had
after the first load, and on a CPU that is a packed copy of the *old* weights (oneDNN / sgl-kernel
``cpu_linear``, ``dispatch_cpu_unquantized_gemm``): after the first update the logits came from
the old embeddings (measured: log-probs up to 0.47 nats off on the test model with only the
embeddings changed, exact again with this extension; tests/test_vllm_engine.py).
:meth:`conveyor_reload_weights` reloads, ties the head to the embeddings again as vLLM does at
load (``UnquantizedEmbeddingMethod.tie_weights``: ``head.weight = embed_tokens.weight``) and runs
the head's ``process_weights_after_loading`` so its packed copy is rebuilt from the new weights.
"""

from __future__ import annotations

EXTENSION_VERSION = 1


class ConveyorWorkerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker)."""

    def conveyor_extension_version(self) -> int:
        """The extension's version (the client checks it is loaded)."""
        return EXTENSION_VERSION

    def conveyor_reload_weights(self, weights_path: str) -> int:
        """``reload_weights(weights_path=...)``, then, for a model with tied word embeddings, the
        output head tied to the (new) input embeddings again and its post-load processing re-run.

        Args:
            weights_path: A directory of safetensors (``conveyor.sync.write_weights``).

        Returns:
            1 when a tied head was refreshed, else 0.
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            VocabParallelEmbedding,
        )

        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        config = getattr(model, "config", None)
        tied = getattr(config, "tie_word_embeddings", False) or getattr(
            getattr(config, "text_config", None), "tie_word_embeddings", False)
        if not tied:
            return 0
        heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
        embeds = [m for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
        if len(heads) != 1 or len(embeds) != 1 or heads[0].weight.shape != embeds[0].weight.shape:
            return 0
        head, embed = heads[0], embeds[0]
        if head.weight is not embed.weight:
            head.weight = embed.weight
        process = getattr(head.quant_method, "process_weights_after_loading", None)
        if callable(process):
            process(head)
        return 1
