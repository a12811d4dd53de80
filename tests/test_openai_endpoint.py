"""The OpenAI-compatible endpoint for agent code (issue 14 section 4; ``rollout/openai_server.py``,
``rollout/openai_agent.py``, ``examples/openai_agent/``): the ``openai`` client over real HTTP on
127.0.0.1 against the tiny model's engine (or a scripted engine where the test needs exact model
output, e.g. a tool call), token-exact trajectories, session separation, refusals and limits,
shutdown, and ``conveyor train`` / ``conveyor eval`` with the example agent."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from conveyor.models import load_model
from conveyor.rollout.engine import GenerationOutput, InferenceEngine, SamplingParams
from conveyor.rollout.engine.types import PromptTooLongError
from conveyor.rollout.openai_agent import AgentResult, OpenAIAgentWorkflow, OpenAISessionError
from conveyor.rollout.openai_server import OpenAIServer, acquire_server, release_server
from conveyor.types import Sample

openai = pytest.importorskip("openai", reason="pip install -e '.[openai]' (the openai client)")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "openai_agent"
THREAD = "conveyor-openai-endpoint"
CHATML_USER = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny", seed=0)


@pytest.fixture(scope="module")
def engine(lm):
    eng = InferenceEngine(lm.model, lm.tokenizer, max_batch_size=4, num_threads=1, seed=0)
    eng.start()
    yield eng
    eng.stop()


class Recording:
    """An engine that passes every call to ``inner`` and keeps ``(prompt_ids, params, output)``."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    @property
    def version(self):
        return self.inner.version

    async def generate(self, prompt_ids, params):
        out = await self.inner.generate(prompt_ids, params)
        self.calls.append((list(prompt_ids), params, out))
        return out


class Scripted:
    """An engine answering with scripted texts (token ids of ``tok.encode``, or a list of ids),
    log-prob -0.5 per token, version 3; ``finish`` per answer; ``"abort"`` / ``"too_long"``
    entries misbehave."""

    version = 3

    def __init__(self, tok, answers):
        self.tok, self.answers, self.calls = tok, list(answers), []

    async def generate(self, prompt_ids, params):
        text, finish = self.answers.pop(0)
        self.calls.append((list(prompt_ids), params))
        if finish == "too_long":
            raise PromptTooLongError("prompt of 9999 tokens >= context 2048")
        if isinstance(text, list):  # token ids as sampled
            ids, text = text, self.tok.decode(text, skip_special_tokens=True)
        else:
            ids = [] if finish == "abort" else list(self.tok.encode(text, add_special_tokens=False))
        return GenerationOutput(prompt_ids=list(prompt_ids), token_ids=ids, logprobs=[-0.5] * len(ids),
                                versions=[3] * len(ids), finish_reason=finish, text=text,
                                key=f"scripted:{len(self.calls)}")


class FakeGrader:
    """A reward service stub: 1.0 when the answer contains the reference."""

    metric_names = ("correct", "format_ok")

    def _r(self, text, sample):
        ok = float(sample.answer in text)
        return SimpleNamespace(score=ok, failed=False, error=None, metrics={"correct": ok, "format_ok": 1.0})

    async def score(self, text, sample):
        return self._r(text, sample)

    def score_sync(self, text, sample):
        return self._r(text, sample)


def sample(q="What is 2 + 3?", a="5", i=0):
    return Sample(f"t/{i}", q, a, "t")


def episode(wf, eng, *samples):
    """Run one episode per sample concurrently; the list of their results."""
    async def go():
        return await asyncio.gather(*[wf.run_episode(eng, s) for s in samples])
    try:
        return asyncio.run(go())
    finally:
        wf.close()


def endpoint_threads():
    return [t for t in threading.enumerate() if t.name.startswith(THREAD)]


# --------------------------------------------------------------------------- the openai client


