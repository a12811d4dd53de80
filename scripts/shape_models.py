"""Write model directories that hold an architecture and a tokenizer but no weights, for speed and
memory measurements with ``model.init=random`` (a GPU machine without the pretrained files or a
model hub: speed does not need trained weights).

Usage: python scripts/shape_models.py OUT_DIR

Writes ``OUT_DIR/<name>/`` (``config.json`` + the SmolLM2 tokenizer's files, ~3.5 MB each) for
- ``tiny``: the ``tiny`` preset's config (2 layers, hidden size 64); with ``model.init=random`` and
  the same ``model.seed`` the same weights as the preset;
- ``smollm2-135m``: SmolLM2-135M-Instruct's config (Llama, 30 layers, hidden 576, 135 M parameters);
- ``qwen2-1.5b``: Qwen2-1.5B's published shape (28 layers, hidden 1536, MLP 8960, 12 query / 2
  key-value heads, rope theta 1e6, tied embeddings) with SmolLM2's vocabulary of 49,152 tokens
  (1.39 B parameters instead of Qwen2-1.5B's 1.54 B: its 151,936-token embedding is smaller here).

Then e.g. ``conveyor train model.name=OUT_DIR/qwen2-1.5b model.init=random ...``.
"""

from __future__ import annotations

from pathlib import Path


def qwen2_1_5b_config(tokenizer):
    """Qwen2-1.5B's shape (its published config.json) with ``tokenizer``'s vocabulary."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def main(out: Path) -> None:
    from transformers import AutoConfig

    from conveyor.models import DEFAULT_MODEL, load_tokenizer, resolve_model_dir, tiny_config

    tok = load_tokenizer(DEFAULT_MODEL)
    configs = {
        "tiny": tiny_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id),
        "smollm2-135m": AutoConfig.from_pretrained(str(resolve_model_dir(DEFAULT_MODEL))),
        "qwen2-1.5b": qwen2_1_5b_config(tok),
    }
    for name, cfg in configs.items():
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        cfg.save_pretrained(str(d))
        tok.save_pretrained(str(d))
        print(d)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path, help="where the model directories go (created)")
    main(ap.parse_args().out_dir)
