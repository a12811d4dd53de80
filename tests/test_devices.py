"""Device settings and the pieces of the GPU path that a CPU can check (issue 15 section 1):
``trainer.device`` / ``rollout.engine_device`` resolution and errors, ``model.init=random``, the
shape directories, weight-update staging and the resume rule for bf16. The GPU itself:
tests/test_gpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conveyor import devices
from conveyor.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("setting,role,n,want", [
    ("auto", "trainer", 0, "cpu"), ("auto", "engine", 0, "cpu"),
    ("auto", "trainer", 1, "cuda:0"), ("auto", "engine", 1, "cuda:0"),  # one GPU: shared
    ("auto", "trainer", 4, "cuda:0"), ("auto", "engine", 4, "cuda:3"),  # several: the engine its own
    ("cpu", "trainer", 2, "cpu"), ("cuda", "engine", 2, "cuda:0"), ("cuda:1", "trainer", 2, "cuda:1"),
])
def test_resolve(setting, role, n, want):
    assert devices.resolve(setting, "trainer.device", role=role, n_cuda=n) == torch.device(want)


def test_resolve_errors_name_the_key():
    with pytest.raises(ValueError, match=r"rollout.engine_device=cuda: this process sees no CUDA device"):
        devices.resolve("cuda", "rollout.engine_device", n_cuda=0)
    with pytest.raises(ValueError, match=r"trainer.device=cuda:2: this process sees 2 CUDA device\(s\)"):
        devices.resolve("cuda:2", "trainer.device", n_cuda=2)
    with pytest.raises(ValueError, match="expected auto, cpu, cuda or cuda:N"):
        devices.resolve("gpu", "trainer.device", n_cuda=1)


def test_config_keys_validate_and_default_to_auto():
    cfg = load_config(None, [])
    assert cfg.trainer.device == "auto" and cfg.rollout.engine_device == "auto" and cfg.model.init == "pretrained"
    for bad, key in (("trainer.device=gpu", "trainer.device"), ("rollout.engine_device=cuda:x", "rollout.engine_device"),
                     ("model.init=zeros", "model.init")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [bad])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("key", ["trainer.device", "rollout.engine_device"])
def test_train_refuses_cuda_without_a_gpu_before_the_run_directory(tmp_path, key):
    from conveyor.train import run_training

    run = tmp_path / "r"
    cfg = load_config(None, ["model.name=tiny", "trainer.total_steps=1", f"run.dir={run}", f"{key}=cuda"])
    with pytest.raises(ConfigError, match=f"{key}=cuda: this process sees no CUDA device"):
        run_training(cfg)
    assert not run.exists()


@pytest.fixture(scope="module")
def shape_dirs(tmp_path_factory):
    """The directories scripts/shape_models.py writes (tiny, smollm2-135m, qwen2-1.5b), made once for
    this module by running the script; the tests only read them."""
    out = tmp_path_factory.mktemp("shapes")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "shape_models.py"), str(out)], check=True,
                   capture_output=True)
    return out


def test_compiled_decode_probe_on_cpu(shape_dirs):
    """scripts/hf_compiled_decode_probe.py (made for a lent GPU) runs its eager variants on the CPU
    on a shape directory, one line each with ms per decode step, and skips the CUDA-graph one."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "hf_compiled_decode_probe.py"), str(shape_dirs / "tiny"),
                          "--batch", "2", "--prompt", "8", "--new", "4", "--repeats", "1"],
                         check=True, capture_output=True, text=True, env=env, timeout=300).stdout
    lines = {ln.split(":")[0]: ln for ln in out.splitlines() if not ln.startswith("#")}
    assert set(lines) == {"dynamic", "static_eager", "static_compiled"}, out
    for v in ("dynamic", "static_eager"):
        assert "ms/decode step" in lines[v] and "failed" not in lines[v], out
    assert lines["static_compiled"] == "static_compiled: skipped (needs CUDA)"