def test_openai_client_chat_and_completions(lm, engine):
    rec = Recording(engine)
    seen = {}

    async def agent(run):
        async with openai.AsyncOpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0) as c:
            assert [m.id for m in (await c.models.list()).data] == [run.model]
            if run.sample.id == "t/0":  # chat
                r = await c.chat.completions.create(model="anything", messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=4, logprobs=True)
                seen["chat"] = r
                return 0.5
            r1 = await c.completions.create(model=run.model, prompt="Q: 2 + 3 =", max_tokens=3, logprobs=0)
            r2 = await c.completions.create(model=run.model, prompt="Q: 2 + 3 =" + r1.choices[0].text + "\nQ: 1 + 1 =",
                                            max_tokens=3)
            seen["completions"] = (r1, r2)
            return {"reward": 1.0, "correct": True}

    wf = OpenAIAgentWorkflow(lm.tokenizer, agent, SamplingParams(max_new_tokens=8, temperature=1.0))
    [chat_t], [comp_t] = episode(wf, rec, sample(i=0), sample(i=1))
    r = seen["chat"]
    assert isinstance(r, openai.types.chat.ChatCompletion) and r.object == "chat.completion"
    ch = r.choices[0]
    assert ch.message.role == "assistant" and isinstance(ch.message.content, str) and ch.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == len(ch.logprobs.content) >= 1 and r.usage.prompt_tokens == len(chat_t.prompt_ids)
    assert [e.logprob for e in ch.logprobs.content] == chat_t.behaviour_logprobs  # the engine's, as recorded
    assert chat_t.reward == 0.5 and chat_t.correct is None and chat_t.metadata["turns"] == 1
    r1, r2 = seen["completions"]
    assert r1.object == "text_completion" and r1.choices[0].logprobs.token_logprobs == comp_t.behaviour_logprobs[:3]
    # completions: prompt encoded once, then gen 1, the new text encoded alone, gen 2
    (p1, _, o1), (p2, _, o2) = [c for c in rec.calls if c[0][:3] == comp_t.prompt_ids[:3]]
    assert comp_t.prompt_ids == p1 == list(lm.tokenizer.encode("Q: 2 + 3 ="))
    new = list(lm.tokenizer.encode("\nQ: 1 + 1 =", add_special_tokens=False))
    assert p2 == p1 + o1.token_ids + new
    assert comp_t.response_ids == o1.token_ids + new + o2.token_ids
    assert comp_t.action_mask == [1] * len(o1.token_ids) + [0] * len(new) + [1] * len(o2.token_ids)
    assert comp_t.reward == 1.0 and comp_t.correct is True


# --------------------------------------------------------------------------- token exactness


def test_two_call_episode_is_token_exact(lm, engine):
    """The trajectory is the engine's outputs with the new message's tokens between them, exactly;
    a re-tokenisation of the conversation (what re-rendering agents train on) differs."""
    tok, rec = lm.tokenizer, Recording(engine)
    texts = {}

    async def agent(run):
        c = openai.AsyncOpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0)
        msgs = [{"role": "user", "content": run.sample.question}]
        r = await c.chat.completions.create(model=run.model, messages=msgs, max_tokens=16)
        msgs += [r.choices[0].message, {"role": "user", "content": "Now double it."}]  # the pydantic message itself
        r2 = await c.chat.completions.create(model=run.model, messages=msgs, max_tokens=16)
        texts["turns"] = [r.choices[0].message.content, r2.choices[0].message.content]
        await c.close()
        return 1.0

    wf = OpenAIAgentWorkflow(tok, agent, SamplingParams(max_new_tokens=16, temperature=1.0), max_total_tokens=200)
    [[t]] = episode(wf, rec, sample())
    (p1, _, o1), (p2, _, o2) = rec.calls
    P, R1 = len(p1), len(o1.token_ids)
    assert t.prompt_ids == p1 == list(tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                                               add_generation_prompt=True, tokenize=True)["input_ids"])
    assert p2[:P + R1] == p1 + o1.token_ids  # the second call continued from the sampled tokens
    obs = p2[P + R1:]
    ended = o1.finish_reason == "stop" and o1.token_ids[-1] == tok.eos_token_id
    expected = ("" if ended else "<|im_end|>") + "\n" + CHATML_USER.format("Now double it.")
    assert obs == list(tok.encode(expected, add_special_tokens=False))  # encoded once, from ChatML's own text
    assert t.response_ids == o1.token_ids + obs + o2.token_ids
    assert t.action_mask == [1] * R1 + [0] * len(obs) + [1] * len(o2.token_ids)
    assert t.behaviour_logprobs == o1.logprobs + [0.0] * len(obs) + o2.logprobs
    assert t.versions == o1.versions + [o1.versions[-1]] * len(obs) + o2.versions
    assert t.metadata["request_spans"] == [[o1.key, 0, R1], [o2.key, R1 + len(obs), len(o2.token_ids)]]
    assert texts["turns"] == [tok.decode(o.token_ids, skip_special_tokens=True) for o in (o1, o2)]


