"""Remote engines: :class:`HttpEngine` (SGLang's native HTTP API, served by ``conveyor serve`` or by
SGLang itself) and :class:`VllmCompletionsEngine` (an OpenAI-compatible ``/v1/completions`` server,
no weight sync), both implementing the :class:`~conveyor.rollout.engine.protocol.Engine` protocol
with ``httpx``. The vLLM engine that trains (weight sync, exact versions, a supervised server) is
:class:`conveyor.rollout.engine.vllm.VllmEngine` (this module's former ``VllmEngine`` is
:class:`VllmCompletionsEngine`).

Field names and shapes are those of docs/notes/scale_out_survey.md sections 3 and 5.5 (SGLang's
``io_struct.py`` / ``http_server.py``; vLLM's completions answer as AReaL's ``VLLMBackend`` reads
it). What was verified against what: both clients are tested against conveyor's own server
(``conveyor/rollout/engine/server.py``), ``VllmCompletionsEngine`` against that server's *imitation* of
vLLM's shapes; neither has been run against a real SGLang or vLLM server in this repository.

Generation is async (one ``httpx.AsyncClient`` per call, so any event loop in any thread can
await it); control calls are synchronous. Every call has a timeout: a call that does not answer
in time raises :class:`EngineTimeoutError` naming the URL and the timeout (control calls after
``retries`` further attempts), never a silent hang.
"""

from __future__ import annotations

import concurrent.futures
import logging
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import torch

from conveyor.rollout.engine.types import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    PartialRequest,
    SamplingParams,
)
from conveyor.sync import WeightUpdate, write_weights
from conveyor.types import SamplingMask

log = logging.getLogger("conveyor.rollout.engine.remote")

_FINISH = {FINISH_STOP, FINISH_LENGTH, FINISH_ABORT}


class EngineTimeoutError(TimeoutError):
    """A call to a remote engine did not complete within its timeout (the message names the
    method, the URL, the timeout in seconds and the number of attempts)."""


class EngineRequestError(ValueError):
    """The remote engine refused a request (HTTP 4xx other than 401 / 404: bad input).

    Attributes:
        status: The HTTP status code. url: The URL called.
    """

    def __init__(self, message: str, status: int, url: str):
        super().__init__(message)
        self.status, self.url = status, url


class EngineHTTPError(RuntimeError):
    """The remote engine failed or cannot be reached (connection refused, 401 wrong / missing
    API key, 404 unknown route, 5xx, 503 engine stopped).

    Attributes:
        status: The HTTP status code (None when no answer came back). url: The URL called.
    """

    def __init__(self, message: str, status: int | None, url: str):
        super().__init__(message)
        self.status, self.url = status, url


class EngineGoneError(EngineHTTPError):
    """The engine's server process is gone (it exited or was killed): nothing more can be generated
    by it, so the rollout controller stops the run at once instead of failing episode after
    episode (the message names the process, its exit code and its log)."""


