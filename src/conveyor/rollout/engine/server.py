"""conveyor's engine HTTP server: the SGLang-native HTTP subset a trainer needs, over a local engine.

``conveyor serve --model M`` runs it (issue 12 section 2; the field names and shapes are SGLang's,
docs/notes/scale_out_survey.md sections 3 and 5.5: ``GenerateReqInput`` / ``BatchStrOutput`` /
``PauseGenerationReqInput`` / ``AbortReq`` / ``UpdateWeightFromDiskReqInput`` in
``sglang/srt/managers/io_struct.py``, the handlers in ``sglang/srt/entrypoints/http_server.py``,
``FINISH_*.to_json`` in ``schedule_batch.py``), so :class:`~conveyor.rollout.engine.remote.HttpEngine`
drives this server and a stock SGLang server alike. Endpoints:

* ``POST /generate`` -- one prompt per request, token ids in (``input_ids``; ``text`` only when
  the engine has a tokenizer), ``{"text", "output_ids", "meta_info"}`` out (see
  :func:`generation_to_sglang`).
* ``POST /update_weights_from_disk {model_path, weight_version}`` -- safetensors written by
  :func:`conveyor.sync.write_weights` (or a Hugging Face directory) become
  ``WeightUpdate(version=int(weight_version))``, applied between two decode steps like any update.
* ``POST /pause_generation {mode}``, ``POST /continue_generation``, ``POST /abort_request {rid,
  abort_all}``, ``GET /health``, ``GET /get_model_info``, ``GET /get_weight_version``.
* conveyor only: ``GET /conveyor/stats`` (``engine.stats()``).
* A minimal imitation of vLLM's OpenAI ``POST /v1/completions`` (token-id prompts only) and of its
  RL control routes ``POST /pause?mode=``, ``POST /resume``, ``GET /is_paused``, so that
  :class:`~conveyor.rollout.engine.remote.VllmCompletionsEngine` can be tested without vLLM. Tests against
  it verify the client against conveyor's imitation of vLLM's shapes, not against vLLM.

Errors are JSON ``{"error": {"message", "field"}}`` (SGLang's ``{"error": {"message"}}`` plus the
offending field): 400 for bad input (the message names the field), 401 without the API key when
one is set, 503 when the engine is stopped or crashed, 500 for anything unexpected; none of them
stops the server. Weight versions are strings on the wire (SGLang's ``weight_version``) and ints
in conveyor.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from conveyor.rollout.engine.types import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    SamplingParams,
)
from conveyor.sync import non_finite_names, read_weights

log = logging.getLogger("conveyor.rollout.engine.server")

# Fields of SGLang's GenerateReqInput this server understands; a field outside the set is a 400
# (naming it) rather than being ignored silently.
_GENERATE_FIELDS = {
    "input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs", "rid", "stream", "return_sampling_mask",
}
_SAMPLING_FIELDS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
    "ignore_eos", "seed", "sampling_seed", "n", "skip_special_tokens", "no_stop_trim",
}
_UPDATE_FIELDS = {
    "model_path", "weight_version", "abort_all_requests", "load_format", "flush_cache",
}
_COMPLETIONS_FIELDS = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "ignore_eos", "logprobs", "return_tokens_as_token_ids",
    "skip_special_tokens", "n", "stream", "echo", "user", "include_stop_str_in_output",
}


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400.

    Attributes:
        field: The offending JSON field (dotted for nested ones, e.g.
            ``sampling_params.top_k``), or None when the body as a whole is wrong.
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class EngineUnavailable(RuntimeError):
    """The engine is stopped or crashed: the server answers 503."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_fields(body: dict, allowed: set[str], where: str = "") -> None:
    for key in body:
        if key not in allowed:
            raise BadRequest(
                f"unsupported field {where}{key!r} (supported: {', '.join(sorted(allowed))})",
                f"{where}{key}",
            )