def test_sampled_tokens_that_retokenise_differently_are_kept(lm):
    """The model sampled "Ans" + "wer" (two tokens) where encoding the text gives one token: the
    next call continues from the sampled ids and the trajectory trains on them, while rendering
    the conversation from its text (what re-rendering agents train on) would change them."""
    tok = lm.tokenizer
    sampled = list(tok.encode("Ans", add_special_tokens=False)) + list(tok.encode("wer: 5<|im_end|>",
                                                                                  add_special_tokens=False))
    assert list(tok.encode("Answer: 5<|im_end|>", add_special_tokens=False)) != sampled
    eng = Scripted(tok, [(sampled, "stop"), ("Ten.<|im_end|>", "stop")])

    async def agent(run):
        async with openai.AsyncOpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0) as c:
            msgs = [{"role": "user", "content": "2 + 3?"}]
            r = await c.chat.completions.create(model=run.model, messages=msgs)
            msgs += [r.choices[0].message, {"role": "user", "content": "Double it."}]
            await c.chat.completions.create(model=run.model, messages=msgs)
        return 1.0

    wf = OpenAIAgentWorkflow(tok, agent, SamplingParams(max_new_tokens=16))
    [[t]] = episode(wf, eng, sample())
    (p1, _), (p2, _) = eng.calls
    obs = list(tok.encode("\n" + CHATML_USER.format("Double it."), add_special_tokens=False))
    assert p2 == p1 + sampled + obs and t.response_ids[:len(sampled) + len(obs)] == sampled + obs
    msgs = [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "Answer: 5"},
            {"role": "user", "content": "Double it."}]
    retok = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert retok != p2 and tok.decode(retok) == tok.decode(p2)  # same text, other tokens


def test_tool_calls_in_openai_format_and_the_tool_result_appended_once(lm):
    """The example agent against a scripted model: a Hermes tool call comes back as OpenAI
    tool_calls, the calculator's result goes back as a tool message, which is appended as
    observation tokens (a user <tool_response> for SmolLM2's template without tools)."""
    import sys

    sys.path.insert(0, str(EXAMPLE))
    try:
        import mawps_agent
    finally:
        sys.path.remove(str(EXAMPLE))
    tok = lm.tokenizer
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    eng = Scripted(tok, [("Let me compute.\n" + call, "stop"), ("Answer: 5<|im_end|>", "stop")])
    wf = OpenAIAgentWorkflow(tok, mawps_agent.solve, SamplingParams(max_new_tokens=64, temperature=1.0),
                             reward_service=FakeGrader(), instruction="Give the final answer after 'Answer:'.")
    [[t]] = episode(wf, eng, sample())
    (p1, params1), (p2, _) = eng.calls
    first = tok.decode(p1)
    assert "<tools>" in first and '"calculator"' in first and "named SmolLM" not in first  # tools in a system message
    assert params1.stop == ("</tool_call>",) and params1.temperature == 1.0
    a1 = list(tok.encode("Let me compute.\n" + call, add_special_tokens=False))
    obs = list(tok.encode("<|im_end|>\n" + CHATML_USER.format("<tool_response>\n5\n</tool_response>"),
                          add_special_tokens=False))  # the turn ended at the stop string: end-of-turn text first
    assert p2 == p1 + a1 + obs
    a2 = list(tok.encode("Answer: 5<|im_end|>", add_special_tokens=False))
    assert t.response_ids == a1 + obs + a2 and t.action_mask == [1] * len(a1) + [0] * len(obs) + [1] * len(a2)
    assert t.reward == 1.0 and t.correct is True and t.versions == [3] * len(t.response_ids)
    assert t.metadata["env_stats"] == {"tool_calls": 1, "tool_calls_ok": 1} and t.metadata["turns"] == 2


