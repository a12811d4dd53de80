"""An OpenAI-compatible endpoint over conveyor's engine, for agent code written against the
``openai`` client (issue 14, section 4): ``POST /v1/chat/completions`` and ``POST
/v1/completions`` served in process during a run, every call recorded token for token into the
trajectory of the episode (the *session*) it belongs to.

The agent side is :mod:`conveyor.rollout.openai_agent` (``env.name=openai:package.module:fn``);
this module is the HTTP server and the per-episode recording.

**Threads.** :class:`OpenAIServer` runs uvicorn (FastAPI) in its own thread on
``127.0.0.1`` (an ephemeral port unless told otherwise). A request is parsed there, its session is
looked up, and the session's handler runs on the session's own event loop (the loop of the
episode, e.g. the rollout controller's; ``asyncio.run_coroutine_threadsafe``): the engine is
called from the same loop as every other workflow calls it, and all recording happens on that one
loop. An ``async def`` agent must therefore not block its loop with a synchronous client (use
``openai.AsyncOpenAI``); a plain ``def`` agent runs in a worker thread and may use
``openai.OpenAI``.

**Sessions.** Every call names its session (one episode) by the first of: the URL path
``/sessions/<id>/v1/...`` (the ``base_url`` an agent is handed, so unchanged agent code needs
nothing else), the header ``X-Session-Id``, the request's ``user`` field (read only when neither
of the others is given). Path and header naming different sessions is a 400; an unknown or
finished session a 404.

**Token exactness** (the same rules as :class:`~conveyor.rollout.agent.AgentWorkflow`; the
conversation-tree idea of AReaL's ``ArealOpenAI`` client, whose ``InteractionCache`` links a call
to the earlier call whose messages + answer are a prefix of its messages,
``areal/experimental/openai/cache.py``):

* the first chat call's messages are rendered once with the chat template
  (``apply_chat_template(messages, tools=tools, add_generation_prompt=True)``): the
  trajectory's prompt;
* a later chat call must *extend* the conversation: its messages start with the previous call's
  messages and the assistant message that call returned (as returned: ``content`` and
  ``tool_calls``, compared by tool name and decoded arguments, surrounding whitespace and
  ``None`` vs ``""`` ignored; or the raw generated text as ``content``). Only the new messages
  are encoded, once, as the delta of the template between a fixed two-message conversation
  with and without them (:func:`conveyor.envs.base.turn_ids`' technique, generalised to several
  messages and tools), prefixed with the template's end-of-turn text when the previous turn was
  cut (no end-of-turn token) -- and appended after the tokens the model generated as
  *observation* tokens (action mask 0, log-prob 0.0, the version of the action token before).
  Earlier turns are never re-tokenised;
* a call that does not extend the conversation (the agent rewrote or dropped history, changed
  the tool list, sent a chat call in a completions session or the reverse) is **refused** with
  HTTP 400 saying which message differs, and the episode fails with that message even if the
  agent catches the error (:class:`~conveyor.rollout.openai_agent.OpenAISessionError`). One
  episode is one conversation: the rollout controller takes exactly ``rollout.group_size``
  trajectories per sample, so a second conversation cannot become a second trajectory;
* completions: a token-id prompt must start with every token of the session so far (the new
  ids are appended); a string prompt must start with the previous string prompt + the text
  returned for it (the rest is encoded alone and appended). The first string prompt is encoded
  with the tokenizer's special tokens, as vLLM does.

**Sampling is the run's.** ``temperature``, ``top_p`` and ``seed`` of a request are ignored: the
episode samples with the run's settings (``rollout.temperature`` / ``top_p`` / ``top_k`` /
``min_p``; ``conveyor eval``: ``--temperature``), because the trainer's log-probs are computed
under those settings and a behaviour policy it does not know would make the importance ratios
wrong. Ignored fields that differ from the run's are listed in the trajectory's metadata
(``sampling_ignored``) and logged once. ``max_tokens`` / ``max_completion_tokens`` are honoured
up to ``rollout.max_new_tokens`` and the episode's remaining token budget; ``stop`` strings are
honoured (the stop string is cut from the returned text, as OpenAI does, but stays in the
trajectory's tokens: the model generated it). Refused with a 400 naming the field: ``n`` other
than 1, ``stream``, ``echo``, ``suffix``, ``best_of`` > 1, non-zero penalties, ``logit_bias``,
``response_format`` other than text, ``tool_choice`` ``"required"`` or a named function,
``top_logprobs`` > 0, completions ``logprobs`` > 0 (``logprobs=0`` / chat ``logprobs=true``:
the sampled tokens' log-probs), and any field not listed here.

**Tools.** With ``tools`` the chat template renders the schemas when it has a tools branch
(:func:`~conveyor.envs.tool_calls.template_supports_tools`); otherwise (SmolLM2) they are written
into a system message with the Hermes call syntax (appended to the first message when it is a
system message), tool results become user messages wrapped in ``<tool_response>`` tags and
earlier assistant tool calls are written as ``<tool_call>`` text (the fallback of
:mod:`conveyor.envs.tool_calls`). A generated ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` (Hermes, parsed like vLLM's ``Hermes2ProToolParser``) comes back in
OpenAI's shape (``message.tool_calls[i] = {"id", "type": "function", "function": {"name",
"arguments": <JSON text>}}``, ``finish_reason="tool_calls"``, ``content`` the text around the
calls or None); a malformed call stays in ``content``. The turn stops at ``</tool_call>`` (one
call per turn) unless the request sets ``parallel_tool_calls=true``.

**Limits.** ``max_calls`` model calls (``env.max_turns``) and ``max_total_tokens`` response tokens
(actions and observations, ``env.max_episode_tokens``) per session. A call past a limit (or whose
new messages do not fit) is answered with an empty message and ``finish_reason="length"``,
nothing is appended, and every later call of the session gets the same answer: the episode is
*cut* (``env_done`` False), the agent decides what to return.

Response shapes are OpenAI's (https://platform.openai.com/docs/api-reference/chat/object and
``/completions/object``: ``id``, ``object``, ``created``, ``model``, ``choices[0]`` with
``message`` / ``text``, ``logprobs`` and ``finish_reason``, ``usage``), checked by parsing them
with the ``openai`` package's own models (tests/test_openai_endpoint.py).

**Errors** are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: 400 bad input
(the message names the field), 401 a missing or wrong API key (when one is set; the workflow sets
a random one per server unless ``env.openai.api_key`` is given), 404 an unknown session, 410 a
finished session, 503 the engine stopped (the episode is dropped, not failed) with
``x-should-retry: false`` so the ``openai`` client does not retry (it honours that header before
its status-code rules, ``openai/_base_client.py: _should_retry``), 500 anything unexpected (the
server keeps serving).
"""