def _sampling_params(sp: Any, *, where: str, max_key: str, default_max: int) -> SamplingParams:
    """Build :class:`SamplingParams` from SGLang's ``sampling_params`` dict (or the flat fields
    of an OpenAI completions body). ``top_k`` -1 or 0 disables top-k (SGLang: -1); ``seed`` and
    SGLang's ``sampling_seed`` are the same field."""
    if not isinstance(sp, dict):
        raise BadRequest(f"{where or 'sampling_params'} must be a JSON object", where or "sampling_params")
    if where:  # SGLang's nested dict (the completions body was checked as a whole)
        _check_fields(sp, _SAMPLING_FIELDS, where)
    n = sp.get("n", 1)
    if n != 1:
        raise BadRequest(f"{where}n={n!r}: only one response per request (n=1); send the "
                         "prompt several times instead", f"{where}n")
    if sp.get("skip_special_tokens", True) is not True:
        raise BadRequest(f"{where}skip_special_tokens=false is not supported (the text always "
                         "skips special tokens; output_ids hold every token)",
                         f"{where}skip_special_tokens")
    seed = sp.get("seed")
    if sp.get("sampling_seed") is not None:
        if seed is not None and seed != sp["sampling_seed"]:
            raise BadRequest(f"{where}seed and {where}sampling_seed differ", f"{where}seed")
        seed = sp["sampling_seed"]
    top_k = sp.get("top_k", 0)
    if top_k == -1:
        top_k = 0
    stop = sp.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    kwargs = dict(
        max_new_tokens=sp.get(max_key, default_max),
        temperature=sp.get("temperature", 1.0),
        top_p=sp.get("top_p", 1.0),
        top_k=top_k,
        min_p=sp.get("min_p", 0.0),
        stop=stop,
        stop_token_ids=sp.get("stop_token_ids") or (),
        seed=seed,
        ignore_eos=sp.get("ignore_eos", False),
    )
    try:
        if not isinstance(kwargs["stop"], list | tuple):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if not isinstance(kwargs["stop_token_ids"], list | tuple):
            raise ValueError(f"stop_token_ids must be a list of ints, got {kwargs['stop_token_ids']!r}")
        return SamplingParams(**kwargs)
    except ValueError as e:
        msg = str(e)
        names = {"max_new_tokens": max_key, "seed": "seed"}
        for name in kwargs:
            if msg.startswith(name + " "):
                raise BadRequest(f"{where}{names.get(name, name)}: {msg}",
                                 f"{where}{names.get(name, name)}") from None
        raise BadRequest(msg, where.rstrip(".") or None) from None


def _prompt_ids(body: dict, tokenizer: Any, *, ids_key: str, text_key: str | None) -> list[int]:
    ids = body.get(ids_key)
    text = body.get(text_key) if text_key else None
    if ids is not None and text is not None:
        raise BadRequest(f"give either {ids_key} or {text_key}, not both", text_key)
    if text is not None:
        if not isinstance(text, str):
            raise BadRequest(f"{text_key} must be one string (batched requests are not "
                             "supported: one prompt per request)", text_key)
        if tokenizer is None:
            raise BadRequest(f"{text_key}: this engine has no tokenizer; send {ids_key} (token "
                             "ids) instead", text_key)
        return list(tokenizer.encode(text))
    if ids is None:
        raise BadRequest(f"{ids_key} (a list of token ids) is required", ids_key)
    if isinstance(ids, str) and ids_key == "prompt":
        raise BadRequest("prompt: only token-id prompts (a list of ints) are supported by "
                         "conveyor's /v1/completions imitation, not text", ids_key)
    if not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids):
        raise BadRequest(f"{ids_key} must be a non-empty list of ints (batched requests are not "
                         "supported: one prompt per request)", ids_key)
    return ids