def test_the_endpoint_answers_tool_calls_in_openai_shape(lm):
    tok = lm.tokenizer
    eng = Scripted(tok, [('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"7*6\\"}"}</tool_call>',
                          "stop"), ("<tool_call>{oops</tool_call>", "stop")])
    got = []
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]

    def agent(run):  # synchronous: runs in a worker thread, session by header
        with openai.OpenAI(base_url=run.server_url, api_key=run.api_key, default_headers=run.headers,
                           max_retries=0) as c:
            msgs = [{"role": "user", "content": "6 times 7?"}]
            r = c.chat.completions.create(model=run.model, messages=msgs, tools=tools, temperature=0.1, top_p=0.5)
            got.append(r)
            msgs += [r.choices[0].message.model_dump(), {"role": "tool", "tool_call_id": "x", "content": "42"}]
            got.append(c.chat.completions.create(model=run.model, messages=msgs, tools=tools))
        return AgentResult(0.0, stats={"tool_calls_ok": 1})

    wf = OpenAIAgentWorkflow(tok, agent, SamplingParams(max_new_tokens=64, temperature=1.0))
    [[t]] = episode(wf, eng, sample())
    ch = got[0].choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (tc,) = ch.message.tool_calls
    assert tc.type == "function" and tc.id.startswith("call_") and tc.function.name == "calculator"
    assert json.loads(tc.function.arguments) == {"expression": "7*6"}
    bad = got[1].choices[0]  # a malformed call stays text
    assert bad.message.tool_calls is None and bad.message.content == "<tool_call>{oops</tool_call>"
    assert t.metadata["env_stats"] == {"tool_calls": 2, "tool_calls_ok": 1}  # the agent's own count overrides
    assert t.metadata["sampling_ignored"] == {"temperature": 0.1, "top_p": 0.5}


def test_a_template_with_tools_renders_them_and_the_tool_message(lm):
    """A Qwen-like template (tools branch, tool results as <tool_response> user turns): the
    schemas are the template's, and the conversation continues exactly as the template renders
    it."""
    import copy

    from test_tool_calls import QWEN_LIKE

    tok = copy.deepcopy(lm.tokenizer)
    tok.chat_template = QWEN_LIKE
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    eng = Scripted(tok, [(call, "stop"), ("42<|im_end|>", "stop")])
    tools = [{"type": "function", "function": {"name": "calculator", "description": "math",
                                                "parameters": {"type": "object"}}}]

    async def agent(run):
        async with openai.AsyncOpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0) as c:
            msgs = [{"role": "user", "content": "6 x 7?"}]
            r = await c.chat.completions.create(model=run.model, messages=msgs, tools=tools)
            (tc,) = r.choices[0].message.tool_calls
            msgs += [r.choices[0].message, {"role": "tool", "tool_call_id": tc.id, "content": "42"}]
            await c.chat.completions.create(model=run.model, messages=msgs, tools=tools)
        return 1.0

    wf = OpenAIAgentWorkflow(tok, agent, SamplingParams(max_new_tokens=64))
    [[t]] = episode(wf, eng, sample())
    (p1, _), (p2, _) = eng.calls
    assert "# Tools" in tok.decode(p1) and "You can call these tools" not in tok.decode(p1)
    msgs = [{"role": "user", "content": "6 x 7?"}, {"role": "assistant", "content": call},
            {"role": "tool", "content": "42"}]
    assert tok.decode(p2) == tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert p2[:len(p1) + len(tok.encode(call, add_special_tokens=False))] == p1 + tok.encode(call, add_special_tokens=False)


