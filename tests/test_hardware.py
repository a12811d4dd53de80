"""trainer.bf16=auto: bf16 autocast only where a bf16 matrix product is measured faster."""

from __future__ import annotations

import pytest

from conveyor import hardware
from conveyor.config import TrainerConfig, load_config


def test_explicit_settings_are_kept():
    assert hardware.resolve_bf16(True)[0] is True
    assert hardware.resolve_bf16(False)[0] is False


@pytest.mark.parametrize(("speedup", "expected"), [(0.02, False), (1.0, False), (1.9, True)])
def test_auto_follows_the_measured_speedup(monkeypatch, speedup, expected):
    monkeypatch.setattr(hardware, "bf16_speedup", lambda device="cpu": speedup)
    use, why = hardware.resolve_bf16("auto")
    assert use is expected
    assert f"{speedup:.2f}x" in why and ("on" if expected else "off") in why


def test_speedup_is_measured_and_positive():
    assert hardware.bf16_speedup("cpu") > 0


def test_trainer_uses_the_resolved_precision(monkeypatch):
    import torch

    from conveyor.config import LossConfig
    from conveyor.models import load_model
    from conveyor.trainer.trainer import Trainer

    monkeypatch.setattr(hardware, "bf16_speedup", lambda device="cpu": 0.05)
    t = Trainer(load_model("tiny").model, TrainerConfig(), LossConfig())
    assert t.bf16 is False and "off" in t.precision_note
    with t._autocast():
        assert not torch.is_autocast_enabled("cpu")


def test_config_accepts_old_and_new_values():
    assert load_config(None, ["trainer.bf16=true"]).trainer.bf16 is True
    assert load_config(None, ["trainer.bf16=false"]).trainer.bf16 is False
    assert TrainerConfig().bf16 == "auto"
    with pytest.raises(ValueError, match="trainer.bf16"):
        load_config(None, ["trainer.bf16=sometimes"])
    with pytest.raises(ValueError, match="must be true, false or auto"):
        hardware.resolve_bf16("sometimes")