def _bool_field(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{key} must be true or false, got {v!r}", key)
    return v


def _version_spans(versions: Sequence[int]) -> list[dict[str, Any]]:
    """Runs of equal versions as SGLang's ``weight_versions`` spans ``[{"version": str, "start":
    i, "end": j}]`` (half-open token ranges ``[start, end)`` of the output)."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def _matched_stop(out: GenerationOutput, params: SamplingParams) -> str | None:
    """The stop string that ended ``out`` (the first of ``params.stop`` in its text), or None."""
    if out.finish_reason != FINISH_STOP:
        return None
    return next((s for s in params.stop if s in out.text), None)


def trimmed_text(out: GenerationOutput, params: SamplingParams) -> str:
    """``out.text`` cut before the stop string that ended it, as SGLang's detokenizer
    (``trim_matched_stop`` unless ``no_stop_trim``) and vLLM (``include_stop_str_in_output``
    false, the default) return it; unchanged when no stop string matched. The token ids are
    never cut: the stop string's tokens were generated and are trained on."""
    matched = _matched_stop(out, params)
    return out.text if matched is None else out.text[:out.text.find(matched)]


def _first_names(names: list[str], k: int = 5) -> str:
    """The first ``k`` of ``names`` for a message (``, ...`` when there are more)."""
    return ", ".join(names[:k]) + (", ..." if len(names) > k else "")


def _finish_reason_json(out: GenerationOutput, params: SamplingParams) -> dict[str, Any]:
    """SGLang's ``FINISH_*.to_json()``: ``{"type": "stop", "matched": str | id}``, ``{"type":
    "length", "length": n}``, ``{"type": "abort", "message": str}``."""
    if out.finish_reason == FINISH_STOP:
        matched: Any = _matched_stop(out, params)
        if matched is None and out.token_ids:
            matched = out.token_ids[-1]
        return {"type": "stop", "matched": matched}
    if out.finish_reason == FINISH_LENGTH:
        return {"type": "length", "length": len(out.token_ids)}
    if out.finish_reason == FINISH_ABORT:
        return {"type": "abort", "message": "aborted" if out.token_ids else "Abort before prefill"}
    return {"type": str(out.finish_reason)}


def generation_to_sglang(
    out: GenerationOutput,
    params: SamplingParams,
    rid: str,
    *,
    version: int,
    return_logprob: bool = True,
    return_sampling_mask: bool = False,
    latency: float | None = None,
    no_stop_trim: bool = False,
) -> dict[str, Any]:
    """One finished request as SGLang's non-stream ``/generate`` answer.

    Args:
        out: The engine's output (``R`` tokens).
        params: Its sampling parameters (to name a matched stop string).
        rid: The request id (``meta_info.id``).
        version: The engine's version now (``weight_version`` when ``R == 0``).
        return_logprob: Add ``output_token_logprobs`` ``[[logprob, token_id, null], ...]``.
        return_sampling_mask: Add ``output_token_sampling_mask`` (per token, the kept ids in
            descending behaviour probability), ``output_token_sampling_logprobs`` (the same
            numbers as ``output_token_logprobs``: conveyor's log-probs are already renormalised
            over the kept set) and ``output_token_sampling_mask_length`` (``R``).
        latency: Seconds from arrival to finish (``meta_info.e2e_latency``).
        no_stop_trim: Keep a matched stop string in ``text`` (SGLang's sampling parameter;
            by default ``text`` ends before it, :func:`trimmed_text`; ``output_ids`` always hold
            every generated token).

    Returns:
        ``{"text", "output_ids", "meta_info"}``; ``meta_info`` has ``id``, ``finish_reason``
        (dict), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` (0: no prefix cache),
        ``weight_version`` (str; the last token's version), ``weight_versions`` (spans),
        ``output_token_versions`` (conveyor extension: one int per token),
        ``num_interruptions`` (weight updates the request lived through), ``e2e_latency``.
    """
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish_reason_json(out, params),
        "prompt_tokens": len(out.prompt_ids),
        "completion_tokens": len(out.token_ids),
        "cached_tokens": 0,
        "weight_version": str(out.versions[-1] if out.versions else version),
        "weight_versions": _version_spans(out.versions),
        "output_token_versions": list(out.versions),
        "num_interruptions": out.num_interruptions,
    }
    if latency is not None:
        meta["e2e_latency"] = latency
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(out.logprobs, out.token_ids, strict=True)
        ]
    if return_sampling_mask:
        mask = out.sampling_mask
        offs = mask.offsets.tolist() if mask is not None else [0] * (len(out.token_ids) + 1)
        ids = mask.token_ids.tolist() if mask is not None else []
        meta["output_token_sampling_mask"] = [ids[a:b] for a, b in zip(offs[:-1], offs[1:])]
        meta["output_token_sampling_logprobs"] = list(out.logprobs)
        meta["output_token_sampling_mask_length"] = len(out.token_ids)
    text = out.text if no_stop_trim else trimmed_text(out, params)
    return {"text": text, "output_ids": list(out.token_ids), "meta_info": meta}


