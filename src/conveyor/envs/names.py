"""The built-in environments' names and default data sets: a leaf module (it imports nothing), so
:mod:`conveyor.config` can validate ``env.name`` without importing the environments, the rollout
and the engine it configures (issue 44 section 7: that import made a circle of 14 modules).
:mod:`conveyor.envs.registry` builds the environments these names stand for."""

BUILTIN_ENVS: tuple[str, ...] = ("guess", "math_python")
"""The built-in environment names (besides ``none``)."""

ENV_DATA: dict[str, tuple[str, str]] = {"guess": ("guess:train", "guess:heldout")}
"""Default ``(data.train, data.heldout)`` of environments whose tasks are not the maths sets."""
