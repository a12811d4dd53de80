"""Host-memory controls (conveyor.memory) and their wiring into the trainer."""

from __future__ import annotations

import copy
import platform

import pytest

from conveyor import memory
from conveyor.config import LossConfig, TrainerConfig
from conveyor.trainer import trainer as trainer_mod
from tests.test_trainer import make_trajs


def test_mmap_threshold_bounds():
    for bad in (0, -1, 32 * 2**20 + 1):
        with pytest.raises(ValueError, match="malloc_mmap_threshold"):
            memory.set_malloc_mmap_threshold(bad)
    with pytest.raises(ValueError):
        TrainerConfig(malloc_mmap_threshold=64 * 2**20)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt / malloc_trim are glibc's")
def test_glibc_controls_take_effect():
    assert memory.set_malloc_mmap_threshold(32 * 2**20) is True  # glibc's own upper value: harmless here
    assert isinstance(memory.release_free_memory(), bool)


def test_trainer_wires_trim_and_threshold(tiny, monkeypatch):
    calls = {"trim": 0, "threshold": []}
    monkeypatch.setattr(trainer_mod, "release_free_memory", lambda: calls.__setitem__("trim", calls["trim"] + 1))
    monkeypatch.setattr(trainer_mod, "set_malloc_mmap_threshold", lambda n: calls["threshold"].append(n))
    cfg = TrainerConfig(lr=1e-3, warmup_steps=0, malloc_trim=True, malloc_mmap_threshold=2**20, micro_batch_tokens=64,
                        pack_row_tokens=32)
    tr = trainer_mod.Trainer(copy.deepcopy(tiny.model), cfg, LossConfig())
    assert calls["threshold"] == [2**20]
    m = tr.train_step(make_trajs(8))
    assert calls["trim"] == 1 + m["train/micro_batches"]  # step start + after each micro-batch's backward
    calls["trim"] = 0
    tr2 = trainer_mod.Trainer(copy.deepcopy(tiny.model), TrainerConfig(lr=1e-3, warmup_steps=0), LossConfig())
    tr2.train_step(make_trajs(8))
    assert calls["trim"] == 0  # off by default


def test_active_allocator_reports_the_system_malloc_without_preload(monkeypatch):
    import os

    if "LD_PRELOAD" in os.environ:
        pytest.skip("a malloc is preloaded into the test process")
    assert memory.active_allocator() == "system"