def build_app(
    engine: Any,
    *,
    api_key: str | None = None,
    model_path: str | None = None,
    tokenizer: Any = None,
) -> FastAPI:
    """The FastAPI application serving ``engine`` (see the module docstring for the endpoints).

    The caller owns the engine: starting it before serving and stopping it afterwards
    (:func:`serve` does both). Any :class:`~conveyor.rollout.engine.protocol.Engine` works for
    generation and control; ``/abort_request`` and ``/pause_generation {"mode": "abort"}`` need
    an engine with ``submit`` and ``abort`` (``InferenceEngine``), and ``GET /health`` reads its
    ``running`` property when it has one.

    Args:
        engine: The engine to serve.
        api_key: When set, every request must carry ``Authorization: Bearer <api_key>`` (401
            otherwise), health checks included (SGLang's ``--api-key``).
        model_path: Reported by ``/get_model_info`` (and as ``model`` by ``/v1/completions``).
        tokenizer: For ``text`` prompts and the completions imitation's text fields; default the
            engine's ``tokenizer`` attribute (None: ``text`` prompts are a 400).

    Returns:
        A ``fastapi.FastAPI`` instance (run it with uvicorn).
    """
    # (FastAPI reads the handlers' annotations: ``Request`` must be a module-level name.)
    class _JSON(JSONResponse):  # like JSONResponse, but a -inf log-prob is not a 500
        def render(self, content: Any) -> bytes:
            return json.dumps(content, separators=(",", ":")).encode("utf-8")

    if tokenizer is None:
        tokenizer = getattr(engine, "tokenizer", None)
    app = FastAPI(title="conveyor engine server", docs_url=None, redoc_url=None,
                  openapi_url=None, default_response_class=_JSON)
    inflight: dict[str, Any] = {}  # rid -> engine request id (int) while the request runs
    served_name = model_path or "conveyor"

    def error(status: int, message: str, field: str | None = None) -> _JSON:
        return _JSON({"error": {"message": message, "field": field}}, status_code=status)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if api_key is not None:
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
                return error(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")
        try:
            return await call_next(request)
        except Exception as e:  # never let one request take the server down
            log.exception("request %s %s failed", request.method, request.url.path)
            return error(500, f"{type(e).__name__}: {e}")

    async def body_of(request: Request, *, optional: bool = False) -> dict:
        raw = await request.body()
        if not raw.strip() and optional:
            return {}
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise BadRequest(f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    def running() -> bool:
        return bool(getattr(engine, "running", True))

    async def run_generation(
        prompt: list[int], params: SamplingParams, rid: str, prompt_field: str
    ) -> GenerationOutput:
        if rid in inflight:
            raise BadRequest(f"rid {rid!r} is already in flight", "rid")
        if not running():
            raise EngineUnavailable("the engine is not running")
        submit = getattr(engine, "submit", None)
        try:
            if submit is not None:
                fut = submit(prompt, params)
                inflight[rid] = getattr(fut, "rid", None)
                try:
                    return await asyncio.wrap_future(fut)
                finally:
                    inflight.pop(rid, None)
            inflight[rid] = None
            try:
                return await engine.generate(prompt, params)
            finally:
                inflight.pop(rid, None)
        except ValueError as e:  # invalid prompt (out of range, too long for the context)
            raise BadRequest(f"{prompt_field}: {e}", prompt_field) from None
        except RuntimeError as e:
            raise EngineUnavailable(str(e)) from None

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(request: Request, exc: EngineUnavailable):
        return error(503, str(exc))

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, exc: BadRequest):
        return error(400, str(exc), exc.field)

    def abort(rids: list[str] | None) -> int:
        fn = getattr(engine, "abort", None)
        if fn is None:
            raise BadRequest(f"{type(engine).__name__} cannot abort requests")
        if rids is None:
            return fn(None)
        ids = [inflight[r] for r in rids if inflight.get(r) is not None]
        return fn(ids) if ids else 0

    # ------------------------------------------------------------------ SGLang subset
    @app.post("/generate")
    async def generate(request: Request):
        """SGLang ``/generate`` (one prompt, non-stream)."""
        t0 = time.perf_counter()
        body = await body_of(request)
        _check_fields(body, _GENERATE_FIELDS)
        if body.get("stream"):
            raise BadRequest("stream=true is not supported (non-stream answers only)", "stream")
        start = body.get("logprob_start_len", -1)
        if start is not None and start != -1:
            raise BadRequest(f"logprob_start_len={start!r}: only -1 (log-probs of the output "
                             "tokens) is supported", "logprob_start_len")
        if body.get("top_logprobs_num") not in (None, 0):
            raise BadRequest("top_logprobs_num: top log-probs are not supported (0 or absent)",
                             "top_logprobs_num")
        if body.get("return_text_in_logprobs"):
            raise BadRequest("return_text_in_logprobs=true is not supported",
                             "return_text_in_logprobs")
        prompt = _prompt_ids(body, tokenizer, ids_key="input_ids", text_key="text")
        params = _sampling_params(body.get("sampling_params") or {}, where="sampling_params.",
                                  max_key="max_new_tokens", default_max=128)
        return_logprob = _bool_field(body, "return_logprob", False)
        return_mask = _bool_field(body, "return_sampling_mask", False)
        if return_mask and not params.truncated:
            raise BadRequest("return_sampling_mask needs truncated sampling (temperature > 0 "
                             "with top_k > 0, top_p < 1 or min_p > 0): otherwise the kept set "
                             "is the whole vocabulary", "return_sampling_mask")
        no_trim = _bool_field(body.get("sampling_params") or {}, "no_stop_trim", False)
        rid = body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str):
            raise BadRequest("rid must be a string", "rid")
        out = await run_generation(prompt, params, rid, "input_ids")
        return generation_to_sglang(out, params, rid, version=engine.version,
                                    return_logprob=return_logprob,
                                    return_sampling_mask=return_mask,
                                    latency=time.perf_counter() - t0, no_stop_trim=no_trim)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        """SGLang ``/update_weights_from_disk``: ``model_path`` (a safetensors file or a
        directory of them), ``weight_version`` (a string holding an int > the current version;
        absent: current + 1), ``abort_all_requests`` (abort in-flight requests first).
        ``load_format`` (``auto`` / ``safetensors``) and ``flush_cache`` are accepted; there is
        no prefix cache to flush. -> ``{"success", "message", "num_paused_requests"}`` (the
        requests in flight that the update interrupts), 400 with ``success: false`` on failure
        (weights holding NaN or infinite values included: refused, naming the tensors).
        """
        body = await body_of(request)
        _check_fields(body, _UPDATE_FIELDS)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path (a safetensors file or directory) is required", "model_path")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format={body['load_format']!r}: only safetensors",
                             "load_format")
        wv = body.get("weight_version")
        if wv is None:
            version = engine.version + 1
        else:
            try:
                version = int(wv)
                if str(version) != str(wv).strip():
                    raise ValueError
            except (TypeError, ValueError):
                raise BadRequest(f"weight_version={wv!r}: conveyor's versions are integers "
                                 "(sent as strings, e.g. \"8\")", "weight_version") from None
        if _bool_field(body, "abort_all_requests", False):
            abort(None)
        paused_requests = int(engine.stats().get("running", 0))
        try:
            update = await asyncio.to_thread(read_weights, path, version)
            bad = await asyncio.to_thread(update.non_finite)
            if bad:  # every request would sample from NaN logits: refused, the weights in force kept
                raise ValueError(f"{len(bad)} tensors hold NaN or infinite values ({_first_names(bad)}); the "
                                 "weights in force are kept")
            await asyncio.to_thread(engine.update_weights, update)
        except (OSError, ValueError, KeyError, TypeError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            return _JSON({"success": False, "message": f"Failed to update weights from "
                          f"{path}: {msg}", "num_paused_requests": 0}, status_code=400)
        return {"success": True,
                "message": f"Succeeded to update model weights (version {version}).",
                "num_paused_requests": paused_requests}

    async def pause(mode: str, field: str) -> None:
        if mode == "in_place":
            await asyncio.to_thread(engine.pause)
        elif mode == "abort":
            await asyncio.to_thread(engine.pause)
            abort(None)
        else:
            raise BadRequest(
                f"{field}={mode!r} is not supported: conveyor's engine keeps paused requests "
                "in place (in_place; weight updates re-encode them as the engine is configured) "
                "or aborts them (abort)", field)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        """SGLang ``/pause_generation {"mode"}`` (default ``abort``, as SGLang). ``in_place``:
        no forward pass after the current one; requests stay with their KV cache and new ones
        queue. ``abort``: the same, and every unfinished request returns now with finish
        ``abort`` and its partial tokens. ``retract`` is a 400 (running requests are not moved
        back to the queue). -> ``{"message", "status": "ok"}``."""
        body = await body_of(request, optional=True)
        _check_fields(body, {"mode"})
        await pause(body.get("mode", "abort"), "mode")
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        """SGLang ``/continue_generation``: resume after a pause (``torch_empty_cache`` is
        accepted and ignored). -> ``{"message", "status": "ok"}``."""
        body = await body_of(request, optional=True)
        _check_fields(body, {"torch_empty_cache"})
        await asyncio.to_thread(engine.resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        """SGLang ``/abort_request {rid, abort_all}``: the request(s) finish with ``{"type":
        "abort"}`` and the tokens they have. Unknown rids are ignored (as SGLang). -> 200
        ``{"num_aborted"}`` (SGLang answers an empty body)."""
        body = await body_of(request)
        _check_fields(body, {"rid", "abort_all"})
        if _bool_field(body, "abort_all", False):
            return {"num_aborted": abort(None)}
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise BadRequest("rid (a string) or abort_all=true is required", "rid")
        return {"num_aborted": abort([rid])}

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        """200 ``{"status": "ok"}`` while the engine runs, 503 otherwise (stopped, crashed)."""
        if running():
            return {"status": "ok"}
        return error(503, "the engine is not running")

    @app.get("/get_model_info")
    async def get_model_info():
        """SGLang ``/get_model_info``."""
        return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": str(engine.version)}

    @app.get("/get_weight_version")
    async def get_weight_version():
        """SGLang ``/get_weight_version`` -> ``{"weight_version": "<int>"}``."""
        return {"weight_version": str(engine.version)}

    @app.get("/conveyor/stats")
    async def conveyor_stats():
        """conveyor only: ``engine.stats()`` (see ``InferenceEngine.stats``)."""
        return await asyncio.to_thread(engine.stats)

    # ------------------------------------------------------------------ vLLM imitation
    @app.post("/v1/completions")
    async def completions(request: Request):
        """A minimal imitation of vLLM's OpenAI ``/v1/completions`` (one token-id prompt,
        non-stream): ``prompt`` [int], ``max_tokens`` (default 16, as OpenAI),
        ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``,
        ``stop_token_ids``, ``ignore_eos``, ``logprobs`` (None or 0: the sampled token's),
        ``return_tokens_as_token_ids``, ``include_stop_str_in_output`` (default false: ``text``
        ends before a matched stop string, as vLLM's). Answer: ``choices[0]`` with ``text``,
        ``finish_reason`` (plain string), ``stop_reason`` (the matched stop string, else null), ``logprobs`` ``{"tokens": ["token_id:<n>" | token text],
        "token_logprobs", "top_logprobs", "text_offset"}`` (vLLM's names); ``usage``."""
        body = await body_of(request)
        _check_fields(body, _COMPLETIONS_FIELDS)
        for key in ("stream", "echo"):
            if body.get(key):
                raise BadRequest(f"{key}=true is not supported", key)
        lp = body.get("logprobs")
        if lp not in (None, 0):
            raise BadRequest(f"logprobs={lp!r}: only 0 (the sampled token) or null", "logprobs")
        prompt = _prompt_ids(body, tokenizer, ids_key="prompt", text_key=None)
        params = _sampling_params(body, where="", max_key="max_tokens", default_max=16)
        as_ids = _bool_field(body, "return_tokens_as_token_ids", False)
        keep_stop = _bool_field(body, "include_stop_str_in_output", False)
        if lp is not None and not as_ids and tokenizer is None:
            raise BadRequest("return_tokens_as_token_ids=false needs a tokenizer",
                             "return_tokens_as_token_ids")
        rid = f"cmpl-{uuid.uuid4().hex}"
        out = await run_generation(prompt, params, rid, "prompt")
        logprobs = None
        if lp is not None:
            toks = [f"token_id:{t}" if as_ids else tokenizer.decode([t]) for t in out.token_ids]
            offsets, pos = [], 0
            for t in out.token_ids:
                offsets.append(pos)
                pos += len(tokenizer.decode([t])) if tokenizer is not None else 0
            logprobs = {"text_offset": offsets, "token_logprobs": list(out.logprobs),
                        "tokens": toks,
                        "top_logprobs": [{k: v} for k, v in zip(toks, out.logprobs, strict=True)]}
        return {
            "id": rid, "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or served_name,
            "choices": [{"index": 0, "text": out.text if keep_stop else trimmed_text(out, params),
                         "logprobs": logprobs, "finish_reason": out.finish_reason,
                         "stop_reason": _matched_stop(out, params)}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out.token_ids),
                      "total_tokens": len(prompt) + len(out.token_ids)},
        }

    @app.post("/pause")
    async def vllm_pause(mode: str = "abort"):
        """Imitation of vLLM's ``POST /pause?mode=``: ``keep`` = SGLang's ``in_place``,
        ``abort`` = ``abort`` (default, as vLLM); ``wait`` (finish in-flight requests first)
        is a 400."""
        await pause({"keep": "in_place", "abort": "abort"}.get(mode, mode), "mode")
        return {"status": "paused"}

    @app.post("/resume")
    async def vllm_resume():
        """Imitation of vLLM's ``POST /resume``."""
        await asyncio.to_thread(engine.resume)
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def vllm_is_paused():
        """Imitation of vLLM's ``GET /is_paused`` -> ``{"is_paused": bool}``."""
        return {"is_paused": bool(getattr(engine, "paused", False))}

    return app


def serve(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 30000,
    api_key: str | None = None,
    max_batch_size: int = 32,
    seed: int = 0,
    num_threads: int | None = None,
    log_level: str = "info",
    device=None,
    init: str = "pretrained",
) -> None:
    """Load ``model``, start an :class:`~conveyor.rollout.engine.local.InferenceEngine` on it
    and serve it over HTTP until interrupted (``conveyor serve``); the engine is stopped on exit.

    Args:
        model: A preset (``smollm2-135m-instruct``, ``tiny``), a Hugging Face directory or a
            ``.gguf`` file (``conveyor.models.load_model``). A run's export starts at the
            ``policy_version`` of its ``conveyor.json`` (``weight_version``; else 0).
        host: Interface to bind; 127.0.0.1 by default (reachable from this machine only).
        port: TCP port.
        api_key: Require ``Authorization: Bearer <api_key>`` on every request.
        max_batch_size / seed / num_threads / device: The engine's (``InferenceEngine`` arguments;
            ``device`` None: the CPU).
        log_level: uvicorn's log level.
        init: ``pretrained`` or ``random`` (:func:`conveyor.models.load_model`).

    Raises:
        conveyor.models.ModelLoadError: the model cannot be loaded, or its weights hold NaN or
            infinite values.
        ValueError: an export's ``conveyor.json`` is unreadable (naming the file and key).
        OSError: the port cannot be bound.
    """
    import uvicorn

    from conveyor.eval import load_export_settings
    from conveyor.models import ModelLoadError, load_model
    from conveyor.rollout.engine.local import InferenceEngine

    # a run's export starts at the policy version it holds (its conveyor.json), so weight_version
    # and every token's version name that policy; any other model starts at 0
    exported = (load_export_settings(model) or {}) if init == "pretrained" else {}
    version = exported.get("policy_version")
    version = version if isinstance(version, int) and version >= 0 else 0
    lm = load_model(model, init=init)
    bad = non_finite_names(lm.model.state_dict())
    if bad:  # every answer would be sampled from NaN logits (and its log-probs NaN)
        raise ModelLoadError(f"{model}: {len(bad)} weights hold NaN or infinite values ({_first_names(bad)}); "
                             "refusing to serve them")
    engine = InferenceEngine(lm.model, lm.tokenizer, max_batch_size=max_batch_size, seed=seed,
                             num_threads=num_threads, device=device, version=version)
    log.info("serving %s%s on %s at weight version %d", model, " (random weights)" if init == "random" else "",
             engine.device, version)
    engine.start()
    try:
        app = build_app(engine, api_key=api_key, model_path=model)
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        engine.stop()