from __future__ import annotations

import asyncio
import atexit
import hmac
import json
import logging
import re
import secrets
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the handlers' annotations by name

from conveyor.rollout.engine.types import GenerationOutput, PromptTooLongError, SamplingParams

log = logging.getLogger("conveyor.rollout.openai_server")

__all__ = ["ChatTemplate", "EndpointError", "OpenAIServer", "Session", "acquire_server", "release_server"]

SESSION_HEADER = "X-Session-Id"
"""The request header naming the session (module docstring, "Sessions")."""

_ROLES = ("system", "developer", "user", "assistant", "tool")
_CHAT_FIELDS = {
    "messages", "model", "tools", "tool_choice", "temperature", "top_p", "max_tokens", "max_completion_tokens",
    "stop", "logprobs", "top_logprobs", "n", "stream", "stream_options", "user", "seed", "parallel_tool_calls",
    "store", "metadata", "frequency_penalty", "presence_penalty", "logit_bias", "response_format", "service_tier",
}
_COMPLETION_FIELDS = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "stop", "logprobs", "n", "stream", "stream_options",
    "echo", "user", "seed", "suffix", "best_of", "frequency_penalty", "presence_penalty", "logit_bias",
}
_RUN_CONTROLLED = ("temperature", "top_p", "seed")  # sampling is the run's (module docstring)
_TOOL_CALL_SPAN = re.compile(r"<tool_call>.*?</tool_call>|<tool_call>.*\Z", re.DOTALL)
_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class EndpointError(Exception):
    """A request the endpoint answers with an error (module docstring, "Errors").

    Attributes:
        status: The HTTP status.
        message: What is wrong, for the agent's exception.
        param: The offending request field (dotted / indexed, e.g. ``messages[2]``), or None.
        code: OpenAI's machine-readable code (e.g. ``context_length_exceeded``), or None.
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        """The JSON error body."""
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                410: "invalid_request_error", 503: "service_unavailable"}.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> EndpointError:
    return EndpointError(400, message, param, code)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# --------------------------------------------------------------------------- messages


def _text_content(content: Any, where: str) -> str:
    """A message's ``content`` as text: a string, None (-> ""), or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise _bad(f"{where}.content[{j}]: only text parts are supported", f"{where}.content")
            parts.append(p["text"])
        return "".join(parts)
    raise _bad(f"{where}.content must be a string, null or a list of text parts", f"{where}.content")


def _arguments(args: Any, where: str) -> dict[str, Any]:
    if isinstance(args, dict):
        return args
    if isinstance(args, str):
        try:
            val = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise _bad(f"{where}.function.arguments is not valid JSON ({e.msg})", f"{where}.function.arguments") from e
        if isinstance(val, dict):
            return val
    raise _bad(f"{where}.function.arguments must be a JSON object (or its JSON text)", f"{where}.function.arguments")