# --------------------------------------------------------------------------- sessions


def test_concurrent_sessions_do_not_mix(lm, engine):
    """Two episodes interleave their calls (both first calls before either second call), naming
    their sessions by URL and by the user field: each trajectory holds only its own calls."""
    tok, rec = lm.tokenizer, Recording(engine)
    barrier = asyncio.Barrier(2)

    async def agent(run, by):
        kw = dict(base_url=run.base_url) if by == "path" else dict(base_url=run.server_url)
        extra = {} if by == "path" else {"user": run.session_id}
        async with openai.AsyncOpenAI(api_key=run.api_key, max_retries=0, **kw) as c:
            msgs = [{"role": "user", "content": run.sample.question}]
            r = await c.chat.completions.create(model=run.model, messages=msgs, max_tokens=6, **extra)
            await barrier.wait()
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
            await c.chat.completions.create(model=run.model, messages=msgs, max_tokens=6, **extra)
        return 1.0

    wfs = [OpenAIAgentWorkflow(tok, agent, SamplingParams(max_new_tokens=6, temperature=1.0), options={"by": by})
           for by in ("path", "user")]

    async def go():
        return await asyncio.gather(wfs[0].run_episode(rec, sample("Apples: 4 + 4?", "8", 0)),
                                    wfs[1].run_episode(rec, sample("Pears: 9 - 2?", "7", 1)))
    try:
        [[ta], [tb]] = asyncio.run(go())
    finally:
        for wf in wfs:
            wf.close()
    assert len(rec.calls) == 4
    for t, own, other in ((ta, "Apples", "Pears"), (tb, "Pears", "Apples")):
        text = tok.decode(t.prompt_ids + t.response_ids)
        assert own in text and other not in text
        mine = [c for c in rec.calls if c[0][:len(t.prompt_ids)] == t.prompt_ids]
        assert len(mine) == 2
        (p1, _, o1), (p2, _, o2) = mine
        assert p1 + t.response_ids == p2 + o2.token_ids and t.response_ids[:len(o1.token_ids)] == o1.token_ids
    assert ta.metadata["session_id"] != tb.metadata["session_id"]


def test_requests_naming_no_or_a_wrong_session_or_no_key_are_refused():
    server = acquire_server(api_key="k")
    try:
        url, auth = server.url, {"Authorization": "Bearer k"}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert r.status_code == 401
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "user"
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "user": "nope"}, headers=auth)
        assert r.status_code == 404 and "unknown session" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/sessions/a/v1/chat/completions", json=body, headers={**auth, "X-Session-Id": "b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Session-Id"
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        release_server(server)


def test_bad_fields_are_400_naming_the_field(lm):
    eng = Scripted(lm.tokenizer, [("ok<|im_end|>", "stop")])
    errors = []

    async def agent(run):
        async with openai.AsyncOpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0) as c:
            msgs = [{"role": "user", "content": "hi"}]
            for kw in ({"n": 2}, {"tool_choice": "required"}, {"frequency_penalty": 0.5}, {"top_logprobs": 3},
                       {"extra_body": {"guided_json": {}}}):
                with pytest.raises(openai.BadRequestError) as ei:
                    await c.chat.completions.create(model=run.model, messages=msgs, **kw)
                errors.append(ei.value.body["param"])
            await c.chat.completions.create(model=run.model, messages=msgs)
        return 1.0

    wf = OpenAIAgentWorkflow(lm.tokenizer, agent, SamplingParams(max_new_tokens=8))
    [[t]] = episode(wf, eng, sample())
    assert errors == ["n", "tool_choice", "frequency_penalty", "top_logprobs", "guided_json"]
    assert len(eng.calls) == 1 and t.metadata["turns"] == 1