def test_shape_models_and_random_init(shape_dirs, tiny):
    """scripts/shape_models.py writes config + tokenizer directories; model.init=random builds the
    architecture with seeded random weights (the tiny directory gives the tiny preset's weights)."""
    from transformers import AutoConfig

    from conveyor.models import load_model

    assert sorted(p.name for p in shape_dirs.iterdir()) == ["qwen2-1.5b", "smollm2-135m", "tiny"]
    for d in shape_dirs.iterdir():
        assert (d / "config.json").is_file() and (d / "tokenizer.json").is_file()
        assert not list(d.glob("*.safetensors"))  # no weights
    q = AutoConfig.from_pretrained(str(shape_dirs / "qwen2-1.5b"))
    assert (q.model_type, q.hidden_size, q.intermediate_size, q.num_hidden_layers, q.num_attention_heads,
            q.num_key_value_heads, q.vocab_size) == ("qwen2", 1536, 8960, 28, 12, 2, 49152)
    again = load_model(str(shape_dirs / "tiny"), seed=0, init="random")
    for (name, a), b in zip(tiny.model.state_dict().items(), again.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    other = load_model(str(shape_dirs / "tiny"), seed=1, init="random")
    assert not torch.equal(next(other.model.parameters()), next(again.model.parameters()))
    small = load_model(str(shape_dirs / "smollm2-135m"), seed=0, init="random")
    assert sum(p.numel() for p in small.model.parameters()) == 134_515_008
    with pytest.raises(ValueError, match="model.init='zeros'"):
        load_model(str(shape_dirs / "tiny"), init="zeros")


def test_weight_update_copies_to_the_requested_place(tiny):
    from conveyor.sync import WeightUpdate

    upd = WeightUpdate.from_model(tiny.model, 3, device="cpu")
    for name, p in tiny.model.state_dict().items():
        if name in upd.tensors:
            t = upd.tensors[name]
            assert torch.equal(t, p) and t.data_ptr() != p.data_ptr() and t.device.type == "cpu"
    # pin_memory without a GPU: plain host copies (nothing to pin against)
    pinned = WeightUpdate.from_model(tiny.model, 3, pin_memory=True)
    assert set(pinned.tensors) == set(upd.tensors)


def test_packed_batch_model_inputs_on_the_host_are_its_own_tensors():
    from conveyor.trainer.batch import pack
    from conveyor.types import Sample, Trajectory

    t = Trajectory(sample=Sample("s", "q", "1", "t"), group_id="g", prompt_ids=[5, 6, 7], response_ids=[8, 9],
                   behaviour_logprobs=[-1.0, -1.0], versions=[0, 0])
    mb = pack([t], torch.zeros(1), [[0]])
    x = mb.model_inputs(torch.device("cpu"))
    assert x.input_ids is mb.input_ids and x.mask is mb.mask and x.targets is mb.targets


def test_recorded_bf16_is_kept_only_on_the_same_kind_of_device(tmp_path):
    from conveyor.rundir import recorded_bf16

    (tmp_path / "events.jsonl").write_text(json.dumps(
        {"event": "precision", "bf16": True, "requested": "auto", "note": "x", "device_type": "cuda"}) + "\n")
    assert recorded_bf16(tmp_path) is True and recorded_bf16(tmp_path, "cuda") is True
    assert recorded_bf16(tmp_path, "cpu") is None  # moved to a CPU: choose again
    (tmp_path / "events.jsonl").write_text(json.dumps(  # written before device_type: a CPU run
        {"event": "precision", "bf16": False, "requested": "auto", "note": "x"}) + "\n")
    assert recorded_bf16(tmp_path, "cpu") is False and recorded_bf16(tmp_path, "cuda") is None
    with (tmp_path / "events.jsonl").open("a") as f:  # then resumed on a GPU: each kind keeps its first choice
        f.write(json.dumps({"event": "precision", "bf16": True, "requested": "auto", "note": "x",
                            "device_type": "cuda"}) + "\n")
        f.write(json.dumps({"event": "precision", "bf16": True, "requested": "auto", "note": "x",
                            "device_type": "cpu"}) + "\n")
    assert recorded_bf16(tmp_path, "cpu") is False and recorded_bf16(tmp_path, "cuda") is True


def test_cuda_bf16_auto_does_not_time_a_product(monkeypatch):
    """On a GPU, trainer.bf16=auto follows the GPU's bf16 support (a small timed product says nothing
    there); on the CPU it still measures."""
    from conveyor import hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Fake GPU")
    monkeypatch.setattr(hardware, "bf16_speedup", lambda device="cpu": pytest.fail("timed a product on cuda"))
    use, note = hardware.resolve_bf16("auto", "cuda")
    assert use and "Fake GPU supports bf16" in note


def test_inspect_loads_a_random_init_run_as_configured(tmp_path, shape_dirs, tiny):
    """A model.init=random run without export or checkpoint: conveyor inspect's base model is the
    run's random model (its seed), not an attempt to load weights the directory does not hold."""
    from conveyor.config import load_config
    from conveyor.inspect_attention import load_policy

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(None, [f"model.name={shape_dirs / 'tiny'}", "model.init=random", "model.seed=0"])
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    policy = load_policy(run)
    for (name, a), b in zip(tiny.model.state_dict().items(), policy.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("overrides,message", [
    (["trainer.world_size=2", "trainer.device=cuda"],
     r"trainer.world_size=2 with trainer.device=cuda: data parallelism runs its processes on the CPU"),
    (["runtime.name=ray", "rollout.engine_device=cuda:0"],
     r"runtime.name=ray with rollout.engine_device=cuda:0: the Ray runtime's engines run in actors that request no GPU"),
    (["runtime.name=ray", "runtime.trainer=actor", "trainer.device=cuda"],
     r"runtime.trainer=actor with trainer.device=cuda: the trainer actor requests no GPU"),
])
def test_gpu_placements_not_built_are_refused_when_the_config_loads(overrides, message):
    """A fresh-user trial: world_size=2 with a CUDA trainer printed a follower's traceback; Ray with a
    CUDA engine failed in the actor after the run directory was made."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    for ok in (["trainer.world_size=2", "trainer.device=cpu"], ["runtime.name=ray", "rollout.engine_device=auto"]):
        load_config(None, ok)


def test_device_setting_errors_say_it_once_and_hint_lower_case():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.device=CUDA"])
    line = str(e.value).splitlines()[-1]  # (the first line repeats the overrides)
    assert line.count("trainer.device") == 1 and "settings are lower case: 'cuda'" in line
    with pytest.raises(ValueError, match=r"^--device='gpu': expected auto, cpu, cuda or cuda:N$"):
        devices.check_setting("gpu", "--device")


def test_model_init_cannot_change_on_resume(tmp_path):
    from conveyor.rundir import check_resume_compatible

    (tmp_path / "config.json").write_text(json.dumps(load_config(None, ["model.init=random"]).to_dict()))
    with pytest.raises(ValueError, match=r"model.init cannot change on resume \(checkpoint has 'random', got 'pretrained'\)"):
        check_resume_compatible(tmp_path, load_config(None, []))
    check_resume_compatible(tmp_path, load_config(None, ["model.init=random"]))


def test_model_directories_that_cannot_load_say_why(tmp_path, shape_dirs):
    """A fresh-user trial: a shape directory without model.init=random, one without a tokenizer, and a
    run directory ended in transformers tracebacks."""
    from conveyor.models import ModelLoadError, load_model

    with pytest.raises(ModelLoadError, match=r"has a config.json but no weights .* load it with model.init=random"):
        load_model(str(shape_dirs / "tiny"))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((shape_dirs / "tiny" / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"model.init=random: .* has no tokenizer transformers can load"):
        load_model(str(bare), init="random")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(load_config(None, []).to_dict()))
    (run / "events.jsonl").write_text("")
    with pytest.raises(ModelLoadError, match=r"is a conveyor run directory, not a model: its trained policy is .*export"):
        load_model(str(run))


def test_eval_takes_init_random(tmp_path, shape_dirs, monkeypatch):
    from typer.testing import CliRunner

    from conveyor.cli import app

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["eval", "--model", str(shape_dirs / "tiny"), "--init", "random", "--n", "2",
                                 "--max-new-tokens", "4", "--no-progress", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "(random weights) loaded" in out and "engine on cpu" in out
    # an export's random-weight evaluation (fresh-user finding): no policy version, init recorded, and a
    # default output path of its own (it overwrote the export's real figure)
    import shutil

    from conveyor.config import load_config
    from conveyor.eval import write_export_settings

    export = tmp_path / "run" / "export"
    shutil.copytree(shape_dirs / "tiny", export)
    write_export_settings(export, load_config(None, ["model.name=tiny", "data.heldout=mawps:singleop"]),
                          policy_version=5)
    r = CliRunner().invoke(app, ["eval", "--model", str(export), "--init", "random", "--n", "1",
                                 "--max-new-tokens", "2", "--no-progress", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    written, = (tmp_path / "runs" / "eval").glob("*export*__init_random.json")
    res = json.loads(written.read_text())
    assert res["init"] == "random" and res["policy_version"] is None
    r = CliRunner().invoke(app, ["eval", "--model", "tiny", "--init", "zeros"])
    assert r.exit_code == 2 and "--init must be pretrained or random" in r.output