def normalise_message(m: Any, i: int) -> dict[str, Any]:
    """One request message in the endpoint's canonical form: ``role``, ``content`` (text), and
    ``tool_calls`` (``[{"id", "name", "arguments": dict}]``), ``tool_call_id``, ``name`` when
    present. Fields the endpoint does not use (``refusal``, ``audio``, ``annotations``, None
    values) are dropped, so an assistant message dumped from the ``openai`` client compares
    equal to the dict an agent writes by hand.

    Raises:
        EndpointError: 400 for a message that is not an object, an unknown role, or content /
            tool calls that cannot be read (the message names ``messages[i]``).
    """
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(f"{where} must be an object with a role and content", where)
    role = m.get("role")
    if role not in _ROLES:
        raise _bad(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", f"{where}.role")
    out: dict[str, Any] = {"role": role, "content": _text_content(m.get("content"), where)}
    calls = m.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise _bad(f"{where}.tool_calls: only an assistant message has a list of tool calls", f"{where}.tool_calls")
        norm = []
        for j, c in enumerate(calls):
            cw = f"{where}.tool_calls[{j}]"
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise _bad(f"{cw} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", cw)
            norm.append({"id": c.get("id"), "name": fn["name"], "arguments": _arguments(fn.get("arguments"), cw)})
        out["tool_calls"] = norm
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def _calls_key(msg: dict) -> list[tuple[str, str]]:
    return [(c["name"], json.dumps(c["arguments"], sort_keys=True)) for c in msg.get("tool_calls") or ()]


def _same_message(got: dict, want: dict) -> bool:
    """Equal canonical messages (tool-call ids aside)."""
    return (got["role"] == want["role"] and got["content"] == want["content"]
            and _calls_key(got) == _calls_key(want) and got.get("tool_call_id") == want.get("tool_call_id")
            and got.get("name") == want.get("name"))


def _same_answer(got: dict, returned: dict, raw: str) -> bool:
    """``got`` repeats the assistant message the endpoint returned (module docstring)."""
    if got["role"] != "assistant":
        return False
    if got["content"].strip() == returned["content"].strip() and _calls_key(got) == _calls_key(returned):
        return True
    return not got.get("tool_calls") and got["content"].strip() == raw.strip()


def _tools_text(tools: list[dict]) -> str:
    """The Hermes tool instructions for templates without a tools branch
    (:meth:`conveyor.envs.tool_calls.ToolCallFormat.instructions`' wording)."""
    schemas = "\n".join(json.dumps(t) for t in tools)
    return ("You can call these tools (JSON schemas):\n<tools>\n" + schemas + "\n</tools>\n"
            "To call one, write <tool_call>\n{\"name\": <tool name>, \"arguments\": <arguments object>}\n"
            "</tool_call> and stop; you will then see its result. Call one tool at a time.")


def _template_messages(msgs: list[dict], *, template_tools: bool) -> list[dict]:
    """Canonical messages -> what the chat template is given (module docstring, "Tools")."""
    out = []
    for m in msgs:
        role = "system" if m["role"] == "developer" else m["role"]
        if role == "assistant" and m.get("tool_calls"):
            if template_tools:
                out.append({"role": "assistant", "content": m["content"], "tool_calls": [
                    {"type": "function", "id": c.get("id") or f"call_{j}",
                     "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for j, c in enumerate(m["tool_calls"])]})
            else:
                calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]})
                                  + "\n</tool_call>" for c in m["tool_calls"])
                out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
        elif role == "tool" and not template_tools:
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            d = {"role": role, "content": m["content"]}
            for key in ("tool_call_id", "name"):
                if key in m and role == "tool":
                    d[key] = m[key]
            out.append(d)
    return out


def _check_tools(tools: Any) -> list[dict] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be a list of function tools", "tools")
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{j}] must be {{'type': 'function', 'function': {{'name', 'description', "
                       "'parameters'}}", f"tools[{j}]")
    return tools


class ChatTemplate:
    """The tokenizer's chat template as the endpoint uses it: the first prompt of a chat session
    and the token-exact delta of new messages (module docstring, "Token exactness").

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template.

    Attributes:
        template_tools: The template renders tool schemas
            (:func:`~conveyor.envs.tool_calls.template_supports_tools`).
        special_ids: Special token ids: a turn whose last token is one ended with the model's
            end-of-turn token.

    Raises:
        ValueError: the tokenizer has no chat template.
    """

    def __init__(self, tokenizer):
        from conveyor.envs.tool_calls import template_supports_tools

        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; the OpenAI chat endpoint needs one")
        self.tokenizer = tokenizer
        self.template_tools = template_supports_tools(tokenizer)
        self.special_ids = set(getattr(tokenizer, "all_special_ids", None) or ())
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self.special_ids.add(tokenizer.eos_token_id)

    def _apply(self, msgs: list[dict], *, gen: bool, tokenize: bool, tools: list[dict] | None):
        kwargs = {"tools": tools} if tools and self.template_tools else {}
        try:
            out = self.tokenizer.apply_chat_template(msgs, tokenize=tokenize, add_generation_prompt=gen, **kwargs)
        except Exception as e:  # noqa: BLE001 - a Jinja error of the template (e.g. roles must alternate)
            raise _bad(f"the chat template cannot render these messages: {type(e).__name__}: {e}", "messages") from e
        if tokenize and (isinstance(out, dict) or hasattr(out, "input_ids")):
            out = out["input_ids"]
        return out

    def first_prompt_ids(self, msgs: list[dict], tools: list[dict] | None) -> list[int]:
        """Token ids of a session's first chat call: the canonical ``msgs`` rendered with the
        generation prompt (tools by the template, or in a system message for a template without
        a tools branch).

        Raises:
            EndpointError: 400 when the template cannot render the messages.
        """
        tm = _template_messages(msgs, template_tools=self.template_tools)
        if tools and not self.template_tools:
            text = _tools_text(tools)
            if tm and tm[0]["role"] == "system":
                tm[0] = {**tm[0], "content": (tm[0]["content"] + "\n\n" if tm[0]["content"] else "") + text}
            else:
                tm.insert(0, {"role": "system", "content": text})
        return list(self._apply(tm, gen=True, tokenize=True, tools=tools))

    def delta_ids(self, new: list[dict], tools: list[dict] | None, *, after_eos: bool) -> list[int]:
        """Token ids that continue a conversation after the model's turn with the canonical
        messages ``new`` and the next generation prompt, encoded once (module docstring).

        Args:
            new: The new messages (may be empty: then only the end of the turn and the next
                generation prompt).
            tools: The session's tools (rendered identically on both sides of the delta).
            after_eos: The model's turn ended with its end-of-turn token; False: it was cut (a
                stop string, the token limit) and the template's end-of-turn text goes first.

        Raises:
            EndpointError: 400 when the template re-renders earlier turns once a message is
                added (no token-exact delta exists) or cannot render the messages.
        """
        base = self._apply(_BASE, gen=False, tokenize=False, tools=tools)
        longer = self._apply(_BASE + _template_messages(new, template_tools=self.template_tools), gen=True,
                             tokenize=False, tools=tools)
        if not longer.startswith(base):
            raise _bad("the chat template re-renders earlier turns when messages are added: the new messages "
                       "cannot be appended token-exactly", "messages")
        tail = base[base.rindex("y") + 1:]  # the template's text after the assistant's content
        eos = self.tokenizer.eos_token or ""
        prefix = tail[tail.index(eos) + len(eos):] if after_eos and eos and eos in tail else tail
        return list(self.tokenizer.encode(prefix + longer[len(base):], add_special_tokens=False))


# --------------------------------------------------------------------------- requests


@dataclass
class _Request:
    """A parsed chat / completions request (the fields the endpoint acts on)."""

    kind: str  # "chat" | "completion"
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    tools: list[dict] | None = None
    parse_tools: bool = False
    stop_at_call: bool = False
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    ignored: dict[str, Any] = field(default_factory=dict)


def _common(body: dict, r: _Request, fields: set[str]) -> None:
    for key in body:
        if key not in fields:
            raise _bad(f"unsupported field {key!r} (supported: {', '.join(sorted(fields))})", key)
    if body.get("n", 1) not in (1, None):
        raise _bad(f"n={body['n']!r}: one choice per call (n=1); call several times instead", "n")
    if body.get("stream"):
        raise _bad("stream=true is not supported (the endpoint answers whole responses)", "stream")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise _bad(f"{key}={body[key]!r}: penalties change the sampled distribution, which the trainer "
                       "could not reproduce; leave it 0", key)
    if body.get("logit_bias"):
        raise _bad("logit_bias changes the sampled distribution, which the trainer could not reproduce", "logit_bias")
    r.ignored = {k: body[k] for k in _RUN_CONTROLLED if body.get(k) is not None}
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise _bad("stop must be a non-empty string or a list of them", "stop")
        r.stop = tuple(stop)


def _max_tokens(body: dict, keys: tuple[str, ...]) -> int | None:
    got = []
    for key in keys:
        v = body.get(key)
        if v is None:
            continue
        if not _is_int(v) or v < 1:
            raise _bad(f"{key} must be an integer >= 1, got {v!r}", key)
        got.append(v)
    return min(got) if got else None


def parse_chat(body: dict) -> _Request:
    """A ``/v1/chat/completions`` body -> its request (module docstring for what is honoured).

    Raises:
        EndpointError: 400 naming the field.
    """
    r = _Request("chat")
    _common(body, r, _CHAT_FIELDS)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages must be a non-empty list", "messages")
    r.messages = [normalise_message(m, i) for i, m in enumerate(msgs)]
    r.tools = _check_tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise _bad(f"tool_choice={choice!r}: only 'auto' and 'none' (the model cannot be forced to call a tool)",
                   "tool_choice")
    r.parse_tools = bool(r.tools) and choice != "none"
    r.stop_at_call = r.parse_tools and body.get("parallel_tool_calls") is not True
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _bad("response_format: only {'type': 'text'}", "response_format")
    if body.get("top_logprobs") not in (None, 0):
        raise _bad("top_logprobs > 0 is not supported (only the sampled tokens' log-probs: logprobs=true)",
                   "top_logprobs")
    r.logprobs = bool(body.get("logprobs"))
    r.max_tokens = _max_tokens(body, ("max_tokens", "max_completion_tokens"))
    return r


def parse_completion(body: dict) -> _Request:
    """A ``/v1/completions`` body -> its request (a string or token-id prompt).

    Raises:
        EndpointError: 400 naming the field.
    """
    r = _Request("completion")
    _common(body, r, _COMPLETION_FIELDS)
    if body.get("echo"):
        raise _bad("echo=true is not supported", "echo")
    if body.get("suffix"):
        raise _bad("suffix is not supported", "suffix")
    if body.get("best_of") not in (None, 1):
        raise _bad("best_of > 1 is not supported", "best_of")
    lp = body.get("logprobs")
    if lp is not None and (not _is_int(lp) or lp != 0):
        raise _bad(f"logprobs={lp!r}: only 0 (the sampled tokens' log-probs; no alternatives)", "logprobs")
    r.logprobs = lp is not None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt is empty", "prompt")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        prompt = list(prompt)
    else:
        raise _bad("prompt must be a non-empty string or a list of token ids (one prompt per call)", "prompt")
    r.prompt = prompt
    r.max_tokens = _max_tokens(body, ("max_tokens",))
    return r


# --------------------------------------------------------------------------- sessions


class Session:
    """One episode's calls, recorded token for token (module docstring).

    Created by :class:`~conveyor.rollout.openai_agent.OpenAIAgentWorkflow` on the episode's event
    loop and registered with an :class:`OpenAIServer`; its handlers run on that loop.

    Args:
        session_id: The id calls name.
        engine: The :class:`~conveyor.rollout.engine.Engine` of the episode.
        template: The :class:`ChatTemplate` (its tokenizer encodes completions prompts).
        params: The run's sampling parameters (``max_new_tokens``: per call at most).
        max_calls: Model calls at most (>= 1).
        max_total_tokens: Response tokens (actions and observations) at most (>= 1).
        model_name: Reported as ``model``.

    Attributes:
        out: Everything generated so far (:class:`GenerationOutput`: prompt of the first call,
            then actions and observations with masks, log-probs, versions, kept sets and request
            spans), None before the first call.
        calls: One summary per answered call (``kind``, ``prompt_tokens``,
            ``completion_tokens``, ``finish_reason``, ``observation_tokens``).
        turns: Model calls answered with generated tokens.
        tool_turns / tool_turns_ok: Turns that wrote a ``<tool_call>`` / whose calls were all
            well-formed and returned as ``tool_calls``.
        cut: A limit ended the episode (module docstring, "Limits").
        aborted: The engine stopped during a call.
        refused: The first refused call's message (the episode fails with it), or None.
        prompt_too_long: The first call's prompt filled the context (the sample is skipped).
        sampling_ignored: Run-controlled fields a request set to a value other than the run's.
        loop: The event loop the handlers run on.
    """

    def __init__(self, session_id: str, engine, template: ChatTemplate, params: SamplingParams, *,
                 max_calls: int = 4, max_total_tokens: int = 512, model_name: str = "conveyor"):
        if max_calls < 1 or max_total_tokens < 1:
            raise ValueError(f"Session: max_calls and max_total_tokens must be >= 1, got {max_calls}, {max_total_tokens}")
        self.session_id, self.engine, self.template, self.params = session_id, engine, template, params
        self.tokenizer = template.tokenizer
        self.max_calls, self.max_total_tokens, self.model_name = max_calls, max_total_tokens, model_name
        self.loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        self.kind: str | None = None
        self.out: GenerationOutput | None = None
        self.calls: list[dict[str, Any]] = []
        self.turns = self.tool_turns = self.tool_turns_ok = 0
        self.cut = self.aborted = self.closed = False
        self.refused: str | None = None
        self.prompt_too_long: PromptTooLongError | None = None
        self.sampling_ignored: dict[str, Any] = {}
        self._conversation: list[dict] = []  # chat: the messages so far + the last answer
        self._raw_last = ""
        self._tools_key: str | None = None
        self._text: str | None = None  # completions: the string prompt so far + what was returned
        self._ended_eos = True

    # ---- entry points (run on self.loop)

    async def handle(self, kind: str, body: dict) -> dict[str, Any]:
        """Answer one request (``kind``: ``"chat"`` or ``"completion"``) of this session.

        Returns:
            The OpenAI response body.

        Raises:
            EndpointError: see the module docstring ("Errors").
        """
        req = parse_chat(body) if kind == "chat" else parse_completion(body)
        async with self._lock:
            if self.closed:
                raise EndpointError(410, f"session {self.session_id!r} has ended (its episode is over)")
            if self.aborted:
                raise EndpointError(503, "the engine stopped; this episode was aborted")
            for k, v in req.ignored.items():
                run_value = getattr(self.params, k, None)
                if v != run_value:
                    self.sampling_ignored[k] = v
            try:
                return await (self._chat(req) if kind == "chat" else self._completion(req))
            except EndpointError as e:
                if e.status == 400 and e.code == "history_mismatch" and self.refused is None:
                    self.refused = e.message
                raise

    async def aclose(self) -> None:
        """Refuse further calls (410) once the call in flight, if any, is answered; called on the
        session's loop when the agent is done."""
        async with self._lock:
            self.closed = True

    # ---- chat

    def _refuse(self, message: str, param: str | None = None) -> EndpointError:
        return _bad(message + " (conveyor builds this episode's trajectory token for token from its calls: each "
                    "call must send the previous call's messages unchanged, then the assistant message it got "
                    "back, then new messages; see conveyor.rollout.openai_server)", param, "history_mismatch")

    def _check_extends(self, msgs: list[dict]) -> None:
        conv = self._conversation
        if len(msgs) < len(conv):
            raise self._refuse(f"the call has {len(msgs)} messages, fewer than the {len(conv)} of the conversation so "
                               "far", "messages")
        for i, want in enumerate(conv):
            got = msgs[i]
            ok = _same_answer(got, want, self._raw_last) if i == len(conv) - 1 else _same_message(got, want)
            if not ok:
                what = "the assistant message returned by the previous call" if i == len(conv) - 1 else \
                    f"messages[{i}] of the previous call"
                raise self._refuse(f"messages[{i}] ({got['role']}) differs from {what}", f"messages[{i}]")

    async def _chat(self, req: _Request) -> dict[str, Any]:
        if self.kind not in (None, "chat"):
            raise self._refuse("a chat call in a completions session", "messages")
        tools_key = json.dumps(req.tools, sort_keys=True) if req.tools else None
        first = self.out is None and not self.cut
        if first:
            prompt, delta = self.template.first_prompt_ids(req.messages, req.tools), None
        else:
            prompt = None
            if self.cut:
                delta = []
            else:
                if tools_key != self._tools_key:
                    raise self._refuse("tools differ from the session's first call (its prompt already holds them)",
                                       "tools")
                self._check_extends(req.messages)
                delta = self.template.delta_ids(req.messages[len(self._conversation):], req.tools,
                                                after_eos=self._ended_eos)
        stops = req.stop + (("</tool_call>",) if req.stop_at_call else ())
        seg, n_prompt = await self._generate("chat", prompt, delta, req.max_tokens, stops)
        self.kind = "chat"
        if first:
            self._tools_key = tools_key
        if seg is None:
            return _chat_response(self, content="", tool_calls=None, finish="length", n_prompt=n_prompt, seg=None,
                                  logprobs=req.logprobs)
        text = _cut_at_stop(self.tokenizer.decode(seg.token_ids, skip_special_tokens=True), req.stop, seg)
        content: str | None = text
        tool_calls = None
        finish = seg.finish_reason
        if req.parse_tools:
            from conveyor.envs.tool_calls import parse_hermes_calls

            calls = parse_hermes_calls(text)
            if calls:
                self.tool_turns += 1
                if all(c.ok for c in calls):
                    self.tool_turns_ok += 1
                    tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                   "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                                  for c in calls]
                    content = _TOOL_CALL_SPAN.sub("", text).strip() or None
                    finish = "tool_calls"
        returned = {"role": "assistant", "content": content or "",
                    "tool_calls": [{"id": c["id"], "name": c["function"]["name"],
                                    "arguments": json.loads(c["function"]["arguments"])} for c in tool_calls or ()]}
        self._conversation = [*req.messages, returned]
        self._raw_last = text
        return _chat_response(self, content=content, tool_calls=tool_calls, finish=finish, n_prompt=n_prompt, seg=seg,
                              logprobs=req.logprobs)

    # ---- completions

    async def _completion(self, req: _Request) -> dict[str, Any]:
        if self.kind not in (None, "completion"):
            raise self._refuse("a completions call in a chat session", "prompt")
        is_text = isinstance(req.prompt, str)
        prompt, delta = None, None
        if self.cut:
            delta = []
        elif self.out is None:
            prompt = list(self.tokenizer.encode(req.prompt)) if is_text else list(req.prompt)
        else:
            so_far = self.out.prompt_ids + self.out.token_ids
            if not is_text:
                if req.prompt[:len(so_far)] != so_far:
                    raise self._refuse(f"the token-id prompt does not start with the session's {len(so_far)} tokens so "
                                       "far", "prompt")
                delta = req.prompt[len(so_far):]
            else:
                if self._text is None or not req.prompt.startswith(self._text):
                    raise self._refuse("the prompt does not start with the previous prompt followed by the text "
                                       "returned for it", "prompt")
                rest = req.prompt[len(self._text):]
                delta = list(self.tokenizer.encode(rest, add_special_tokens=False)) if rest else []
        seg, n_prompt = await self._generate("completion", prompt, delta, req.max_tokens, req.stop)
        self.kind = "completion"
        text = "" if seg is None else _cut_at_stop(self.tokenizer.decode(seg.token_ids, skip_special_tokens=True),
                                                    req.stop, seg)
        if seg is not None:
            self._text = req.prompt + text if is_text else None
        finish = "length" if seg is None else seg.finish_reason
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        if req.logprobs:
            toks = [] if seg is None else [self.tokenizer.decode([t]) for t in seg.token_ids]
            offsets, pos = [], 0
            for t in toks:
                offsets.append(pos)
                pos += len(t)
            choice["logprobs"] = {"tokens": toks, "token_logprobs": [] if seg is None else list(seg.logprobs),
                                  "top_logprobs": None, "text_offset": offsets}
        n_out = 0 if seg is None else len(seg.token_ids)
        return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}}

    # ---- generation

    async def _generate(self, kind: str, prompt: list[int] | None, delta: list[int] | None,
                        max_tokens: int | None, stop: tuple[str, ...]) -> tuple[GenerationOutput | None, int]:
        """One model turn: the first prompt, or the session so far + ``delta`` (observation
        tokens). Returns ``(segment, prompt tokens)``; the segment is None when a limit cut the
        session (nothing appended)."""
        if self.cut or self.turns >= self.max_calls:
            self.cut = True
            return None, 0
        if self.out is None:
            base = GenerationOutput(prompt_ids=list(prompt), action_mask=[])
        else:
            base = self.out
            if delta:
                if len(base.token_ids) + len(delta) >= self.max_total_tokens:
                    self.cut = True  # the new messages do not fit (with at least one token to generate)
                    return None, 0
                base = base.observe(delta, base.versions[-1] if base.versions else self.engine.version)
        budget = self.max_total_tokens - len(base.token_ids)
        if budget <= 0:
            self.cut = True
            return None, 0
        cap = min(self.params.max_new_tokens, budget, max_tokens or self.params.max_new_tokens)
        params = replace(self.params, max_new_tokens=cap, stop=tuple(self.params.stop) + tuple(stop))
        ids = base.prompt_ids + base.token_ids
        try:
            seg = await self.engine.generate(ids, params)
        except PromptTooLongError as e:
            if self.out is None:
                self.prompt_too_long = e
                raise _bad(f"the prompt fills the model's context: {e}", "messages", "context_length_exceeded") from e
            self.cut = True
            return None, 0
        if seg.finish_reason == "abort":
            self.aborted = True
            raise EndpointError(503, "the engine stopped; this episode was aborted")
        self.out = base.extend(seg)
        self.turns += 1
        self._ended_eos = seg.finish_reason == "stop" and bool(seg.token_ids) and \
            seg.token_ids[-1] in self.template.special_ids
        self.calls.append({"kind": kind, "prompt_tokens": len(ids), "completion_tokens": len(seg.token_ids),
                           "observation_tokens": len(delta or ()), "finish_reason": seg.finish_reason})
        return seg, len(ids)


def _cut_at_stop(text: str, stop: tuple[str, ...], seg: GenerationOutput) -> str:
    """OpenAI returns the text before the stop string that ended the turn."""
    if seg.finish_reason != "stop" or not stop:
        return text
    hits = [text.find(s) for s in stop if s in text]
    return text[:min(hits)] if hits else text


def _chat_response(session: Session, *, content, tool_calls, finish: str, n_prompt: int,
                   seg: GenerationOutput | None, logprobs: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    lp = None
    if logprobs:
        entries = []
        for t, v in zip(seg.token_ids if seg else (), seg.logprobs if seg else (), strict=True):
            s = session.tokenizer.decode([t])
            entries.append({"token": s, "logprob": v, "bytes": list(s.encode("utf-8")), "top_logprobs": []})
        lp = {"content": entries, "refusal": None}
    n_out = 0 if seg is None else len(seg.token_ids)
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": session.model_name,
            "choices": [{"index": 0, "message": message, "logprobs": lp, "finish_reason": finish}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}}


# --------------------------------------------------------------------------- HTTP


def resolve_session_id(path_id: str | None, header_id: str | None, body: dict) -> str:
    """The session a request names (module docstring, "Sessions").

    Raises:
        EndpointError: 400 when path and header disagree or nothing names a session.
    """
    if path_id and header_id and path_id != header_id:
        raise _bad(f"the URL names session {path_id!r} and the {SESSION_HEADER} header {header_id!r}", SESSION_HEADER)
    sid = path_id or header_id or body.get("user")
    if not isinstance(sid, str) or not sid:
        raise _bad(f"no session: use the base_url the agent was given (/sessions/<id>/v1), the {SESSION_HEADER} "
                   "header, or the user field", "user")
    return sid


def build_app(server: OpenAIServer):
    """The FastAPI application of ``server`` (module docstring). Routes: ``POST
    [/sessions/{id}]/v1/chat/completions``, ``POST [/sessions/{id}]/v1/completions``, ``GET
    [/sessions/{id}]/v1/models``, ``GET /health``."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    class _JSON(JSONResponse):  # a -inf log-prob is not a 500
        def render(self, content: Any) -> bytes:
            return json.dumps(content, separators=(",", ":")).encode("utf-8")

    app = FastAPI(title="conveyor OpenAI-compatible endpoint", docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=_JSON)

    def error(e: EndpointError) -> _JSON:
        headers = {"x-should-retry": "false"} if e.status >= 500 else None
        return _JSON(e.body(), status_code=e.status, headers=headers)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        key = server.api_key
        if key is not None and request.url.path != "/health":
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {key}".encode()):
                return error(EndpointError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')"))
        try:
            return await call_next(request)
        except Exception as e:  # never let one request take the server down
            log.exception("request %s %s failed", request.method, request.url.path)
            return error(EndpointError(500, f"{type(e).__name__}: {e}"))

    async def dispatch(request: Request, kind: str, path_id: str | None):
        try:
            body = await request.json()
        except ValueError:
            return error(_bad("the body is not valid JSON"))
        if not isinstance(body, dict):
            return error(_bad("the body must be a JSON object"))
        try:
            sid = resolve_session_id(path_id, request.headers.get(SESSION_HEADER), body)
            session = server.session(sid)
            if session is None:
                raise EndpointError(404, f"unknown session {sid!r} (not started here, or its episode is over)",
                                    "user")
            try:
                fut = asyncio.run_coroutine_threadsafe(session.handle(kind, body), session.loop)
            except RuntimeError as e:  # the episode's loop is closed
                raise EndpointError(410, f"session {sid!r} has ended") from e
            return _JSON(await asyncio.wrap_future(fut))
        except EndpointError as e:
            return error(e)

    def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "conveyor"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await dispatch(request, "chat", None)

    @app.post("/sessions/{sid}/v1/chat/completions")
    async def chat_in(sid: str, request: Request):
        return await dispatch(request, "chat", sid)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await dispatch(request, "completion", None)

    @app.post("/sessions/{sid}/v1/completions")
    async def completions_in(sid: str, request: Request):
        return await dispatch(request, "completion", sid)

    app.get("/v1/models")(models)
    app.get("/sessions/{sid}/v1/models")(lambda sid: models())
    return app


class OpenAIServer:
    """The endpoint's HTTP server: uvicorn in a daemon thread, sessions by id.

    Args:
        host: The address to bind (default ``127.0.0.1``: only this machine can connect).
        port: The port; 0 (default) takes a free ephemeral one (:attr:`port` says which).
        api_key: Required as ``Authorization: Bearer <key>`` on every request but ``/health``;
            None: no key.
        model_name: Reported as ``model`` and by ``/v1/models`` (requests may name any model).

    The server starts with :meth:`start` (idempotent) and stops with :meth:`close` (joins the
    thread and closes the listening socket; also run at interpreter exit). Use
    :func:`acquire_server` to share one per process.

    Raises:
        ValueError: a port outside ``0..65535``.
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 model_name: str = "conveyor"):
        if not _is_int(port) or not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port!r}")
        self.host, self.api_key, self.model_name = host, api_key, model_name
        self._want_port = port
        self.port: int | None = None
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._server = None
        self._sock: socket.socket | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` (after :meth:`start`)."""
        if self.port is None:
            raise RuntimeError("OpenAIServer: not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        """The server thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout_s: float = 30.0) -> None:
        """Bind the socket and start serving (no-op when running).

        Raises:
            OSError: the address cannot be bound (e.g. the port is taken).
            RuntimeError: uvicorn did not start within ``timeout_s``.
        """
        with self._lock:
            if self.running:
                return
            import uvicorn

            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((self.host, self._want_port))
            except OSError:
                sock.close()
                raise
            self._sock, self.port = sock, sock.getsockname()[1]
            config = uvicorn.Config(build_app(self), log_level="warning", lifespan="off", access_log=False,
                                    log_config=None, timeout_graceful_shutdown=2)
            self._server = uvicorn.Server(config)
            self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                            name=f"conveyor-openai-endpoint:{self.port}", daemon=True)
            self._thread.start()
            deadline = time.monotonic() + timeout_s
            while not self._server.started:
                if not self._thread.is_alive() or time.monotonic() > deadline:
                    self._stop_locked()
                    raise RuntimeError(f"the OpenAI endpoint on {self.host} did not start")
                time.sleep(0.005)
            atexit.register(self.close)
            log.info("OpenAI-compatible endpoint on %s", self.url)

    def open_session(self, session: Session) -> None:
        """Make ``session`` reachable by its id.

        Raises:
            ValueError: a session with that id is open.
        """
        with self._lock:
            if session.session_id in self._sessions:
                raise ValueError(f"session {session.session_id!r} is already open")
            self._sessions[session.session_id] = session

    def close_session(self, session_id: str) -> None:
        """Forget a session (later calls naming it get a 404)."""
        with self._lock:
            self._sessions.pop(session_id, None)

    def session(self, session_id: str) -> Session | None:
        """The open session of that id, or None."""
        with self._lock:
            return self._sessions.get(session_id)

    def close(self) -> None:
        """Stop serving: the thread is joined and the listening socket closed (idempotent)."""
        with self._lock:
            self._stop_locked()
        atexit.unregister(self.close)

    def _stop_locked(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            if self._thread.is_alive():  # a connection that would not close: force it
                self._server.force_exit = True
                self._thread.join(timeout=5)
            if self._thread.is_alive():
                log.warning("the OpenAI endpoint thread did not stop within 15 s")
        if self._sock is not None:
            self._sock.close()
        self._thread, self._server, self._sock = None, None, None

    def __enter__(self) -> OpenAIServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_shared: dict[tuple[str, int, str | None, str], list] = {}  # key -> [server, users]
_shared_lock = threading.Lock()


def acquire_server(*, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                   model_name: str = "conveyor") -> OpenAIServer:
    """A started :class:`OpenAIServer` shared by every caller in this process with the same
    settings (a run's rollout and its held-out evaluations use one, which a fixed ``port``
    requires); ``api_key`` None gives the shared server a random key (``secrets``). Pair each
    call with :func:`release_server`; the last release closes it.

    Raises:
        OSError / RuntimeError: as :meth:`OpenAIServer.start`.
    """
    key = (host, port, api_key, model_name)
    with _shared_lock:
        entry = _shared.get(key)
        if entry is None or not entry[0].running:
            server = OpenAIServer(host=host, port=port, api_key=api_key or secrets.token_urlsafe(24),
                                  model_name=model_name)
            server.start()
            entry = _shared[key] = [server, 0]
        entry[1] += 1
        return entry[0]


def release_server(server: OpenAIServer) -> None:
    """Give back a server from :func:`acquire_server`; the last user closes it."""
    with _shared_lock:
        for key, entry in list(_shared.items()):
            if entry[0] is server:
                entry[1] -= 1
                if entry[1] <= 0:
                    del _shared[key]
                    server.close()
                return
    server.close()  # not shared (or already dropped)