# --------------------------------------------------------------------------- refusals and limits


def test_a_rewritten_history_is_refused_and_fails_the_episode(lm):
    eng = Scripted(lm.tokenizer, [("four<|im_end|>", "stop"), ("x<|im_end|>", "stop")])
    seen = []

    async def agent(run):
        async with openai.AsyncOpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0) as c:
            r = await c.chat.completions.create(model=run.model, messages=[{"role": "user", "content": "2+2?"}])
            msgs = [{"role": "user", "content": "2+2? Think."}, r.choices[0].message, {"role": "user", "content": "ok"}]
            try:
                await c.chat.completions.create(model=run.model, messages=msgs)
            except openai.BadRequestError as e:  # an agent that swallows the refusal
                seen.append((e.status_code, e.body["code"], e.body["message"]))
        return 1.0

    wf = OpenAIAgentWorkflow(lm.tokenizer, agent, SamplingParams(max_new_tokens=8))
    with pytest.raises(OpenAISessionError, match=r"messages\[0\] \(user\) differs"):
        episode(wf, eng, sample())
    assert seen[0][:2] == (400, "history_mismatch") and len(eng.calls) == 1


def test_limits_cut_the_episode_with_empty_length_answers(lm):
    eng = Scripted(lm.tokenizer, [("one<|im_end|>", "stop")])
    answers = []

    async def agent(run):
        async with openai.AsyncOpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0) as c:
            msgs = [{"role": "user", "content": "go"}]
            for _ in range(3):
                r = await c.chat.completions.create(model=run.model, messages=msgs)
                answers.append((r.choices[0].message.content, r.choices[0].finish_reason))
                msgs += [r.choices[0].message, {"role": "user", "content": "again"}]
        return 0.0

    wf = OpenAIAgentWorkflow(lm.tokenizer, agent, SamplingParams(max_new_tokens=8), max_turns=1)
    [[t]] = episode(wf, eng, sample())
    assert answers == [("one", "stop"), ("", "length"), ("", "length")] and len(eng.calls) == 1
    assert t.metadata["env_done"] is False and t.finish_reason == "length" and t.metadata["turns"] == 1
    assert t.response_ids == list(lm.tokenizer.encode("one<|im_end|>", add_special_tokens=False))


def test_engine_abort_drops_the_episode_and_a_too_long_prompt_skips_the_sample(lm):
    eng = Scripted(lm.tokenizer, [("", "abort")])

    async def agent(run):
        async with openai.AsyncOpenAI(base_url=run.base_url, api_key=run.api_key) as c:  # default retries
            await c.chat.completions.create(model=run.model, messages=[{"role": "user", "content": "hi"}])
        return 1.0

    wf = OpenAIAgentWorkflow(lm.tokenizer, agent, SamplingParams(max_new_tokens=8))
    assert episode(wf, eng, sample()) == [None] and len(eng.calls) == 1  # 503 with x-should-retry: false
    eng = Scripted(lm.tokenizer, [("", "too_long")])
    wf = OpenAIAgentWorkflow(lm.tokenizer, agent, SamplingParams(max_new_tokens=8))
    with pytest.raises(PromptTooLongError):
        episode(wf, eng, sample())


# --------------------------------------------------------------------------- shutdown


