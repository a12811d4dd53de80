"""The ``Engine`` protocol (``conveyor.rollout.engine.protocol``) and the package's import surface."""

from __future__ import annotations

import inspect

import conveyor.rollout.engine as engine_pkg
from conveyor.models import load_model
from conveyor.rollout.engine import Engine, InferenceEngine
from conveyor.rollout.engine import local as engine_local

# what the rest of conveyor calls on an engine today (see the protocol's docstring)
MEMBERS = {
    "version",
    "start",
    "stop",
    "pause",
    "resume",
    "stats",
    "generate",
    "update_weights",
    "partial_requests",
}


def protocol_members() -> set[str]:
    return {n for n in vars(Engine) if not n.startswith("_")} | set(getattr(Engine, "__annotations__", {}))


def test_protocol_lists_exactly_the_members_in_use():
    assert protocol_members() == MEMBERS


def test_inference_engine_satisfies_the_protocol():
    lm = load_model("tiny", seed=0)
    engine = InferenceEngine(lm.model, lm.tokenizer, max_batch_size=2, num_threads=1)
    assert isinstance(engine, Engine)
    # no caller reads an engine's model (old log-probs are scored through a capability)
    assert "model" not in protocol_members()
    assert callable(engine.score_old_logprobs)
    for name in sorted(MEMBERS):
        want = inspect.getattr_static(Engine, name)
        got = inspect.getattr_static(InferenceEngine, name)
        if isinstance(want, property):
            assert isinstance(got, property), name
            want, got = want.fget, got.fget
        assert callable(got), name
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), name
        # parameters (names, kinds, defaults, annotations) and the return annotation; an optional
        # capability may add keyword-only parameters with defaults (generate's priority)
        sg, sw = inspect.signature(got), inspect.signature(want)
        extra = [p for n, p in sg.parameters.items() if n not in sw.parameters]
        assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extra), name
        trimmed = sg.replace(parameters=[p for n, p in sg.parameters.items() if n in sw.parameters])
        assert trimmed == sw, name
    assert [n for n in inspect.signature(InferenceEngine.generate).parameters if n not in
            inspect.signature(Engine.generate).parameters] == ["priority"] and InferenceEngine.supports_priority


def test_an_object_missing_a_member_is_not_an_engine():
    lm = load_model("tiny", seed=0)
    engine = InferenceEngine(lm.model, lm.tokenizer, max_batch_size=2, num_threads=1)

    class NoPartials:  # every member but partial_requests, delegated to a real engine
        def __getattr__(self, name):
            if name == "partial_requests":
                raise AttributeError(name)
            return getattr(engine, name)

    assert not isinstance(NoPartials(), Engine)
    assert not isinstance(object(), Engine)


def test_package_reexports():
    for name in engine_pkg.__all__:
        assert hasattr(engine_pkg, name), name
    assert engine_pkg.InferenceEngine is engine_local.InferenceEngine
