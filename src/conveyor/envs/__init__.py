"""Agent environments and the tools they offer the model (issue 14).

Modules:

- ``base``: the :class:`~conveyor.envs.base.Environment` protocol (``async reset(sample)`` ->
  first message, ``async step(action)`` -> :class:`~conveyor.envs.base.StepResult`: observation,
  per-turn reward, done, info) and :func:`~conveyor.envs.base.turn_ids`, the token-exact
  encoding of a new turn (the agent workflow is :mod:`conveyor.rollout.agent`).
- ``guess``: guess-the-number, an interactive multi-turn environment with per-turn feedback
  and rewards.
- ``tools``: the :class:`~conveyor.envs.tools.Tool` protocol (name, description, JSON schema of
  the arguments in the OpenAI function-calling shape, ``async call``), the
  :class:`~conveyor.envs.tools.ToolResult` every call returns, a
  :class:`~conveyor.envs.tools.ToolRegistry` of tools by name, and the calculator as a tool.
- ``sandbox``: runs model-written Python code in a bubblewrap sandbox (no network, private
  temporary directory, read-only system files, CPU / wall / memory / process / file / output
  limits) and :class:`~conveyor.envs.sandbox.PythonTool`, the tool built on it, which counts
  contained incidents per kind.
- ``tool_calls``: how a turn calls a tool (the Hermes / Qwen ``<tool_call>`` JSON format, the
  fenced ```` ```python ```` fallback for chat templates without tools), pure parsing
  functions and :class:`~conveyor.envs.tool_calls.ToolCallFormat`.
- ``math_python``: maths with the sandboxed python tool, the final answer graded in the reward
  service (SAO's setting).
- ``registry``: environments by ``env.name`` (``guess``, ``math_python``,
  ``package.module:factory``), the per-episode factory and the start-up check.

Import from the submodules directly (this package deliberately re-exports nothing).
"""