def test_server_shutdown_leaves_no_thread_or_port(lm):
    before = endpoint_threads()
    eng = Scripted(lm.tokenizer, [("a<|im_end|>", "stop"), ("b<|im_end|>", "stop")])
    ports = []

    async def agent(run):
        ports.append(int(run.server_url.rsplit(":", 1)[1].split("/")[0]))
        async with openai.AsyncOpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0) as c:
            await c.chat.completions.create(model=run.model, messages=[{"role": "user", "content": "hi"}])
        return 1.0

    wf1 = OpenAIAgentWorkflow(lm.tokenizer, agent, SamplingParams(max_new_tokens=8))
    wf2 = OpenAIAgentWorkflow(lm.tokenizer, agent, SamplingParams(max_new_tokens=8))
    asyncio.run(wf1.run_episode(eng, sample()))
    asyncio.run(wf2.run_episode(eng, sample()))
    assert ports[0] == ports[1] and len(endpoint_threads()) == len(before) + 1  # one shared server
    wf1.close()
    assert len(endpoint_threads()) == len(before) + 1  # still used by wf2
    wf2.close()
    assert endpoint_threads() == before
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", ports[0]), timeout=2).close()
    s = socket.socket()
    s.bind(("127.0.0.1", ports[0]))  # the port is free again
    s.close()
    # a server of its own: the same
    srv = OpenAIServer(port=0)
    srv.start()
    port = srv.port
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
    srv.close()
    assert not srv.running and endpoint_threads() == before
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# --------------------------------------------------------------------------- conveyor train / eval


def test_example_agent_trains_and_evaluates(tmp_path, monkeypatch):
    import json as _json

    from typer.testing import CliRunner

    from conveyor.cli import app
    from conveyor.config import load_config
    from conveyor.train import run_training

    monkeypatch.syspath_prepend(str(EXAMPLE))
    before = endpoint_threads()
    run = tmp_path / "r"
    cfg = load_config(None, [
        "model.name=tiny", "trainer.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
        "run.eval_max_new_tokens=8", "run.progress=false", "reward.workers=1", "trainer.total_steps=2",
        "run.final_checkpoint=none", "run.export=false", "data.heldout_limit=2", "env.max_turns=3",
        "env.max_episode_tokens=48", "env.name=openai:mawps_agent:solve", "env.options.max_calls=2",
        f"run.dir={run}"])
    res = run_training(cfg)
    assert res.steps == 2 and endpoint_threads() == before  # the run closed its endpoint
    rows = [_json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(1 <= r["agent/turns_mean"] <= 2 and 0 <= r["rollout/accuracy"] <= 1 for r in rows)
    groups = [_json.loads(x) for x in (run / "trained.jsonl").read_text().splitlines()]
    assert sum(len(g["groups"]) for g in groups) == 4
    ev = _json.loads((run / "eval_before.json").read_text())
    assert ev["env"] == "openai:mawps_agent:solve" and ev["num_problems"] == 2 and 1 <= ev["turns_mean"] <= 2
    out = tmp_path / "eval.json"
    r = CliRunner().invoke(app, ["eval", "--model", "tiny", "--env", "openai:mawps_agent:solve_sync", "--n", "2",
                                 "--max-new-tokens", "8", "--max-turns", "2", "--env-option", "max_calls=2",
                                 "--no-progress", "-o", str(out)])
    assert r.exit_code == 0, r.output
    got = _json.loads(out.read_text())
    assert got["env"] == "openai:mawps_agent:solve_sync" and got["num_problems"] == 2
    assert got["dataset"].startswith("mawps") and endpoint_threads() == before


AGENT_FAST = ["model.name=tiny", "trainer.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
              "run.progress=false", "reward.workers=1", "trainer.total_steps=1", "run.export=false",
              "run.eval_before=false", "run.eval_after=false", "data.heldout="]


def test_an_agents_check_options_refuses_bad_values_before_the_run_dir(tmp_path, monkeypatch):
    """The example agent's check_options (called once at start by check_agent): an unknown tool
    and max_calls=0 are start-up errors naming env.options and the agent's reason; no run dir.
    A hook raising TypeError counts too; options the signature refuses are refused first."""
    from conveyor.config import load_config
    from conveyor.rollout.openai_agent import check_agent
    from conveyor.train import run_training

    monkeypatch.syspath_prepend(str(EXAMPLE))
    for opt, why in (("env.options.tool=bogus", r"tool='bogus': unknown tool 'bogus'"),
                     ("env.options.max_calls=0", "max_calls must be an int >= 1, got 0")):
        cfg = load_config(None, AGENT_FAST + ["env.name=openai:mawps_agent:solve", opt, f"run.dir={tmp_path / 'r'}"])
        with pytest.raises(ValueError, match=r"env.options \{.*\}: env.name=openai:mawps_agent:solve refuses them: "
                                             + why):
            run_training(cfg)
        assert not (tmp_path / "r").exists()

    def agent(run, *, n=1):
        return None

    def strict(*, n=1):
        if n > 2:
            raise TypeError("n must be at most 2")

    agent.check_options = strict
    check_agent(agent, {"n": 2}, "openai:m:agent")
    with pytest.raises(ValueError, match=r"refuses them: n must be at most 2"):
        check_agent(agent, {"n": 3}, "openai:m:agent")
    with pytest.raises(ValueError, match=r"do not fit env.name=openai:m:agent"):
        check_agent(agent, {"m": 1}, "openai:m:agent")


def test_an_agent_whose_every_episode_fails_stops_with_a_clear_message(tmp_path, monkeypatch):
    """100 failed episodes in a row stop the run: `conveyor train` prints the last error and where
    the tracebacks are, exit code 1, no traceback on the console."""
    from typer.testing import CliRunner

    from conveyor.cli import app

    (tmp_path / "broken_agent.py").write_text("def solve(run):\n    raise RuntimeError('the agent is broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = CliRunner().invoke(app, ["train", *AGENT_FAST, "env.name=openai:broken_agent:solve",
                                 f"run.dir={tmp_path / 'r'}"])
    assert r.exit_code == 1, r.output
    out = " ".join(r.output.split())  # rich wraps the console line
    assert ("episodes in a row failed (groups of rollout.group_size=2 episodes: one raising episode fails its "
            "group, as the group's advantages need every member); the last: RuntimeError: the agent is broken") in out
    assert "train.log" in r.output and "Traceback" not in r.output
    assert "the agent is broken" in (tmp_path / "r" / "train.log").read_text()