class _NoLocalModel:
    """Stands in for ``Engine.model`` on a remote engine: the attribute exists (so the engine is
    an :class:`~conveyor.rollout.engine.protocol.Engine`) but any use raises
    ``NotImplementedError``."""

    def __init__(self, owner: str):
        self._owner = owner

    def _refuse(self) -> NotImplementedError:
        return NotImplementedError(
            f"{self._owner}.model: the weights live in the server process, not here. "
            "proximal.method=partial_sync scores with the engine's own model; use a local "
            "InferenceEngine for it, or a method that does not (recompute, behavior, snapshot)"
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise self._refuse()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse()

    def __repr__(self) -> str:
        return f"<no local model: {self._owner} is remote>"


def _error_message(r: httpx.Response) -> str:
    try:
        data = r.json()
    except ValueError:
        return r.text[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "message" in data:
            return str(data["message"])
        if "detail" in data:
            return str(data["detail"])
    return str(data)[:500]


def _check(r: httpx.Response, method: str, url: str) -> Any:
    """The JSON of a 2xx answer (``{}`` for an empty body); raise otherwise."""
    if r.is_success:
        if not r.content.strip():
            return {}
        return r.json()
    msg = f"{method} {url} -> HTTP {r.status_code}: {_error_message(r)}"
    if 400 <= r.status_code < 500 and r.status_code not in (401, 403, 404):
        raise EngineRequestError(msg, r.status_code, url)
    raise EngineHTTPError(msg, r.status_code, url)


def _version_of(value: Any, default: int) -> int:
    """An SGLang ``weight_version`` (a string) as conveyor's int version. SGLang's initial
    ``"default"`` (and None) map to ``default``; any other non-integer is a ValueError."""
    if value is None or value == "default":
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"weight_version {value!r} is not an integer version") from None


def _mask_from_rows(rows: Sequence[Sequence[int]]) -> SamplingMask:
    sizes = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    ids = torch.tensor([t for r in rows for t in r], dtype=torch.int32)
    return SamplingMask(ids, torch.cat([sizes.new_zeros(1), sizes.cumsum(0)]))


def sglang_to_generation(
    prompt_ids: Sequence[int], data: dict[str, Any], *, default_version: int = 0
) -> GenerationOutput:
    """Map SGLang's non-stream ``/generate`` answer back to a :class:`GenerationOutput`.

    Args:
        prompt_ids: The prompt that was sent (``P`` ids).
        data: ``{"text", "output_ids", "meta_info"}`` (``R`` output ids).
        default_version: Version for SGLang's initial ``weight_version`` ``"default"``.

    Returns:
        ``token_ids`` = ``output_ids``; ``logprobs`` = ``meta_info.output_token_sampling_logprobs``
        when present (the selected token's log-prob renormalised over its kept set, what the
        trainer replays), else ``x[0]`` of each ``output_token_logprobs`` entry; ``versions`` =
        ``output_token_versions`` (conveyor), else the ``weight_versions`` spans expanded, else
        ``weight_version`` for every token; ``finish_reason`` = ``finish_reason["type"]``;
        ``num_interruptions`` = ``meta_info.num_interruptions``, else the number of version
        changes; ``sampling_mask`` from ``output_token_sampling_mask`` when present.

    Raises:
        ValueError: a missing or inconsistent field (log-probs not returned, a length that is
            not ``R``, a log-prob entry for another token id, spans that do not cover the
            output, an unknown finish reason); the message names the field.
    """
    try:
        ids = [int(t) for t in data["output_ids"]]
        meta = data["meta_info"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"not an SGLang /generate answer (missing {e})") from None
    n = len(ids)
    if meta.get("output_token_sampling_logprobs") is not None:
        logprobs = [float(x) for x in meta["output_token_sampling_logprobs"]]
        field = "output_token_sampling_logprobs"
    elif meta.get("output_token_logprobs") is not None:
        rows = meta["output_token_logprobs"]
        field = "output_token_logprobs"
        for i, row in enumerate(rows):
            if len(row) < 2 or int(row[1]) != (ids[i] if i < n else None):
                raise ValueError(f"{field}[{i}] is for token {row[1] if len(row) > 1 else None}, "
                                 f"output_ids[{i}] is {ids[i] if i < n else None}")
        logprobs = [float(row[0]) for row in rows]
    else:
        raise ValueError("the answer has no log-probs (meta_info.output_token_logprobs); "
                         "send return_logprob=true")
    if len(logprobs) != n:
        raise ValueError(f"{field} has {len(logprobs)} entries for {n} output ids")
    wv = _version_of(meta.get("weight_version"), default_version)
    if meta.get("output_token_versions") is not None:
        versions = [int(v) for v in meta["output_token_versions"]]
        if len(versions) != n:
            raise ValueError(f"output_token_versions has {len(versions)} entries for {n} ids")
    elif meta.get("weight_versions"):
        versions = []
        for span in meta["weight_versions"]:
            if int(span["start"]) != len(versions) or int(span["end"]) < int(span["start"]):
                raise ValueError(f"weight_versions span {span} does not continue at {len(versions)}")
            versions += [_version_of(span["version"], default_version)] * (
                int(span["end"]) - int(span["start"]))
        if len(versions) != n:
            raise ValueError(f"weight_versions cover {len(versions)} tokens, not {n}")
    else:
        versions = [wv] * n
    fr = meta.get("finish_reason")
    reason = fr.get("type") if isinstance(fr, dict) else fr
    if reason not in _FINISH:
        raise ValueError(f"meta_info.finish_reason {fr!r}: expected type stop, length or abort")
    interruptions = meta.get("num_interruptions")
    if interruptions is None:
        interruptions = sum(1 for a, b in zip(versions, versions[1:]) if a != b)
    mask = None
    if meta.get("output_token_sampling_mask") is not None:
        rows = meta["output_token_sampling_mask"]
        if len(rows) != n:
            raise ValueError(f"output_token_sampling_mask has {len(rows)} rows for {n} ids")
        mask = _mask_from_rows(rows)
    return GenerationOutput(
        prompt_ids=[int(t) for t in prompt_ids],
        token_ids=ids,
        logprobs=logprobs,
        versions=versions,
        finish_reason=reason,
        text=str(data.get("text") or ""),
        num_interruptions=int(interruptions),
        sampling_mask=mask,
    )


class _RemoteEngine:
    """Shared plumbing: base URL, API key, the synchronous control client with timeout and
    retries, the in-flight set, start / stop state."""

    _name = "remote engine"

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        timeout: float,
        generate_timeout: float | None,
        retries: int,
    ) -> None:
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        for name, t in (("timeout", timeout), ("generate_timeout", generate_timeout)):
            if t is not None and not t > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {t!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.generate_timeout = generate_timeout
        self.retries = retries
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(headers=self._headers, timeout=self.timeout)
        self._lock = threading.Lock()
        self._inflight: set[str] = set()
        self._stopped = False
        self.model = _NoLocalModel(type(self).__name__)

    def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict | None = None,
        timeout: float | None = None,
        retries: int | None = None,
    ) -> Any:
        """One control call with timeout and retries (timeouts and connection errors are
        retried; HTTP errors are not). Returns the answer's JSON."""
        url = self.base_url + path
        timeout = self.timeout if timeout is None else timeout
        attempts = 1 + (self.retries if retries is None else retries)
        last: Exception | None = None
        for attempt in range(attempts):
            if attempt:
                time.sleep(min(0.25 * 2 ** (attempt - 1), 5.0))
            try:
                r = self._client.request(method, url, json=json, params=params, timeout=timeout)
            except httpx.TimeoutException as e:
                last = e
                log.warning("%s %s: no answer within %s s (attempt %d of %d)", method, url,
                            timeout, attempt + 1, attempts)
                continue
            except httpx.TransportError as e:
                last = e
                log.warning("%s %s: %s (attempt %d of %d)", method, url, e, attempt + 1, attempts)
                continue
            return _check(r, method, url)
        if isinstance(last, httpx.TimeoutException):
            raise EngineTimeoutError(f"{method} {url} did not complete within {timeout} s "
                                     f"({attempts} attempt(s))") from last
        raise EngineHTTPError(f"{method} {url} failed after {attempts} attempt(s): {last}",
                              None, url) from last

    async def _post_async(self, path: str, body: dict) -> Any:
        url = self.base_url + path
        async with httpx.AsyncClient(headers=self._headers, timeout=self.generate_timeout) as c:
            try:
                r = await c.post(url, json=body)
            except httpx.TimeoutException as e:
                raise EngineTimeoutError(f"POST {url} did not complete within "
                                         f"{self.generate_timeout} s") from e
            except httpx.TransportError as e:
                raise EngineHTTPError(f"POST {url} failed: {e}", None, url) from e
        return _check(r, "POST", url)

    def _check_open(self) -> None:
        if self._stopped:
            raise RuntimeError(f"{type(self).__name__}({self.base_url}) is stopped; call start()")

    def start(self) -> None:
        """Check that the server answers ``GET /health`` with 200 (with retries) and accept
        requests again after :meth:`stop`.

        Raises:
            EngineTimeoutError / EngineHTTPError: the server is unreachable or unhealthy (503).
        """
        self._call("GET", "/health")
        self._stopped = False

    def partial_requests(self, *, require_pause: bool = True) -> list[PartialRequest]:
        """Not available remotely: partial-rollout sync (``proximal.method=partial_sync`` /
        ``dedicated``) shares each request's ``old_logprobs`` list with the engine in-process.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.partial_requests: partial-rollout sync shares each "
            "request's old_logprobs list with an engine in the same process; use a local "
            "InferenceEngine for proximal.method=partial_sync / dedicated"
        )

    def close(self) -> None:
        """Close the HTTP connection pool (the object is unusable afterwards)."""
        self._client.close()


def _sampling_body(params: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # SGLang: -1 disables top-k
        "min_p": params.min_p,
        "ignore_eos": params.ignore_eos,
    }
    if params.stop:
        body["stop"] = list(params.stop)
        # the text of every generated token, as a local engine's (a workflow may look for the stop
        # string, e.g. the calculator tool's "="); SGLang would cut it (slime sends this too)
        body["no_stop_trim"] = True
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        body["sampling_seed"] = params.seed  # SGLang's name; conveyor's server also takes "seed"
    return body


class HttpEngine(_RemoteEngine):
    """An :class:`~conveyor.rollout.engine.protocol.Engine` on a server speaking SGLang's native
    HTTP API: ``conveyor serve`` (verified) or SGLang (same field names; not run here).

    * :meth:`generate` -- ``POST /generate`` with ``input_ids``, ``sampling_params``,
      ``return_logprob: true``, ``return_sampling_mask`` under truncated sampling and a fresh
      ``rid``; the answer is mapped by :func:`sglang_to_generation`.
    * :meth:`update_weights` -- writes the update with :func:`conveyor.sync.write_weights` to
      ``weight_dir/v<version>/model.safetensors`` (temp name, then rename) and calls ``POST
      /update_weights_from_disk {model_path, weight_version}``; the files of older versions this
      client wrote are deleted once the server has loaded a newer one.
    * :meth:`pause` / :meth:`resume` -- ``/pause_generation {"mode": "in_place"}`` /
      ``/continue_generation``; :meth:`abort` -- ``/abort_request``; :meth:`server_version`
      -- ``GET /get_weight_version`` (:attr:`version` is the last version seen, no network
      call); :meth:`stats` -- ``GET /conveyor/stats``.
    * :attr:`model` and :meth:`partial_requests` are local-engine capabilities: any use raises
      ``NotImplementedError``.

    Args:
        base_url: E.g. ``http://127.0.0.1:30000``.
        api_key: Sent as ``Authorization: Bearer <api_key>``.
        weight_dir: A directory the *server* can read at the same path (a shared disk); None:
            a fresh temporary directory on this machine (client and server on one host).
        timeout: Seconds per control call (pause, resume, version, stats, abort, health).
        update_timeout: Seconds for one ``/update_weights_from_disk`` call (the server loads the
            file, then applies it between two decode steps).
        generate_timeout: Seconds for one ``/generate`` call (None: no limit); not retried
            (a retry would generate again).
        retries: Further attempts of a control / update call after a timeout or a connection
            error (HTTP errors are not retried).
        initial_version: The version that SGLang's initial ``weight_version`` ``"default"``
            stands for.

    Raises:
        ValueError: a negative ``retries`` or a timeout <= 0.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        weight_dir: str | Path | None = None,
        timeout: float = 30.0,
        update_timeout: float = 600.0,
        generate_timeout: float | None = 3600.0,
        retries: int = 2,
        initial_version: int = 0,
    ) -> None:
        super().__init__(base_url, api_key=api_key, timeout=timeout,
                         generate_timeout=generate_timeout, retries=retries)
        if not update_timeout > 0:
            raise ValueError(f"update_timeout must be > 0 seconds, got {update_timeout!r}")
        self.update_timeout = float(update_timeout)
        self.initial_version = initial_version
        self._version = initial_version
        self._weight_dir = Path(weight_dir) if weight_dir is not None else None
        self._written: list[Path] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def version(self) -> int:
        """The server's weight version as this client last saw it, without a network call:
        read at :meth:`start`, set by each applied :meth:`update_weights`, and raised to the
        ``weight_version`` of every answer (so updates by another client show up after the next
        generation). :meth:`server_version` asks the server."""
        return self._version

    def server_version(self) -> int:
        """``GET /get_weight_version`` now (a blocking HTTP call); also refreshes
        :attr:`version`.

        Raises:
            EngineTimeoutError / EngineHTTPError: no answer; ValueError: a non-integer version.
        """
        data = self._call("GET", "/get_weight_version")
        v = _version_of(data.get("weight_version"), self.initial_version)
        self._version = v
        return v

    def start(self) -> None:
        """Check ``GET /health`` (200, with retries), read the server's version and accept
        requests again after :meth:`stop`.

        Raises:
            EngineTimeoutError / EngineHTTPError: the server is unreachable or unhealthy (503).
        """
        super().start()
        self.server_version()

    @property
    def weight_dir(self) -> Path:
        """Where :meth:`update_weights` writes (created on first use)."""
        if self._weight_dir is None:
            self._weight_dir = Path(tempfile.mkdtemp(prefix="conveyor-weights-"))
        self._weight_dir.mkdir(parents=True, exist_ok=True)
        return self._weight_dir

    def stop(self) -> None:
        """Abort this client's in-flight requests (they resolve with ``finish_reason="abort"``
        and their tokens) and refuse new ones until :meth:`start`. The server keeps running;
        other clients' requests are untouched. Idempotent."""
        self._stopped = True
        if self._inflight:
            try:
                self.abort()
            except (EngineHTTPError, EngineTimeoutError, EngineRequestError) as e:
                log.warning("%s: aborting in-flight requests at stop failed: %s", self.base_url, e)

    def pause(self) -> None:
        """``POST /pause_generation {"mode": "in_place"}``: no forward pass after the current
        one; requests stay in the server (SGLang keeps their KV cache)."""
        self._call("POST", "/pause_generation", json={"mode": "in_place"})

    def resume(self) -> None:
        """``POST /continue_generation``."""
        self._call("POST", "/continue_generation", json={})

    def abort(self, rids: Sequence[str] | None = None) -> int:
        """``POST /abort_request {rid}`` for each request: it finishes with ``"abort"`` and the
        tokens it has.

        Args:
            rids: Request ids (``meta_info.id``); None: every request this client has in flight.

        Returns:
            The number of requests the server reports aborted (conveyor's server), else the
            number of ids sent.
        """
        rids = list(self._inflight) if rids is None else list(rids)
        total = 0
        for rid in rids:
            data = self._call("POST", "/abort_request", json={"rid": rid})
            total += int(data.get("num_aborted", 1)) if isinstance(data, dict) else 1
        return total

    def stats(self) -> dict[str, Any]:
        """``GET /conveyor/stats`` (the server engine's ``stats()``); from a server without
        that route (SGLang): ``{"version": ..., "base_url": ...}`` only."""
        try:
            return self._call("GET", "/conveyor/stats")
        except EngineHTTPError as e:
            if e.status != 404:
                raise
            return {"version": self.server_version(), "base_url": self.base_url}

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None
    ) -> GenerationOutput:
        """Generate one response on the server (``POST /generate``).

        Args:
            prompt_ids: Prompt token ids (a list or a 1-D tensor).
            params: Sampling parameters (None: ``SamplingParams()``).

        Returns:
            The :class:`GenerationOutput` (see :func:`sglang_to_generation`).

        Raises:
            EngineRequestError (a ValueError): the server refused the request (the message names
                the field), e.g. an out-of-range or too long prompt.
            EngineTimeoutError: no answer within ``generate_timeout``.
            EngineHTTPError / RuntimeError: the server is unreachable, the engine is stopped, or
                this client is stopped.
            ValueError: an answer that does not map back (:func:`sglang_to_generation`).
        """
        self._check_open()
        params = params or SamplingParams()
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.tolist()
        prompt = [int(t) for t in prompt_ids]
        rid = uuid.uuid4().hex
        body = {"input_ids": prompt, "sampling_params": _sampling_body(params),
                "return_logprob": True, "rid": rid}
        if params.truncated:
            body["return_sampling_mask"] = True
        self._inflight.add(rid)
        try:
            data = await self._post_async("/generate", body)
        finally:
            self._inflight.discard(rid)
        out = sglang_to_generation(prompt, data, default_version=self.initial_version)
        meta = data.get("meta_info") or {}
        seen = _version_of(meta.get("weight_version"), self.initial_version)
        self._version = max(self._version, seen, *out.versions)
        return out

    def update_weights(
        self, update: WeightUpdate, *, wait: bool = True
    ) -> concurrent.futures.Future:
        """Publish ``update`` through the shared disk and ``/update_weights_from_disk``.

        Updates are applied in call order (one worker thread). An attempt that times out or
        loses its connection is retried (``retries``); before each retry, and after an error
        answer that follows such an attempt, the server's version is read: if it already equals
        ``update.version``, the update counts as applied (the earlier attempt got through).

        Args:
            update: The weights and their version.
            wait: Block until the server has applied it (default); False returns at once.

        Returns:
            A :class:`concurrent.futures.Future` resolving to None when the server has applied
            the update (already done when ``wait``), or to the error below.

        Raises:
            TypeError: ``update`` is not a :class:`WeightUpdate`.
            EngineTimeoutError: no answer within ``update_timeout`` in ``1 + retries`` attempts
                (the message names the URL and the timeout).
            EngineRequestError: the server refused the update (wrong names / shapes, a version
                that does not increase, an unreadable file).
            OSError: writing the file failed.
        """
        if not isinstance(update, WeightUpdate):
            raise TypeError(f"update must be a WeightUpdate, got {type(update).__name__}")
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="conveyor-http-update")
            fut = self._executor.submit(self._update, update)
        if wait:
            fut.result()
        return fut

    def _server_has(self, version: int) -> bool:
        try:
            return self.server_version() == version
        except (EngineHTTPError, EngineTimeoutError, EngineRequestError, ValueError):
            return False

    def _update(self, update: WeightUpdate) -> None:
        path = write_weights(self.weight_dir / f"v{update.version}", update)
        url = self.base_url + "/update_weights_from_disk"
        body = {"model_path": str(path.resolve()), "weight_version": str(update.version)}
        attempts = 1 + self.retries
        last: Exception | None = None
        for attempt in range(attempts):
            if attempt:
                time.sleep(min(0.25 * 2 ** (attempt - 1), 5.0))
            try:
                r = self._client.post(url, json=body, timeout=self.update_timeout)
            except (httpx.TimeoutException, httpx.TransportError) as e:
                last = e
                log.warning("POST %s (version %d): %s after %s s (attempt %d of %d)", url,
                            update.version, type(e).__name__, self.update_timeout, attempt + 1,
                            attempts)
                if self._server_has(update.version):
                    break
                continue
            if r.is_success and (not r.content.strip() or r.json().get("success", True)):
                break
            if last is not None and self._server_has(update.version):
                break  # an earlier attempt that timed out was applied after all
            msg = _error_message(r)
            if r.status_code in (401, 403, 404) or r.status_code >= 500:
                raise EngineHTTPError(f"POST {url}: weight update to version {update.version} "
                                      f"failed (HTTP {r.status_code}): {msg}", r.status_code, url)
            raise EngineRequestError(f"POST {url}: weight update to version {update.version} "
                                     f"failed (HTTP {r.status_code}): {msg}", r.status_code, url)
        else:
            if isinstance(last, httpx.TimeoutException):
                raise EngineTimeoutError(
                    f"POST {url} (weight update to version {update.version}) did not complete "
                    f"within {self.update_timeout} s ({attempts} attempt(s))") from last
            raise EngineHTTPError(f"POST {url} (weight update to version {update.version}) "
                                  f"failed after {attempts} attempt(s): {last}", None, url) from last
        self._version = max(self._version, update.version)
        old, self._written = self._written, [path]
        for p in old:
            if p != path:
                shutil.rmtree(p, ignore_errors=True)

    def close(self) -> None:
        """Close the connection pool and the update thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        super().close()


class VllmCompletionsEngine(_RemoteEngine):
    """An :class:`~conveyor.rollout.engine.protocol.Engine` on an OpenAI-compatible completions
    server (vLLM's ``/v1/completions``; data plane) and vLLM's RL control routes ``/pause`` /
    ``/resume``: generation only (evaluation), no weight sync. For training with vLLM use
    :class:`conveyor.rollout.engine.vllm.VllmEngine` (``rollout.engine=vllm``), which syncs
    weights, stamps exact versions and is tested against a real vLLM server. This class was
    ``remote.VllmEngine`` before that one existed (import that one from ``conveyor.rollout.engine.vllm``).

    Verified against conveyor's *imitation* of these routes (``conveyor serve``), not against
    vLLM. Requests: ``POST /v1/completions`` with ``prompt`` (token ids), ``max_tokens``,
    ``temperature``, ``top_p``, ``top_k`` (-1 = off), ``min_p``, ``seed``, ``stop``,
    ``stop_token_ids``, ``ignore_eos``, ``logprobs: 0`` and ``return_tokens_as_token_ids:
    true``; the answer's ``choices[0].logprobs.tokens`` (``"token_id:<n>"``) are the token ids,
    ``token_logprobs`` the log-probs, ``finish_reason`` a plain string (AReaL's ``VLLMBackend``
    reads the same fields).

    Differences from :class:`HttpEngine`: vLLM reports no weight versions, so every token is
    stamped with the version this client knew when the request was sent (exact when no update
    lands mid-request; AReaL stamps at abort boundaries instead); vLLM returns no kept sets, and
    its default log-probs are raw (before temperature / truncation), so truncated sampling
    (top-k / top-p / min-p) is refused unless ``allow_truncated``; :meth:`update_weights` is not
    implemented (vLLM moves weights with ``/init_weight_transfer_engine`` +
    ``/update_weights`` over NCCL / IPC, not from disk); :meth:`stop` only refuses new requests
    (in-flight ones run to completion).

    Args:
        base_url: E.g. ``http://127.0.0.1:8000``.
        model: The served model name sent as ``model`` (None: omitted; the server's default).
        api_key: Sent as ``Authorization: Bearer <api_key>``.
        version: The policy version the server's weights have (stamped on tokens).
        timeout / generate_timeout / retries: As :class:`HttpEngine`.
        allow_truncated: Accept truncated sampling (the log-probs are then whatever the server
            returns, with no kept set).

    Raises:
        ValueError: a negative ``retries`` or a timeout <= 0.
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        version: int = 0,
        timeout: float = 30.0,
        generate_timeout: float | None = 3600.0,
        retries: int = 2,
        allow_truncated: bool = False,
    ) -> None:
        super().__init__(base_url, api_key=api_key, timeout=timeout,
                         generate_timeout=generate_timeout, retries=retries)
        self.served_model = model
        self._version = version
        self.allow_truncated = allow_truncated

    @property
    def version(self) -> int:
        """The version this client was told the server's weights have (vLLM reports none)."""
        return self._version

    def stop(self) -> None:
        """Refuse new requests until :meth:`start` (in-flight ones run to completion)."""
        self._stopped = True

    def pause(self) -> None:
        """``POST /pause?mode=keep``: requests stay in the server, generation stops."""
        self._call("POST", "/pause", params={"mode": "keep"})

    def resume(self) -> None:
        """``POST /resume``."""
        self._call("POST", "/resume")

    def stats(self) -> dict[str, Any]:
        """``{"version", "base_url"}`` (vLLM's counters are Prometheus text at ``/metrics``)."""
        return {"version": self._version, "base_url": self.base_url}

    def update_weights(
        self, update: WeightUpdate, *, wait: bool = True
    ) -> concurrent.futures.Future:
        """Not implemented for vLLM.

        Raises:
            NotImplementedError: always (vLLM's weight transfer is
                ``/init_weight_transfer_engine`` + ``/update_weights`` + ``/finish_weight_update``
                over NCCL / IPC; use :class:`HttpEngine` with ``conveyor serve`` or SGLang).
        """
        raise NotImplementedError(
            "VllmCompletionsEngine.update_weights: vLLM loads new weights through its weight-transfer "
            "routes (/init_weight_transfer_engine, /update_weights over NCCL/IPC), which conveyor "
            "does not implement here; use conveyor.rollout.engine.vllm.VllmEngine (rollout.engine=vllm)"
        )

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None
    ) -> GenerationOutput:
        """Generate one response (``POST /v1/completions``, token-id prompt).

        Returns:
            A :class:`GenerationOutput` with the ids parsed from ``"token_id:<n>"``, the
            ``token_logprobs``, ``versions`` = this client's version at submission, no kept set.

        Raises:
            ValueError: truncated sampling without ``allow_truncated``; an answer without
                token-id tokens / log-probs or with an unknown finish reason.
            EngineRequestError / EngineTimeoutError / EngineHTTPError / RuntimeError: as
                :meth:`HttpEngine.generate`.
        """
        self._check_open()
        params = params or SamplingParams()
        if params.truncated and not self.allow_truncated:
            raise ValueError(
                "VllmCompletionsEngine: vLLM returns no kept sets for top_k / top_p / min_p sampling (and "
                "raw log-probs by default), so the trainer could not replay them; sample "
                "without truncation or pass allow_truncated=True")
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.tolist()
        prompt = [int(t) for t in prompt_ids]
        version = self._version
        body: dict[str, Any] = {
            "prompt": prompt, "max_tokens": params.max_new_tokens,
            "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1, "min_p": params.min_p,
            "ignore_eos": params.ignore_eos, "logprobs": 0,
            "return_tokens_as_token_ids": True, "skip_special_tokens": True,
        }
        if self.served_model is not None:
            body["model"] = self.served_model
        if params.stop:
            body["stop"] = list(params.stop)
            body["include_stop_str_in_output"] = True  # the text of every token, as a local engine's
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            body["seed"] = params.seed
        data = await self._post_async("/v1/completions", body)
        try:
            choice = data["choices"][0]
            lp = choice["logprobs"]
            tokens, values = lp["tokens"], lp["token_logprobs"]
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(f"not a completions answer with logprobs (missing {e})") from None
        ids = []
        for t in tokens:
            if not isinstance(t, str) or not t.startswith("token_id:"):
                raise ValueError(f"logprobs.tokens entry {t!r} is not 'token_id:<n>' (does the "
                                 "server honour return_tokens_as_token_ids?)")
            ids.append(int(t.split(":", 1)[1]))
        if len(values) != len(ids) or any(v is None for v in values):
            raise ValueError("logprobs.token_logprobs must hold one number per token")
        reason = choice.get("finish_reason")
        if reason not in _FINISH:
            raise ValueError(f"finish_reason {reason!r}: expected stop, length or abort")
        return GenerationOutput(
            prompt_ids=prompt, token_ids=ids, logprobs=[float(v) for v in values],
            versions=[version] * len(ids), finish_reason=reason,
            text=str(choice.get("text") or ""), num_interruptions=0,
        )

