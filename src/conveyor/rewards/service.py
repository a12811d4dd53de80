"""The reward service: scores finished responses in parallel, off the calling thread, with timeouts.

A reward function (``RewardFn = (response, sample) -> float``) is user code that can raise, hang,
or return garbage. :class:`RewardService` turns every one of those into a failed
:class:`RewardResult` (score = the configured failure score) instead of an exception in the
rollout loop, counts it in :attr:`RewardService.stats` and logs it.

Why worker *processes* by default (``backend="process"``): a timeout must be able to stop a
CPU-bound hang, and a thread cannot be stopped. Worse, a hang inside C code that holds the GIL
freezes every thread of the process: ``math_verify.verify`` on the model output
``\\boxed{9^{9^{9^{9}}}}`` computes a ~370-million-digit integer and, run in a thread, froze the
whole interpreter (event loop and watchdogs included) for over 40 s in our tests. A worker
process that overruns its ``timeout_s`` is killed (SIGKILL) and replaced. The cost: the reward
function and its arguments must be picklable (a module-level function or an import path string,
not a lambda or closure) and each worker start imports the reward module (about 0.5 s for the
built-in math rewards; it happens in the background, once per worker and after each kill, and is
not counted in the timeout).

``backend="thread"`` runs the function in threads instead (for unpicklable functions, e.g. a
closure over an HTTP client for an LLM judge, whose time is spent waiting on I/O). A timed-out
call's thread cannot be killed: it is abandoned (it exits when the call eventually returns) and a
fresh thread takes its slot, so stuck calls never exhaust the pool; ``stats["abandoned_threads"]``
counts the abandoned threads still running. A GIL-holding hang still freezes the process in this
backend.

Dispatch: ``max_workers`` dispatcher threads take calls from one queue in order; each owns one
worker (process or thread). The timeout clock starts when the worker receives the call, so time
spent waiting in the queue never counts as a timeout.

Metrics: besides the reward, a service can compute named *metrics* of each response (``metrics=``,
e.g. :data:`ANSWER_METRICS`: answer correctness and format for the accuracy figures) in the same
worker call, under the same timeout. Every call into answer checking goes through a service for
this reason: the rollout workflow and :func:`conveyor.eval.evaluate` read correctness from
:attr:`RewardResult.metrics` and never call the checker in their own process (issue 10, section 3:
``asyncio.to_thread(correctness_reward, ...)`` on ``\\boxed{9^{9^{9^{9}}}}`` froze the engine,
controller and trainer for 150 s). A metric whose function raised, returned a non-number, or whose
call timed out or crashed is ``None`` ("unknown") and counted in ``stats["metric_failures"]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import numbers
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

from conveyor.rewards.math import RewardFn, load_reward_fn
from conveyor.types import Sample

logger = logging.getLogger(__name__)

Backend = Literal["process", "thread"]
_START_METHODS = ("spawn", "forkserver", "fork")

ANSWER_METRICS: dict[str, str] = {"correct": "correctness", "format_ok": "format"}
"""The metrics the rollout workflow and the evaluation read (``RewardService(..., metrics=
ANSWER_METRICS)``): ``correct`` is :func:`conveyor.rewards.correctness_reward` (in [0, 1]; a
response counts as correct at 1.0) and ``format_ok`` is :func:`conveyor.rewards.format_reward`
(0.0 or 1.0)."""


@dataclass(frozen=True)
class RewardResult:
    """The outcome of one reward call.

    Attributes:
        score: The reward (the function's return value as a float), or the service's
            ``failure_score`` when the call failed.
        failed: True when the function raised, timed out, returned a non-numeric or non-finite
            value, its worker died, or the service was closed before the call ran.
        error: A one-line description of the failure (exception type and message, ``"timeout
            after 0.2 s"``, ...); None on success.
        elapsed_s: Seconds the reward function (and the metrics) ran (from hand-over to the
            worker until its answer or the timeout), excluding time spent waiting in the queue or
            for a worker process to start.
        metrics: One value per metric the service was configured with (``metrics=``): the metric
            function's return value as a float, or None ("unknown") when it raised, returned a
            non-numeric or non-finite value, or the call timed out, crashed or was cancelled.
            Empty for a service without metrics.
    """

    score: float
    failed: bool
    error: str | None
    elapsed_s: float
    metrics: Mapping[str, float | None] = field(default_factory=dict, hash=False)


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return text if len(text) <= 500 else text[:497] + "..."


def _invoke(fn: RewardFn, response: str, sample: Sample) -> tuple[str, Any]:
    """Run ``fn`` and classify the outcome as ``("ok", float)``, ``("invalid", str)`` or
    ``("error", str)``; never raises."""
    try:
        value = fn(response, sample)
    except BaseException as exc:  # noqa: BLE001 - SystemExit from user code is a failure too
        logger.debug("reward function raised", exc_info=True)
        return "error", _describe(exc) + "\n" + traceback.format_exc(limit=-3)
    if isinstance(value, numbers.Real):
        return "ok", float(value)
    return (
        "invalid",
        f"reward function returned {type(value).__name__} {value!r:.100}, not a number",
    )


_MetricFns = tuple[tuple[str, RewardFn], ...]
# what one call returns from a worker: (kind, detail, metric values, metric errors)
_Outcome = tuple[str, Any, dict[str, float | None], dict[str, str]]


def _evaluate(
    fn: RewardFn, metric_fns: _MetricFns, response: str, sample: Sample, with_reward: bool = True
) -> _Outcome:
    """The reward (:func:`_invoke`; skipped when ``with_reward`` is False), then every metric; a
    metric function that is the reward function itself reuses the reward's value (no second
    call). Never raises."""
    kind, detail = _invoke(fn, response, sample) if with_reward else ("ok", 0.0)
    values: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    for name, mfn in metric_fns:
        if mfn is fn and with_reward:
            mkind, mdetail = kind, detail
        else:
            mkind, mdetail = _invoke(mfn, response, sample)
        if mkind == "ok" and math.isfinite(mdetail):
            values[name] = mdetail
        else:
            values[name] = None
            if mfn is not fn or not with_reward:  # else reported as the reward's failure
                text = str(mdetail) if mkind != "ok" else f"returned a non-finite value ({mdetail})"
                errors[name] = (text.splitlines() or [mkind])[0]
    return kind, detail, values, errors


# --------------------------------------------------------------------------- process workers


_Payload = tuple[bytes | str, tuple[tuple[str, bytes | str], ...]]


def _load(payload: bytes | str) -> RewardFn:
    return load_reward_fn(payload) if isinstance(payload, str) else pickle.loads(payload)


def warm_up(fns: Sequence[Any]) -> None:
    """Call the ``warm_up()`` of each function in ``fns`` that has one, once per distinct hook: a
    reward or metric function's optional hook for slow one-time set-up (e.g. the style judge's
    model, :mod:`conveyor.rewards.styles`). The service runs it while a worker starts (within
    ``start_timeout_s``), so the set-up never counts against the first call's ``timeout_s``,
    whether the function was given as an object or as an import path.

    Raises:
        Exception: whatever a hook raises (a worker reports it as a start error).
    """
    seen: set[int] = set()
    for f in fns:
        hook = getattr(f, "warm_up", None)
        if callable(hook) and id(hook) not in seen:
            seen.add(id(hook))
            hook()


def _child_main(conn: Any, payload: _Payload) -> None:
    """Entry point of a worker process: load the reward and metric functions and run their
    :func:`warm_up` hooks, then serve calls until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    try:
        fn = _load(payload[0])
        metric_fns = tuple((name, _load(p)) for name, p in payload[1])
        warm_up([fn, *(f for _, f in metric_fns)])
    except BaseException as exc:  # noqa: BLE001
        conn.send(("start_error", _describe(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        reply = _evaluate(fn, metric_fns, *msg)
        try:
            conn.send(reply)
        except (OSError, ValueError):
            return


class _WorkerStartError(RuntimeError):
    pass


@contextlib.contextmanager
def _sigint_ignored_for_children() -> Iterator[None]:
    """Processes started inside ignore SIGINT from their first instruction (an ignored signal
    stays ignored across ``exec``, and Python then installs no ``KeyboardInterrupt`` handler): a
    Ctrl-C that reaches the whole process group while a worker still imports its reward module
    (math-verify's parser, seconds) printed a ``KeyboardInterrupt`` traceback from it (fresh-user
    trial 5). Only the main thread may change a handler; elsewhere this does nothing (the worker
    ignores SIGINT once its entry point runs). The parent's own Ctrl-C is not lost: SIGINT is
    blocked meanwhile, so one that arrives stays pending and is delivered when the handler is
    back."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class _ProcessWorker:
    """One worker process, restarted after a timeout or a crash."""

    def __init__(self, payload: _Payload, ctx: Any, start_timeout_s: float, name: str):
        self._payload = payload
        self._ctx = ctx
        self._start_timeout_s = start_timeout_s
        self._name = name
        self._proc: Any = None
        self._conn: Any = None
        self._ready = False  # the process said "ready" (spawned processes may still be loading)
        self.restarts = 0

    def spawn(self) -> None:
        """Start a new process without waiting for it to load (:meth:`ensure_started` waits);
        from the main thread it ignores SIGINT from its start (:func:`_sigint_ignored_for_children`)."""
        self._kill()
        parent_conn, child_conn = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=_child_main, args=(child_conn, self._payload), name=self._name, daemon=True
        )
        with _sigint_ignored_for_children():
            proc.start()
        child_conn.close()
        self._proc, self._conn, self._ready = proc, parent_conn, False

    def ensure_started(self) -> None:
        if self._proc is not None and self._ready and self._proc.is_alive():
            return
        if self._proc is None or self._ready:  # none yet, or a ready one that died: a new one
            self.spawn()
        proc, parent_conn = self._proc, self._conn
        try:
            if not parent_conn.poll(self._start_timeout_s):
                raise _WorkerStartError(
                    f"reward worker process not ready within {self._start_timeout_s} s"
                )
            kind, detail = parent_conn.recv()
        except (EOFError, OSError) as exc:
            proc.join(1.0)
            self._kill()
            raise _WorkerStartError(
                f"reward worker process exited while starting (exit code {proc.exitcode})"
            ) from exc
        except _WorkerStartError:
            self._kill()
            raise
        if kind != "ready":
            self._kill()
            raise _WorkerStartError(f"reward worker could not load the reward function: {detail}")
        self._ready = True

    def run(self, call: _Call, timeout_s: float) -> tuple[_Outcome, float]:
        self.ensure_started()
        t0 = time.monotonic()
        try:
            self._conn.send((call.response, call.sample, call.with_reward))
        except Exception as exc:  # pickling error: nothing was written, the worker is fine
            message = f"could not send the call to the worker: {_describe(exc)}"
            return ("error", message, {}, {}), 0.0
        if not self._conn.poll(timeout_s):
            self._kill()
            self.restarts += 1
            message = f"timeout after {timeout_s:g} s (worker process killed)"
            return ("timeout", message, {}, {}), time.monotonic() - t0
        try:
            outcome = self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.exitcode if self._proc is not None else None
            self._kill()
            self.restarts += 1
            message = f"reward worker process died (exit code {code})"
            return ("error", message, {}, {}), time.monotonic() - t0
        return outcome, time.monotonic() - t0

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(5.0)
            self._proc = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send(None)
            except (OSError, ValueError):
                pass
        if self._proc is not None:
            self._proc.join(0.5)
        self._kill()


# --------------------------------------------------------------------------- thread workers


class _Box:
    __slots__ = ("done", "outcome")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.outcome: _Outcome = ("error", "no outcome", {}, {})


def _helper_loop(fn: RewardFn, metric_fns: _MetricFns, inbox: queue.SimpleQueue) -> None:
    while True:
        item = inbox.get()
        if item is None:
            return
        call, box = item
        box.outcome = _evaluate(fn, metric_fns, call.response, call.sample, call.with_reward)
        box.done.set()


class _ThreadWorker:
    """One helper thread; on a timeout it is abandoned and replaced by a fresh one."""

    def __init__(self, fn: RewardFn, metric_fns: _MetricFns, name: str):
        self._fn = fn
        self._metric_fns = metric_fns
        self._name = name
        self.abandoned: list[threading.Thread] = []  # rebound, never mutated: safe to read
        self._thread: threading.Thread | None = None
        self._inbox: queue.SimpleQueue | None = None

    def ensure_started(self) -> None:
        if self._thread is None:
            try:  # once per process in effect: a hook caches what it loads
                warm_up([self._fn, *(f for _, f in self._metric_fns)])
            except Exception as exc:  # noqa: BLE001
                raise _WorkerStartError(f"reward worker could not warm up: {_describe(exc)}") from exc
            self._inbox = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=_helper_loop,
                args=(self._fn, self._metric_fns, self._inbox),
                name=self._name,
                daemon=True,
            )
            self._thread.start()

    def run(self, call: _Call, timeout_s: float) -> tuple[_Outcome, float]:
        self.ensure_started()
        assert self._inbox is not None and self._thread is not None
        box = _Box()
        t0 = time.monotonic()
        self._inbox.put((call, box))
        if box.done.wait(timeout_s):
            return box.outcome, time.monotonic() - t0
        # Abandon the stuck thread: it exits by itself once the call returns.
        self._inbox.put(None)
        self.abandoned = [t for t in self.abandoned if t.is_alive()] + [self._thread]
        self._thread, self._inbox = None, None
        message = f"timeout after {timeout_s:g} s (thread abandoned)"
        return ("timeout", message, {}, {}), time.monotonic() - t0

    def close(self) -> None:
        if self._inbox is not None:
            self._inbox.put(None)
        self._thread, self._inbox = None, None


# --------------------------------------------------------------------------- the service


class _Call:
    __slots__ = ("response", "sample", "with_reward", "future")

    def __init__(self, response: str, sample: Sample, with_reward: bool = True):
        self.response = response
        self.sample = sample
        self.with_reward = with_reward
        self.future: Future[RewardResult] = Future()


class RewardService:
    """Runs a reward function with timeouts and failure handling, in parallel workers.

    See the module docstring for the process / thread backends. Use as a context manager or call
    :meth:`close`.

    Args:
        reward_fn: The reward function ``(response, sample) -> float``, or a name / import path
            accepted by :func:`conveyor.rewards.load_reward_fn` (``"math"``,
            ``"pkg.module:function"``).
        timeout_s: Seconds one call may run before it fails with a timeout (> 0).
        failure_score: The score reported for a failed call (finite).
        max_workers: Number of calls run at the same time (>= 1).
        max_abs_score: A reward whose absolute value exceeds this (> 0) is invalid (a failed
            call, counted in ``invalid``): one value like ``1e300`` would overflow the float32
            advantages of its whole batch (issue 10, section 6). Default 1e6.
        backend: ``"process"`` (default; killable, needs a picklable function) or ``"thread"``.
        start_method: multiprocessing start method for the process backend (``"spawn"``, the
            default, is safe in a process that already runs threads; ``"forkserver"``, ``"fork"``).
        start_timeout_s: Seconds a worker process may take to start and load the function (> 0).
        metrics: Named metric functions (same signature and forms as ``reward_fn``) computed in
            the same worker call as the reward, after it and within the same ``timeout_s``; their
            values are :attr:`RewardResult.metrics` (None when unknown, see there). A metric
            that names the reward function itself reuses the reward's value. E.g.
            :data:`ANSWER_METRICS`.

    Raises:
        ValueError: If a numeric argument, ``backend`` or ``start_method`` is invalid (the
            message names the argument), or ``reward_fn`` or a metric is a path that cannot be
            loaded.
        TypeError: If ``reward_fn`` or a metric is not callable, or (process backend) cannot be
            pickled.
    """

    def __init__(
        self,
        reward_fn: RewardFn | str,
        *,
        timeout_s: float = 10.0,
        failure_score: float = 0.0,
        max_workers: int = 2,
        backend: Backend = "process",
        start_method: str = "spawn",
        start_timeout_s: float = 120.0,
        metrics: Mapping[str, RewardFn | str] | None = None,
        max_abs_score: float = 1e6,
    ):
        _check_positive("timeout_s", timeout_s)
        _check_positive("max_abs_score", max_abs_score)
        _check_positive("start_timeout_s", start_timeout_s)
        if (
            isinstance(failure_score, bool)
            or not isinstance(failure_score, int | float)
            or not math.isfinite(failure_score)
        ):
            raise ValueError(f"failure_score must be a finite number, got {failure_score!r}")
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
        if backend not in ("process", "thread"):
            raise ValueError(f"backend must be 'process' or 'thread', got {backend!r}")
        if start_method not in _START_METHODS:
            raise ValueError(f"start_method must be one of {_START_METHODS}, got {start_method!r}")
        fn = load_reward_fn(reward_fn) if isinstance(reward_fn, str) else reward_fn
        if not callable(fn):
            raise TypeError(
                f"reward_fn must be callable or an import path, got {type(fn).__name__}"
            )
        metric_specs = dict(metrics or {})
        metric_fns: list[tuple[str, RewardFn]] = []
        for mname, spec in metric_specs.items():
            if not isinstance(mname, str) or not mname:
                raise ValueError(f"metrics: names must be non-empty str, got {mname!r}")
            mfn = load_reward_fn(spec) if isinstance(spec, str) else spec
            if not callable(mfn):
                raise TypeError(
                    f"metrics[{mname!r}] must be callable or an import path, "
                    f"got {type(mfn).__name__}"
                )
            metric_fns.append((mname, mfn))

        self.reward_fn: RewardFn = fn
        self.metric_names: tuple[str, ...] = tuple(n for n, _ in metric_fns)
        self.timeout_s = float(timeout_s)
        self.failure_score = float(failure_score)
        self.max_abs_score = float(max_abs_score)
        self.max_workers = max_workers
        self.backend: Backend = backend
        self._lock = threading.Lock()
        self._counts = {
            "calls": 0,
            "failures": 0,
            "timeouts": 0,
            "exceptions": 0,
            "invalid": 0,
            "cancelled": 0,
            "metric_failures": 0,
        }
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._closed = False

        name = getattr(fn, "__qualname__", type(fn).__name__)
        if backend == "process":
            payload: _Payload = (
                _payload(reward_fn, fn, "reward_fn"),
                tuple(
                    (n, _payload(metric_specs[n], f, f"metrics[{n!r}]")) for n, f in metric_fns
                ),
            )
            ctx = multiprocessing.get_context(start_method)
            self._workers: list[Any] = [
                _ProcessWorker(payload, ctx, start_timeout_s, f"reward-{name}-{i}")
                for i in range(max_workers)
            ]
            if threading.current_thread() is threading.main_thread():
                for w in self._workers:  # started here, SIGINT-proof; the dispatchers wait for them
                    w.spawn()
        else:
            self._workers = [
                _ThreadWorker(fn, tuple(metric_fns), f"reward-{name}-{i}")
                for i in range(max_workers)
            ]
        self._started = [threading.Event() for _ in self._workers]
        self._dispatchers = [
            threading.Thread(
                target=self._dispatch_loop,
                args=(w, started),
                name=f"reward-dispatch-{i}",
                daemon=True,
            )
            for i, (w, started) in enumerate(zip(self._workers, self._started, strict=True))
        ]
        for t in self._dispatchers:
            t.start()

    # ------------------------------------------------------------------ public API

    async def score(self, response: str, sample: Sample) -> RewardResult:
        """Score one response without blocking the event loop.

        Args:
            response: The response text.
            sample: The sample it answers.

        Returns:
            The :class:`RewardResult`; reward-function failures are reported in it, never raised.

        Raises:
            TypeError: If ``response`` is not a str or ``sample`` not a :class:`Sample`.
            RuntimeError: If the service is closed.
        """
        return await asyncio.wrap_future(self._submit(response, sample))

    def score_sync(self, response: str, sample: Sample) -> RewardResult:
        """Score one response, blocking the calling thread (at most about ``timeout_s`` plus
        queue and worker start-up time).

        Args and Returns and Raises: as :meth:`score`.
        """
        return self._submit(response, sample).result()

    def score_many(self, items: Iterable[tuple[str, Sample]]) -> list[RewardResult]:
        """Score many ``(response, sample)`` pairs in parallel (``max_workers`` at a time).

        Args:
            items: The pairs to score.

        Returns:
            One :class:`RewardResult` per pair, in input order.

        Raises:
            TypeError: If an item is not a ``(str, Sample)`` pair (the message gives its index).
            RuntimeError: If the service is closed.
        """
        pairs = _check_items(items)
        futures = [self._submit(r, s) for r, s in pairs]
        return [f.result() for f in futures]

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until every worker has made its first start attempt (process backend: the
        process is running and has loaded the reward and metric functions, or failed to).

        Args:
            timeout_s: Seconds to wait at most (None: no limit).

        Returns:
            Whether every worker got that far within ``timeout_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for event in self._started:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not event.wait(left):
                return False
        return True

    def check_many(self, items: Iterable[tuple[str, Sample]]) -> list[dict[str, float | None]]:
        """Compute only the metrics (not the reward function) of many ``(response, sample)``
        pairs, in parallel worker calls with the same timeout: e.g. an evaluation's answer checks
        on a training run's service, whose own reward function may be slow or flaky.

        Args:
            items: The pairs to check.

        Returns:
            One ``{metric name: value or None}`` per pair, in input order (None: unknown, see
            :attr:`RewardResult.metrics`).

        Raises:
            TypeError: If an item is not a ``(str, Sample)`` pair (the message gives its index).
            ValueError: If the service has no metrics.
            RuntimeError: If the service is closed.
        """
        if not self.metric_names:
            raise ValueError("check_many: this RewardService computes no metrics (metrics=)")
        pairs = _check_items(items)
        futures = [self._submit(r, s, with_reward=False) for r, s in pairs]
        return [dict(f.result().metrics) for f in futures]

    @property
    def stats(self) -> dict[str, int]:
        """Counters since construction: ``calls`` (finished worker calls, :meth:`check_many`'s
        included), ``failures`` (= timeouts + exceptions + invalid + cancelled), ``timeouts``,
        ``exceptions`` (raised, or worker died), ``invalid`` (non-numeric or non-finite reward),
        ``cancelled`` (dropped by :meth:`close`), ``metric_failures`` (metric values that came
        back unknown, None: every metric of a call that timed out, crashed or was cancelled, and
        each metric function that raised or returned a non-number), ``worker_restarts`` (process
        backend: workers killed after a timeout or crash) and ``abandoned_threads`` (thread
        backend: timed-out threads still running)."""
        with self._lock:
            out = dict(self._counts)
        out["worker_restarts"] = sum(getattr(w, "restarts", 0) for w in self._workers)
        out["abandoned_threads"] = sum(
            t.is_alive() for w in self._workers for t in getattr(w, "abandoned", ())
        )
        return out

    def close(self, wait: bool = True) -> None:
        """Stop the service. Calls still queued finish as failed (``"service closed"``); calls
        already running finish normally (each within ``timeout_s``). Idempotent.

        Args:
            wait: Block until the running calls are done and the workers are stopped
                (at most about ``timeout_s`` + 6 s).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while True:
            try:
                call = self._queue.get_nowait()
            except queue.Empty:
                break
            if call is not None and call.future.set_running_or_notify_cancel():
                outcome = ("cancelled", "service closed", {}, {})
                call.future.set_result(self._result(call, outcome, 0.0))
        for _ in self._dispatchers:
            self._queue.put(None)
        if wait:
            for t in self._dispatchers:
                t.join(self.timeout_s + 6.0)

    def __enter__(self) -> RewardService:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _submit(
        self, response: str, sample: Sample, with_reward: bool = True
    ) -> Future[RewardResult]:
        _check_call_args(response, sample)
        call = _Call(response, sample, with_reward)
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardService is closed")
            self._queue.put(call)
        return call.future

    def _dispatch_loop(self, worker: Any, started: threading.Event) -> None:
        try:
            worker.ensure_started()
        except Exception:  # reported on the first call, which retries the start
            logger.warning("reward worker failed to start", exc_info=True)
        finally:
            started.set()
        while True:
            call = self._queue.get()
            if call is None:
                worker.close()
                return
            if not call.future.set_running_or_notify_cancel():
                continue  # cancelled while queued (e.g. its asyncio task was cancelled)
            try:
                outcome, elapsed = worker.run(call, self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - e.g. the worker could not start
                outcome, elapsed = ("error", _describe(exc), {}, {}), 0.0
            call.future.set_result(self._result(call, outcome, elapsed))
            if not self._closed:
                try:  # restart a killed worker now rather than on the next call
                    worker.ensure_started()
                except Exception:
                    logger.warning("reward worker failed to restart", exc_info=True)

    def _result(self, call: _Call, outcome: _Outcome, elapsed: float) -> RewardResult:
        kind, detail, got, metric_errors = outcome
        if kind == "ok" and call.with_reward and not math.isfinite(detail):
            kind, detail = "invalid", f"reward function returned a non-finite value ({detail})"
        elif kind == "ok" and call.with_reward and abs(detail) > self.max_abs_score:
            kind, detail = "invalid", (f"reward function returned {detail:g}, beyond "
                                       f"max_abs_score={self.max_abs_score:g} (reward.max_abs)")
        counter = {
            "ok": None,
            "timeout": "timeouts",
            "invalid": "invalid",
            "cancelled": "cancelled",
        }.get(kind, "exceptions")
        # a call that never finished (timeout, dead worker, cancelled) has no metric values
        metrics = {n: got.get(n) for n in self.metric_names}
        unknown = sum(v is None for v in metrics.values())
        with self._lock:
            self._counts["calls"] += 1
            self._counts["metric_failures"] += unknown
            if counter is not None:
                self._counts["failures"] += 1
                self._counts[counter] += 1
        for mname, err in metric_errors.items():
            logger.warning("reward metric %r failed for sample %r: %s", mname, call.sample.id, err)
        if counter is None:
            return RewardResult(
                score=float(detail), failed=False, error=None, elapsed_s=elapsed, metrics=metrics
            )
        message = str(detail)
        logger.warning(
            "%s %s for sample %r after %.3f s: %s",
            "reward" if call.with_reward else "metric check",
            counter,
            call.sample.id,
            elapsed,
            message,
        )
        first_line = message.splitlines()[0] if message else counter
        return RewardResult(
            score=self.failure_score,
            failed=True,
            error=first_line,
            elapsed_s=elapsed,
            metrics=metrics,
        )


def _payload(spec: RewardFn | str, fn: RewardFn, what: str) -> bytes | str:
    """What a worker process loads: the import path itself, or the pickled function."""
    if isinstance(spec, str):
        return spec
    try:
        return pickle.dumps(fn)
    except Exception as exc:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise TypeError(
            f"{what} {name!r} cannot be pickled for the process backend "
            f"({_describe(exc)}); use a module-level function, an import path "
            "string, or RewardService(..., backend='thread')"
        ) from exc


def _check_positive(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"{name} must be a finite number > 0 (seconds), got {value!r}")


def _check_items(items: Iterable[Any]) -> list[tuple[str, Sample]]:
    pairs = list(items)
    for i, item in enumerate(pairs):
        if not isinstance(item, tuple) or len(item) != 2:
            raise TypeError(f"items[{i}] must be a (response, sample) tuple, got {item!r:.100}")
        _check_call_args(item[0], item[1], where=f"items[{i}]")
    return pairs


def _check_call_args(response: Any, sample: Any, where: str = "") -> None:
    prefix = f"{where}: " if where else ""
    if not isinstance(response, str):
        raise TypeError(f"{prefix}response must be a str, got {type(response).__name__}")
    if not isinstance(sample, Sample):
        raise TypeError(
            f"{prefix}sample must be a conveyor.types.Sample, got {type(sample).__name__}"
        )