def test_a_failing_episode_in_an_evaluation_is_counted_not_fatal(tmp_path, monkeypatch):
    """Fresh-user trial 3, finding 1: an agent that raises on one held-out problem counted that
    problem's episodes as failed (wrong, the record names the error) and the evaluation still
    reported its figure; `conveyor eval` wrote its file. Every problem failing is an error."""
    import json as _json

    from typer.testing import CliRunner

    from conveyor.cli import app

    monkeypatch.syspath_prepend(str(EXAMPLE))
    (tmp_path / "flaky_agent.py").write_text(
        "import mawps_agent\n"
        "FAILED = set()\n"
        "async def solve(run, **kw):\n"
        "    if not FAILED or run.sample.id in FAILED:\n"
        "        FAILED.add(run.sample.id)\n"
        "        raise RuntimeError('flaky agent on ' + run.sample.id)\n"
        "    return await mawps_agent.solve(run, **kw)\n"
        "def broken(run):\n"
        "    raise RuntimeError('always broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "eval.json"
    args = ["eval", "--model", "tiny", "--n", "3", "--samples", "2", "--temperature", "1", "--max-new-tokens", "8",
            "--max-turns", "2", "--no-progress"]
    r = CliRunner().invoke(app, [*args, "--env", "openai:flaky_agent:solve", "-o", str(out)])
    assert r.exit_code == 0, r.output
    got = _json.loads(out.read_text())
    assert got["num_problems"] == 3 and got["episodes_failed"] == 2
    failed = [rec for rec in got["records"] if "error" in rec]
    assert len(failed) == 1 and failed[0]["correct"] == [False, False]
    assert failed[0]["error"] == f"RuntimeError: flaky agent on {failed[0]['id']}"
    assert 1 <= got["turns_mean"] <= 2  # over the 4 episodes that ran
    r = CliRunner().invoke(app, [*args, "--env", "openai:flaky_agent:broken", "-o", str(tmp_path / "e2.json")])
    assert r.exit_code == 1 and not (tmp_path / "e2.json").exists()
    assert "the episodes of every problem failed (3 of 3" in r.output and "always broken" in r.output
