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


def _benchmark_items(items):
    """The items of tests/test_benchmarks.py."""
    return [i for i in items if getattr(i, "module", None) is not None and i.module.__name__.split(".")[-1] == "test_benchmarks"]


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(session, config, items):
    """The benchmark smoke tests (tests/test_benchmarks.py) run last."""
    bench = _benchmark_items(items)
    items[:] = [i for i in items if i not in bench] + bench


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """Start the selected benchmark smoke tests' scripts as the tests start to run, at nice 19,
    so they use the cores the other tests leave idle (tests/test_benchmarks.py's docstring). Not
    for runs that execute no test (``--collect-only``, ``--setup-plan``, ``--setup-only``)."""
    opt = session.config.option
    if opt.collectonly or getattr(opt, "setupplan", False) or getattr(opt, "setuponly", False):
        return
    if session.testsfailed and not opt.continue_on_collection_errors:
        return  # pytest stops before the first test (collection errors)
    bench = _benchmark_items(session.items)
    if bench:
        bench[0].module.start_scripts({i.originalname for i in bench})


def pytest_sessionfinish(session, exitstatus):
    """Kill benchmark scripts still running (an interrupted or failed session) and clean up."""
    for item in _benchmark_items(getattr(session, "items", [])):
        item.module.stop_scripts()
        break
