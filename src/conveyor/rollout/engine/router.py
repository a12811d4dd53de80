"""Several inference engines behind one :class:`~conveyor.rollout.engine.Engine`: the
:class:`EngineRouter` (``rollout.num_engines``, issue 12 section 3).

The rollout controller, the staleness rule and the workflows see one engine, so their semantics
do not change with the number of engines: AReaL's capacity rule counts trajectories, not
engines, and every token carries the version of the weights that produced it whichever engine
generated it. What the router adds:

* **Routing** (a simplified form of the SGLang router's cache-aware policy and of verl's sticky
  sessions): a request goes to the engine with the fewest requests in flight (ties: the lowest
  index), except that a request whose prompt the router has seen (the other responses of a GRPO
  group) or whose prompt extends a generation it routed (the next turn of a tool or agent
  episode: ``prompt + response + observation``) goes to the engine that served it, so that
  engine's prefix cache and identical-prompt prefill deduplication apply, as long as that engine
  has at most ``affinity_slack`` more requests in flight than the least loaded one. An episode's
  earlier turn is recognised by the length and the last ``AFFINITY_TAIL`` tokens of its prompt +
  response (a false match only misroutes). Routing changes speed, not the sampling distribution;
  the sampled tokens do depend on it (each engine draws from its own random streams, in arrival
  order), so a run with several engines is not reproducible token for token.
* **Weights** go to every engine (:meth:`update_weights`; the future resolves when all have
  them); :attr:`version` is the lowest version among the engines.
* **Control**: start / stop / pause / resume reach every engine (in parallel); :meth:`stats` sums
  the counters (``num_engines`` and the per-engine ``engines`` list added; ``busy_seconds`` is the
  sum of engine-seconds, which :class:`~conveyor.runtime.record.RunClock` divides by
  ``num_engines``). :meth:`waiting_requests` estimates the engines' queues from the router's own
  counts, without asking the engines (the controller's engine-aware admission calls it on its
  event loop).
* **Faults**: an engine that raises :class:`EngineDiedError` (its process is gone: a Ray engine
  actor) is replaced by ``restart(index, update)`` (``max_restarts`` times per router), built at
  the newest weights the router has sent. The slot leaves rotation at the first sign of death
  and the replacement starts in the background (a Ray actor takes seconds), so the requests it
  had in flight are generated again at once on a live engine (``router_resubmitted``); only when
  no engine is live do they wait for the replacement. :meth:`stop` waits for a replacement still
  starting (``replace_timeout_s``); ``stats()["engines"][i]["state"]`` is ``live``,
  ``replacing`` or ``dead``. A request lost with an engine is regenerated from its
  prompt: its tokens are sampled anew at the current version (never a mixture of two attempts).
  An engine that fails otherwise (a crashed decode thread raises RuntimeError) fails its requests,
  as a single engine would: a crash is surfaced, not routed around.

Old-log-prob scoring of partial requests (``proximal.method=partial_sync`` / ``dedicated``):
:meth:`partial_requests` gathers every engine's (request keys are unique across engines) and
:meth:`score_old_logprobs` splits the items over the paused engines, which score in parallel. The
requests of an engine that dies are generated again (new keys); its finished requests not yet
collected are lost to the next publish's scoring and counted as missing
(``proximal/partial_sync_missing_frac``). Not supported with more than one engine: elastic
threads (``rollout.elastic_threads``, refused by the config).
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from conveyor.rollout.engine.types import GenerationOutput, SamplingParams

log = logging.getLogger(__name__)

__all__ = ["AFFINITY_TAIL", "CUMULATIVE_ENGINE_STATS", "EngineDiedError", "EngineRouter", "engine_seed",
           "merge_engine_stats"]

AFFINITY_TAIL = 32
"""Tokens at the end of a routed prompt + response that (with its length) identify it when a later
prompt extends it (an episode's next turn)."""

_AFFINITY_SCAN = 64
"""Remembered lengths below a prompt's length checked for an earlier turn, longest first."""

CUMULATIVE_ENGINE_STATS = frozenset({
    "busy_seconds", "prefill_seconds", "sample_seconds", "generated_tokens", "prefill_tokens", "reencoded_tokens",
    "decode_steps", "num_requests", "num_finished", "num_aborted", "num_weight_updates", "weight_load_seconds",
    "pause_seconds_total", "merge_seconds", "prefix_cache_hits", "prefix_cache_hit_tokens", "prefill_dedup_tokens",
    "prefill_forwards", "thread_changes", "prefix_hits_joined", "prefix_fed_tokens", "reencode_prefix_tokens", "lends", "lent_seconds", "reclaims",
    "reclaim_wait_seconds", "reclaim_timeouts"})
"""Counters of :meth:`InferenceEngine.stats <conveyor.rollout.engine.InferenceEngine.stats>` that
only grow; a replaced engine's last values are added to its successor's, so they never go back."""


def engine_seed(run_seed: int, version: int, index: int) -> int:
    """Sampling seed of engine ``index`` of a run started (or resumed) at ``version``:
    ``run_seed + version + 1_000_003 * index`` (engine 0's is the single engine's, so a run with
    one engine samples as before; each further engine draws other random streams)."""
    return run_seed + version + 1_000_003 * index


class EngineDiedError(RuntimeError):
    """An engine's process is gone (e.g. a Ray engine actor was killed): the request or call did
    not complete there. An :class:`EngineRouter` replaces the engine and runs the request again."""


def merge_engine_stats(stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counters of several engines as one engine's.

    Args:
        stats: One :meth:`~conveyor.rollout.engine.Engine.stats` dict per engine.

    Returns:
        Numbers summed (counters and the gauges ``running`` / ``waiting`` /
        ``prefix_cache_tokens`` / ``num_threads``), ``version`` the lowest, booleans true only
        when true on every engine (``paused``), strings from the first engine (``dtype``), and the
        profiles (``decode_profile``: ``{batch size: [steps, seconds]}``, ``prefill_profile``)
        merged by summing each entry.
    """
    out: dict[str, Any] = {}
    for st in stats:
        for k, v in st.items():
            if k == "version":
                out[k] = min(out.get(k, v), v)
            elif isinstance(v, bool):
                out[k] = out.get(k, True) and v
            elif isinstance(v, (int, float)):
                out[k] = out.get(k, 0) + v
            elif isinstance(v, dict) and k.endswith("_profile"):
                merged = out.setdefault(k, {})
                for key, row in v.items():
                    if key in merged:
                        merged[key] = [a + b for a, b in zip(merged[key], row, strict=True)]
                    else:
                        merged[key] = list(row)
            else:
                out.setdefault(k, v)
    return out


class EngineRouter:
    """One :class:`~conveyor.rollout.engine.Engine` over several (module docstring).

    Args:
        engines: The engines (at least one), all at the same version with the same weights.
        restart: ``(index, update) -> Engine``: a replacement for engine ``index`` that died,
            holding ``update`` (the newest :class:`~conveyor.sync.WeightUpdate` sent, else
            ``initial``), started or not (the router starts it when it runs); None: a dead engine
            is not replaced (its slot stays out of rotation; the run continues while another
            engine lives). A replacement that fails after it was built is closed (its ``close``,
            else ``stop``).
        initial: The weights the engines hold now (what a replacement is built from before the
            first update), or None.
        max_batch_size: Each engine's decode batch (:meth:`waiting_requests`), or None.
        update_timeout_s: Seconds :meth:`update_weights` waits for every engine before it
            raises, or None (no limit).
        max_restarts: Replacements per router at most.
        affinity_slack: Requests in flight by which an engine that served a prompt (or its
            earlier turn) may exceed the least loaded engine and still get the request.
        affinity_entries: Prompts and continuations remembered for routing (least recently
            used forgotten first).
        replace_timeout_s: Seconds :meth:`stop` waits at most for a replacement still
            starting (s).

    Raises:
        ValueError: no engine, or a negative ``max_restarts`` / ``affinity_slack``.
    """

    def __init__(self, engines: Sequence[Any], *, restart: Callable[[int, Any], Any] | None = None,
                 initial: Any = None, max_restarts: int = 2, affinity_slack: int = 8, affinity_entries: int = 4096,
                 max_batch_size: int | None = None, update_timeout_s: float | None = None,
                 replace_timeout_s: float = 120.0):
        if not engines:
            raise ValueError("EngineRouter needs at least one engine")
        if max_restarts < 0 or affinity_slack < 0 or affinity_entries < 1:
            raise ValueError(f"max_restarts ({max_restarts}) and affinity_slack ({affinity_slack}) must be >= 0, "
                             f"affinity_entries ({affinity_entries}) >= 1")
        self._engines = list(engines)
        n = len(self._engines)
        self._restart = restart
        self.max_restarts = max_restarts
        self.affinity_slack = affinity_slack
        self._entries = affinity_entries
        self._lock = threading.Lock()  # routing state; never held while calling an engine
        self._inflight = [0] * n
        self._gen = [0] * n  # incremented by each replacement of the slot
        self._down: set[int] = set()  # slots being replaced or dead for good
        self._dead: set[int] = set()  # dead for good (no restart left)
        self._restart_locks = [threading.Lock() for _ in range(n)]
        self._replacing: dict[int, tuple[int, threading.Thread]] = {}  # slot -> (generation, thread)
        self._pending: dict[int, tuple[int, str]] = {}  # slot -> (generation, why): died while stopped
        self.replace_timeout_s = replace_timeout_s
        self._offset: list[dict[str, float]] = [{} for _ in range(n)]  # counters of replaced engines
        self._last_stats: list[dict | None] = [None] * n
        self._last_update = initial if restart is not None else None  # kept only to build replacements
        self.max_batch_size = max_batch_size
        self.update_timeout_s = update_timeout_s
        self._started = False
        self._paused = False
        # start / stop / pause / resume and the install of a replacement, one at a time (a
        # replacement installed mid-pause is paused too, never left running or paused alone)
        self._control = threading.RLock()
        self.restarts = 0
        self.resubmitted = 0
        self.routed_by_affinity = 0
        self._prompt_slot: OrderedDict[int, int] = OrderedDict()  # hash(prompt) -> slot
        self._cont_slot: OrderedDict[tuple[int, int], int] = OrderedDict()  # (length, hash) -> slot
        self._cont_lengths: Counter[int] = Counter()
        self._lengths: list[int] = []  # the keys of _cont_lengths, sorted
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix="engine-router")

    # ------------------------------------------------------------------ properties
    @property
    def engines(self) -> list:
        """The engines now in the slots (a copy of the list)."""
        return list(self._engines)

    @property
    def num_engines(self) -> int:
        """Number of engine slots."""
        return len(self._engines)

    @property
    def version(self) -> int:
        """The lowest policy version among the live engines (every token carries its own)."""
        versions = [e.version for i, e in enumerate(self._engines) if i not in self._down]
        if not versions:
            return self._last_update.version if self._last_update is not None else self._engines[0].version
        return min(versions)

    @property
    def supports_priority(self) -> bool:
        """True when every engine takes ``generate(..., priority=p)``."""
        return all(getattr(e, "supports_priority", False) for e in self._engines)

    # ------------------------------------------------------------------ control plane
    def _each(self, method: str, *, tolerant: bool = False) -> None:
        futs = {}
        gens = list(self._gen)
        for i, e in enumerate(self._engines):
            if i not in self._down:
                futs[i] = self._pool.submit(getattr(e, method))
        first: BaseException | None = None
        for i, f in futs.items():
            try:
                f.result()
            except EngineDiedError as e:  # replaced at the next request; not this call's failure
                log.warning("engine %d: %s() found it dead: %s", i, method, e)
                self._on_death(i, gens[i], str(e))
            except Exception as e:
                if tolerant:
                    log.warning("engine %d: %s() failed: %s", i, method, e)
                elif first is None:
                    first = e
        if first is not None:
            raise first

    def start(self) -> None:
        """Start every engine (idempotent); an engine found dead while the router was stopped is
        replaced now."""
        with self._control:
            self._started = True
            self._each("start")
            with self._lock:
                pending, self._pending = self._pending, {}
        for slot, (gen, why) in pending.items():
            self._on_death(slot, gen, why)

    def stop(self) -> None:
        """Stop every engine (tolerant: a failure is logged); in-flight requests resolve with
        ``finish_reason="abort"``. A replacement still starting is waited for
        (:meth:`wait_for_replacements`) and installed stopped, so nothing starts an engine
        after the caller has cleaned up."""
        with self._control:
            self._started = False
            self._each("stop", tolerant=True)
        self.wait_for_replacements()  # (outside _control: the replacement installs under it)

    def pause(self) -> None:
        """Pause every engine; returns when each has finished its current forward pass."""
        with self._control:
            self._paused = True
            self._each("pause")

    def resume(self) -> None:
        """Resume every engine."""
        with self._control:
            self._paused = False
            self._each("resume")

    def close(self) -> None:
        """Stop the engines and the router's thread pool."""
        self.stop()
        self._pool.shutdown(wait=False)

    def stats(self) -> dict[str, Any]:
        """The engines' counters merged (:func:`merge_engine_stats`; a replaced engine's
        cumulative counters as last read before its death carried into its successor's, its
        profiles not), plus ``num_engines``, ``engines``
        (each engine's own dict), ``engine_restarts``, ``router_resubmitted`` (requests run again
        after their engine died) and ``routed_by_affinity`` (requests sent to the engine that
        served their prompt or its earlier turn)."""
        per = []
        with self._lock:
            slots = [(i, e, self._gen[i], i in self._down) for i, e in enumerate(self._engines)]
            states = ["dead" if i in self._dead else "replacing" if i in self._down else "live"
                      for i in range(len(self._engines))]
        for i, e, gen, down in slots:
            st = None
            if not down:
                try:
                    st = dict(e.stats())
                    for k, v in self._offset[i].items():
                        st[k] = st.get(k, 0) + v
                    self._last_stats[i] = st
                except EngineDiedError as err:
                    log.warning("engine %d: stats() found it dead: %s", i, err)
                    self._on_death(i, gen, str(err))
                    with self._lock:
                        states[i] = "dead" if i in self._dead else "replacing"
            if st is None:  # a dead engine: its counters so far, no requests running or waiting
                st = {k: v for k, v in (self._last_stats[i] or {}).items() if k in CUMULATIVE_ENGINE_STATS}
            per.append(st)
        out = merge_engine_stats(per)
        for st, state in zip(per, states, strict=True):  # (after the merge: a per-engine field only)
            st["state"] = state
        out["num_engines"] = len(self._engines)
        out["engines"] = per
        with self._lock:
            out["engine_restarts"] = self.restarts
            out["router_resubmitted"] = self.resubmitted
            out["routed_by_affinity"] = self.routed_by_affinity
        return out

    def waiting_requests(self) -> int:
        """Requests waiting in the engines' queues, estimated from the router's own counts
        (requests in flight on an engine beyond its ``max_batch_size``); asks no engine.
        Without ``max_batch_size``: the engines' ``stats()["waiting"]`` summed."""
        if self.max_batch_size is None:
            return int(self.stats().get("waiting", 0))
        with self._lock:
            return sum(max(0, n - self.max_batch_size) for i, n in enumerate(self._inflight) if i not in self._down)

    def update_weights(self, update, *, wait: bool = True) -> concurrent.futures.Future:
        """Send ``update`` to every engine.

        Args:
            update: The :class:`~conveyor.sync.WeightUpdate` (its version must exceed every
                version sent before).
            wait: Block until every live engine has applied it.

        Returns:
            A future resolving to None when every engine has the weights; an engine that dies
            meanwhile does not fail it (its replacement starts from these weights).

        Raises:
            ValueError / KeyError / TypeError: an engine refused the update (the engines are
                identical, so each refuses it).
            TimeoutError: ``wait`` and not every engine applied it within ``update_timeout_s``.
        """
        with self._lock:
            if self._restart is not None:
                self._last_update = update
            targets = [(i, e) for i, e in enumerate(self._engines) if i not in self._down]
            gens = list(self._gen)
        done: concurrent.futures.Future = concurrent.futures.Future()
        pending = [len(targets)]
        count_lock = threading.Lock()

        def finished(i: int, f: concurrent.futures.Future) -> None:
            err = f.exception()
            if err is not None and not isinstance(err, EngineDiedError):
                if not done.done():
                    done.set_exception(err)
                return
            if err is not None:
                log.warning("engine %d died during a weight update: %s (its replacement starts from these weights)",
                            i, err)
                self._on_death(i, gens[i], str(err))
            with count_lock:
                pending[0] -= 1
                last = pending[0] == 0
            if last and not done.done():
                done.set_result(None)

        if not targets:
            done.set_result(None)
        for i, e in targets:
            try:
                f = e.update_weights(update, wait=False)
            except EngineDiedError as err:
                f = concurrent.futures.Future()
                f.set_exception(err)
            f.add_done_callback(lambda f, i=i: finished(i, f))
        if wait:
            try:
                done.result(timeout=self.update_timeout_s)
            except concurrent.futures.TimeoutError:
                raise TimeoutError(f"weight update to version {update.version}: not every engine applied it within "
                                   f"{self.update_timeout_s:.0f} s") from None
        return done

    def partial_requests(self, *, require_pause: bool = True) -> list:
        """Every live engine's requests with tokens (``proximal.method=partial_sync`` /
        ``dedicated``); request keys are ``"<engine id>:<request id>"``, unique across engines.

        Raises:
            RuntimeError: ``require_pause`` and an engine is running.
        """
        out: list = []
        for part in self._on_live("partial_requests", require_pause=require_pause):
            out.extend(part)
        return out

    def score_old_logprobs(self, spec, items, version: int | None = None):
        """Score ``items`` (:class:`~conveyor.rollout.old_logprobs.ScoringItem`) on the paused
        engines in parallel (they hold the same weights), each item, longest (prompt + tokens)
        first, to the engine with the fewest tokens so far.

        Returns:
            ``(patches, tokens scored)``, as one engine's
            :meth:`~conveyor.rollout.engine.InferenceEngine.score_old_logprobs`.

        An engine that dies while scoring is replaced and its share scored on the others.

        Raises:
            RuntimeError: an engine is running, or no live engine can score.
        """
        with self._lock:
            live = [(i, self._gen[i], e) for i, e in enumerate(self._engines)
                    if i not in self._down and callable(getattr(e, "score_old_logprobs", None))]
        shares: list[list] = [[] for _ in live]
        loads = [0] * len(live)
        for item in sorted(items, key=lambda it: -(len(it.prompt_ids) + len(it.token_ids))):
            k = loads.index(min(loads))
            shares[k].append(item)
            loads[k] += len(item.prompt_ids) + len(item.token_ids)
        patches: list = []
        scored = 0
        while True:
            if not live:
                raise RuntimeError("score_old_logprobs: no live engine that can score")
            futs = [(slot, gen, e, share, self._pool.submit(e.score_old_logprobs, spec, share, version))
                    for (slot, gen, e), share in zip(live, shares, strict=True) if share]
            failed: list = []
            survivors = []
            for slot, gen, e, share, f in futs:
                try:
                    p, n = f.result()
                except EngineDiedError as err:  # its share goes to the engines still alive
                    log.warning("engine %d died while scoring: %s", slot, err)
                    self._on_death(slot, gen, str(err))
                    failed.extend(share)
                    continue
                patches.extend(p)
                scored += n
                survivors.append((slot, gen, e))
            if not failed:
                return patches, scored
            live = survivors
            shares = [failed[k::len(live)] for k in range(len(live))] if live else []

    def _on_live(self, method: str, **kwargs) -> list:
        """``method(**kwargs)`` on every live engine in parallel; their results in slot order
        (an engine found dead is left out and replaced)."""
        with self._lock:
            live = [(i, self._gen[i], e) for i, e in enumerate(self._engines) if i not in self._down]
        futs = [(i, gen, self._pool.submit(getattr(e, method), **kwargs)) for i, gen, e in live]
        out = []
        for i, gen, f in futs:
            try:
                out.append(f.result())
            except EngineDiedError as err:
                log.warning("engine %d: %s() found it dead: %s", i, method, err)
                self._on_death(i, gen, str(err))
        return out

    # ------------------------------------------------------------------ routing
    @staticmethod
    def _cont_key(seq: list[int], length: int) -> tuple[int, int]:
        return length, hash(tuple(seq[max(0, length - AFFINITY_TAIL):length]))

    def _affine(self, prompt: list[int], key: int) -> int | None:
        slot = self._prompt_slot.get(key)
        if slot is not None:
            return slot
        lengths = self._lengths
        i = bisect.bisect_left(lengths, len(prompt))  # lengths below the prompt's, longest first
        for length in reversed(lengths[max(0, i - _AFFINITY_SCAN):i]):
            slot = self._cont_slot.get(self._cont_key(prompt, length))
            if slot is not None:
                return slot
        return None

    def _choose(self, prompt: list[int]) -> int | None:
        """The slot for ``prompt`` (under the lock), or None when every slot is down."""
        live = [i for i in range(len(self._engines)) if i not in self._down]
        if not live:
            return None
        least = min(live, key=lambda i: (self._inflight[i], i))
        key = hash(tuple(prompt))
        pref = self._affine(prompt, key)
        if pref is not None and pref not in self._down and self._inflight[pref] <= self._inflight[least] + self.affinity_slack:
            self.routed_by_affinity += 1
            chosen = pref
        else:
            chosen = least
        self._prompt_slot[key] = chosen
        self._prompt_slot.move_to_end(key)
        while len(self._prompt_slot) > self._entries:
            self._prompt_slot.popitem(last=False)
        return chosen

    def _remember(self, prompt: list[int], response: Sequence[int], slot: int) -> None:
        seq = prompt + list(response)
        key = self._cont_key(seq, len(seq))
        with self._lock:
            if key not in self._cont_slot:
                self._cont_lengths[key[0]] += 1
                if self._cont_lengths[key[0]] == 1:
                    bisect.insort(self._lengths, key[0])
            self._cont_slot[key] = slot
            self._cont_slot.move_to_end(key)
            while len(self._cont_slot) > self._entries:
                (length, _), _ = self._cont_slot.popitem(last=False)
                self._cont_lengths[length] -= 1
                if not self._cont_lengths[length]:
                    del self._cont_lengths[length]
                    del self._lengths[bisect.bisect_left(self._lengths, length)]

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
                       priority: int | None = None) -> GenerationOutput:
        """Generate one response on one of the engines (module docstring: routing, faults).

        Args:
            prompt_ids: Prompt token ids.
            params: Sampling parameters (None: ``SamplingParams()``).
            priority: Passed on when every engine supports it (:attr:`supports_priority`).

        Returns:
            The engine's :class:`~conveyor.rollout.engine.types.GenerationOutput`.

        Raises:
            What the engine raises (ValueError for an invalid prompt, RuntimeError for a stopped
            or crashed engine); RuntimeError when every engine is dead and none can be replaced.
        """
        prompt = prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else list(prompt_ids)
        kwargs = {} if priority is None or not self.supports_priority else {"priority": priority}
        while True:
            with self._lock:
                slot = self._choose(prompt)
                if slot is not None:
                    engine, gen = self._engines[slot], self._gen[slot]
                    self._inflight[slot] += 1
                elif len(self._dead) == len(self._engines):
                    raise RuntimeError(f"all {len(self._engines)} engines died and none could be replaced")
            if slot is None:  # every slot is being replaced
                await asyncio.sleep(0.05)
                continue
            try:
                out = await engine.generate(prompt, params, **kwargs)
            except EngineDiedError as e:
                # out of rotation at once, replaced in the background: the request runs again
                # now on a live engine (or waits for the replacement when none is left)
                self._on_death(slot, gen, str(e))
                with self._lock:
                    if len(self._dead) == len(self._engines):
                        raise RuntimeError(f"engine {slot} died ({e}) and no engine is left") from e
                    self.resubmitted += 1
                continue
            finally:
                with self._lock:
                    self._inflight[slot] -= 1
            self._remember(prompt, out.token_ids, slot)
            return out

    # ------------------------------------------------------------------ faults
    def _on_death(self, slot: int, gen: int, why: str) -> None:
        """The engine of ``slot`` (generation ``gen``) died: out of rotation now; its
        replacement started in a thread of its own, one per death (:meth:`stop` waits for it),
        or the slot marked dead at once when no replacement is allowed."""
        with self._lock:
            if self._gen[slot] != gen:
                return  # already replaced (or given up) by another caller
            self._down.add(slot)
            running = self._replacing.get(slot)
            if running is not None and running[0] == gen and running[1].is_alive():
                return  # this death's replacement is already under way (never block on it here)
            if not self._started and self._restart is not None:
                # stopped (the run is ending): out of rotation only, no engine built behind the
                # caller's cleanup; start() replaces it
                self._pending[slot] = (gen, why)
                return
            if self._restart is not None and self.restarts < self.max_restarts:
                t = threading.Thread(target=self._replace, args=(slot, gen, why), name=f"engine-{slot}-restart",
                                     daemon=True)
                self._replacing[slot] = (gen, t)
                t.start()  # (under the lock: alive before anyone else can look)
                return
        self._replace(slot, gen, why)  # marks it dead; quick

    def wait_for_replacements(self, timeout_s: float | None = None) -> bool:
        """Wait until no replacement is being started.

        Args:
            timeout_s: Seconds to wait at most (None: :attr:`replace_timeout_s`).

        Returns:
            True when none is under way any more; False when one is still starting after the
            timeout (it is then left to finish in the background, logged).
        """
        deadline = time.monotonic() + (self.replace_timeout_s if timeout_s is None else timeout_s)
        while True:  # (again until none is alive: one may have started during the wait)
            with self._lock:
                threads = [(slot, t) for slot, (_, t) in self._replacing.items() if t.is_alive()]
            if not threads:
                return True
            for slot, t in threads:
                log.info("waiting for engine %d's replacement to finish starting", slot)
                t.join(max(0.0, deadline - time.monotonic()))
                if t.is_alive():
                    log.warning("engine %d's replacement is still starting after the wait; left in the background",
                                slot)
                    return False

    def _replace(self, slot: int, gen: int, why: str) -> bool:
        """Replace the engine of ``slot`` that died under generation ``gen`` (a no-op when
        another caller already did). Returns True when the slot holds a live engine now."""
        with self._restart_locks[slot]:
            with self._lock:
                if self._gen[slot] != gen:
                    return slot not in self._dead
                self._down.add(slot)
                if self._restart is None or self.restarts >= self.max_restarts:
                    self._dead.add(slot)
                    self._gen[slot] += 1  # requests that died there with it do not try again
                    log.error("engine %d died (%s); not replaced (%s)", slot, why,
                              "no restart" if self._restart is None else f"{self.max_restarts} restarts used up")
                    return False
                self.restarts += 1
                update = self._last_update
                old_stats = self._last_stats[slot]
            log.warning("engine %d died (%s); starting a replacement (%d of %d)", slot, why, self.restarts,
                        self.max_restarts)
            t0 = time.monotonic()
            new = None
            try:
                new = self._restart(slot, update)
                new.start()  # (stopped again below if the router is stopped by then)
                while True:  # weights sent while it was being built; installed with the newest
                    with self._control:
                        # first in the router's state (paused during a partial_sync publish,
                        # stopped after a stop), then in rotation: no request or scoring reaches
                        # it running while the others are paused
                        if not self._started:
                            new.stop()
                        elif self._paused:
                            new.pause()
                        with self._lock:
                            latest = self._last_update
                            if latest is None or latest is update:
                                if old_stats is not None:
                                    self._offset[slot] = {k: v for k, v in old_stats.items()
                                                          if k in CUMULATIVE_ENGINE_STATS}
                                self._engines[slot] = new
                                self._gen[slot] += 1
                                self._down.discard(slot)
                                self._dead.discard(slot)
                                log.info("engine %d: replacement installed at version %s, %.1f s after the death%s",
                                         slot, getattr(latest, "version", None), time.monotonic() - t0,
                                         "" if self._started else " (stopped: the router was stopped meanwhile)")
                                break
                    new.update_weights(latest, wait=True)  # a paused or stopped engine applies it too
                    update = latest
            except Exception as e:
                log.error("engine %d: the replacement failed: %s", slot, e)
                with self._lock:
                    self._dead.add(slot)
                    self._gen[slot] += 1
                if new is not None:
                    try:
                        getattr(new, "close", new.stop)()
                    except Exception:
                        log.exception("engine %d: closing the failed replacement", slot)
                return False
        return True
