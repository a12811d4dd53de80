"""The environment protocol of multi-turn agents (issue 14, section 1) and the token-exact way a
new turn is appended to a conversation.

An :class:`Environment` is a per-episode object (a factory makes one per episode)::

    first = await env.reset(sample)              # the first user message (str)
    result = await env.step(action_text)         # StepResult(observation, reward, done, info)

Both are async, so a slow environment (a sandbox, a web call) overlaps with other episodes on the
controller's event loop.

Optional attributes the agent workflow reads when an environment has them (tool-calling
environments such as :class:`~conveyor.envs.math_python.MathPythonEnv` set them from their
:class:`~conveyor.envs.tool_calls.ToolCallFormat`):

* ``stop``: stop strings that end a model turn (e.g. ``("</tool_call>",)``), added to the
  sampling parameters' own;
* ``observation_role``: the chat role of observations (default ``"user"``; ``"tool"`` for
  templates that render tool results);
* ``tools``: tool schemas (OpenAI function-tool shape) passed to the chat template for the
  first prompt (``apply_chat_template(..., tools=...)``), or None;
* ``episode_stats()``: per-episode counters (e.g. tool calls, sandbox incidents), copied into
  ``trajectory.metadata["env_stats"]`` when the episode ends. The agent workflow (:mod:`conveyor.rollout.agent`) keeps the tokens the
model generated exactly and appends each observation once, encoded with :func:`turn_ids`, so the
history is never re-tokenised (re-tokenising a decoded conversation can change the tokens that
are trained on, which makes the importance ratios wrong).

**How a turn is encoded** (:func:`turn_ids`): the chat template is rendered as text for a fixed
two-message conversation with and without the new message (generation prompt included for the
latter); the text between them is the new turn's template text, encoded alone. The piece of the
template after an assistant message's end token (e.g. ChatML's ``"\\n"`` after
``<|im_end|>``) belongs in front of the next turn and is included. This is the "delta against a
base conversation" technique of verl's and SkyRL's multi-turn rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from conveyor.types import Sample

__all__ = ["Environment", "StepResult", "first_prompt_ids", "turn_ids"]


@dataclass(frozen=True)
class StepResult:
    """What an environment answers to one action.

    Attributes:
        observation: The next message to the model (a user / tool turn), or None when the
            episode ends without one.
        reward: This turn's reward (0.0 for outcome-only tasks until the last turn).
        done: The episode is over.
        info: Free-form extras (e.g. ``{"correct": True}``), copied into the trajectory's
            metadata under ``env_info``.
    """

    observation: str | None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode of an interactive task (module docstring)."""

    async def reset(self, sample: Sample) -> str:
        """Start the episode for ``sample``; returns the first user message."""
        ...

    async def step(self, action: str) -> StepResult:
        """The model's turn (its text, special tokens removed) -> the environment's answer."""
        ...


_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


def _render(tokenizer, messages: list[dict], gen: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def first_prompt_ids(tokenizer, content: str, system: str | None = None, *,
                     tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of the first user turn (and an optional system message), generation prompt
    appended: the prompt of an agent episode.

    Args:
        tokenizer: The policy's tokenizer (chat template).
        content: The first user message.
        system: An optional system message.
        tools: Tool schemas for templates that render them (``apply_chat_template(...,
            tools=tools)``; Qwen-style templates put them in the system prompt); None: none.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; agent episodes need one")
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    kwargs = {"tools": tools} if tools else {}
    out = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, **kwargs)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


def turn_ids(tokenizer, content: str, role: str = "user", *, after_eos: bool = True) -> list[int]:
    """Token ids to append after the model's turn so that the conversation continues with a
    ``role`` message ``content`` and the generation prompt of the next assistant turn (module
    docstring, "How a turn is encoded").

    Args:
        tokenizer: The policy's tokenizer (with a chat template).
        content: The message text.
        role: ``"user"`` or ``"tool"`` (whatever roles the template accepts).
        after_eos: The model's turn ended with its end-of-turn token (the usual case): the
            template text after that token (ChatML's newline) is prepended. False: the turn was
            cut, and the template's end-of-turn text is prepended as well.

    Returns:
        Token ids (encoded once, no special tokens added beyond the template's own text).

    Raises:
        ValueError: the tokenizer has no chat template, or the template does not render the base
            conversation as a prefix of the longer one (a template that rewrites earlier turns,
            which cannot be extended token-exactly).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; agent episodes need one")
    base = _render(tokenizer, _BASE, False)
    longer = _render(tokenizer, [*_BASE, {"role": role, "content": content}], True)
    if not longer.startswith(base):
        raise ValueError("the chat template re-renders earlier turns when a message is added: a turn cannot "
                         "be appended token-exactly")
    delta = longer[len(base):]
    # what the template puts after the assistant's content: its end-of-turn token and what follows it
    tail = base[base.rindex("y") + 1:]
    eos = tokenizer.eos_token or ""
    if after_eos and eos and eos in tail:
        prefix = tail[tail.index(eos) + len(eos):]
    else:
        prefix = tail
    return list(tokenizer.encode(prefix + delta, add_special_tokens=False))
