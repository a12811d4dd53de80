"""Shared fixtures: the tiny model (random 2-layer Llama, SmolLM2 tokenizer) loads in ~0.2 s."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("CONVEYOR_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def tiny():
    """A ``LoadedModel`` of the ``tiny`` preset (seed 0)."""
    from conveyor.models import load_model

    return load_model("tiny", seed=0)


@pytest.fixture(scope="session")
def smollm():
    """The real SmolLM2-135M-Instruct (first load dequantizes, ~20 s)."""
    from conveyor.models import load_model

    return load_model("smollm2-135m-instruct")
