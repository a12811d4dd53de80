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


def test_a_recorded_choice_is_kept_without_measuring(monkeypatch):
    def no_measure(device="cpu"):
        raise AssertionError("measured again")

    monkeypatch.setattr(hardware, "bf16_speedup", no_measure)
    use, why = hardware.resolve_bf16("auto", recorded=True)
    assert use is True and "kept on resume" in why
    assert hardware.resolve_bf16(False, recorded=True)[0] is False  # an explicit setting wins


def test_resume_keeps_the_precision_auto_chose_at_the_start(tmp_path, monkeypatch):
    """trainer.bf16=auto was measured again at every resume: the noisy speed-up (1.48-3.48x
    measured on one machine) could flip the precision between the segments of a run. A resume
    now keeps the run's recorded choice (its precision event)."""
    import json

    from conveyor.rundir import recorded_bf16
    from conveyor.train import load_run_config, run_training

    run = tmp_path / "r"
    fast = ["model.name=tiny", "trainer.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
            "run.progress=false", "run.export=false", "reward.workers=1", "rollout.tool=none", "reward.fn=format",
            "trainer.num_threads=1", "rollout.engine_threads=1", "run.eval_before=false", "run.eval_after=false"]
    monkeypatch.setattr(hardware, "bf16_speedup", lambda device="cpu": 1.05)  # just below BF16_MIN_SPEEDUP
    run_training(load_config(None, fast + ["trainer.total_steps=1", f"run.dir={run}"]))
    monkeypatch.setattr(hardware, "bf16_speedup", lambda device="cpu": 3.48)  # a new measurement would say on
    run_training(load_run_config(run, ["trainer.total_steps=2"]), resume_dir=run)
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    precision = [e for e in events if e["event"] == "precision"]
    assert [e["bf16"] for e in precision] == [False, False]
    assert "kept on resume" in precision[1]["note"] and precision[0]["requested"] == "auto"
    # an explicit setting on resume is not auto's choice, and does not become it
    run_training(load_run_config(run, ["trainer.total_steps=3", "trainer.bf16=true"]), resume_dir=run)
    assert recorded_bf16(run) is False
    # events written before the "requested" field: the note says it was auto's choice
    old = tmp_path / "old"
    old.mkdir()
    (old / "events.jsonl").write_text(
        json.dumps({"event": "precision", "bf16": True, "note": "trainer.bf16=true"}) + "\n"
        + json.dumps({"event": "precision", "bf16": False, "note": "trainer.bf16=auto: bf16 autocast off"}) + "\n")
    assert recorded_bf16(old) is False
    assert recorded_bf16(tmp_path / "none") is None


def test_set_own_thread_count_changes_the_calling_thread_only():
    """A worker thread's count (the dedicated old-logit worker, the reference scorer) must not
    become the default of threads started later (it did for the dedicated worker: a later
    thread got the worker's count)."""
    import threading

    import torch

    from conveyor.hardware import set_own_thread_count

    default = torch.get_num_threads()
    want = 1 if default != 1 else 2
    inside, later = [], []

    def worker():
        set_own_thread_count(want)
        inside.append(torch.get_num_threads())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert inside == [want] and later == [default] and torch.get_num_threads() == default
    with pytest.raises(ValueError, match=">= 1"):
        set_own_thread_count(0)
