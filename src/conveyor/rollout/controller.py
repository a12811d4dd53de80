"""The rollout controller: keeps the engine busy under the staleness bound (MISSION.md section 1).

It runs an asyncio event loop in its own thread. Whenever AReaL's capacity rule
(:class:`~conveyor.rollout.staleness.StalenessManager`) allows, it takes the next sample from the
:class:`DataStream`, runs the workflow's episode, and puts accepted groups into the
:class:`~conveyor.rollout.buffer.TrajectoryBuffer`. Units: the staleness manager counts
trajectories; an episode of ``group_size`` responses occupies ``group_size`` units.

It never touches the trainer; the runtime tells it the published policy version with
:meth:`RolloutController.set_version` after each weight update.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from dataclasses import dataclass

from conveyor.data import DatasetError
from conveyor.rollout.buffer import IN_FORCE, TrajectoryBuffer, judged_bound
from conveyor.rollout.engine import PromptTooLongError
from conveyor.rollout.engine.remote import EngineGoneError
from conveyor.rollout.old_logprobs import OldLogprobBook
from conveyor.rollout.staleness import StalenessManager
from conveyor.rollout.workflow import RolloutWorkflow
from conveyor.types import Sample, Trajectory

log = logging.getLogger(__name__)


class EpisodesFailedError(RuntimeError):
    """``max_failed_in_a_row`` episodes in a row raised (a broken environment, agent or its
    options): the controller stops and the runtime raises this, with the last episode's error;
    every episode's traceback is in the run's ``train.log``."""


class DataStream:
    """Endless, seeded pass over a data set: each epoch is a fresh permutation.

    State (for checkpoints): ``epoch``, ``pos`` (next index into the epoch's permutation),
    ``requeue`` (sample indices to serve first, e.g. episodes that were in flight at a checkpoint)
    and ``skip`` (indices never served again, e.g. prompts longer than the model's context).

    Args:
        samples: The training samples (non-empty).
        seed: Permutation seed (epoch ``e`` uses ``seed + e``).

    Raises:
        ValueError: empty ``samples``.
    """

    def __init__(self, samples: list[Sample], seed: int = 0):
        if not samples:
            raise ValueError("DataStream: the training data set is empty")
        self.samples = samples
        self.seed = seed
        self.epoch = 0
        self.pos = 0
        self.requeue: list[int] = []
        self.skip: set[int] = set()
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        perm = list(range(len(self.samples)))
        random.Random(self.seed + epoch).shuffle(perm)
        return perm

    def next(self) -> tuple[int, Sample]:
        """The next ``(index, sample)``, never one in :attr:`skip`.

        Raises:
            DatasetError: every sample is skipped (nothing left to train on).
        """
        if len(self.skip) >= len(self.samples):
            raise DatasetError(f"all {len(self.samples)} training samples were skipped (prompts "
                               "longer than the model's context); nothing is left to train on")
        while True:
            if self.requeue:
                i = self.requeue.pop(0)
            else:
                if self.pos >= len(self._perm):
                    self.epoch += 1
                    self.pos = 0
                    self._perm = self._permutation(self.epoch)
                i = self._perm[self.pos]
                self.pos += 1
            if i not in self.skip:
                return i, self.samples[i]

    def state_dict(self) -> dict:
        """``{"epoch", "pos", "requeue", "skip"}`` (plain ints)."""
        return {"epoch": self.epoch, "pos": self.pos, "requeue": list(self.requeue),
                "skip": sorted(self.skip)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output."""
        self.epoch = int(state["epoch"])
        self.pos = int(state["pos"])
        self.requeue = [int(i) for i in state.get("requeue", [])]
        self.skip = {int(i) for i in state.get("skip", [])}
        self._perm = self._permutation(self.epoch)


@dataclass
class ControllerStats:
    """Cumulative counters of the controller (all counts are episodes / groups unless noted)."""

    episodes_started: int = 0
    episodes_accepted: int = 0
    episodes_rejected: int = 0
    episodes_failed: int = 0
    groups_filtered: int = 0
    filter_cap_hits: int = 0
    reward_failures: int = 0  # trajectories
    trajectories_accepted: int = 0
    prompts_too_long: int = 0  # samples skipped for good: prompt fills the model's context
    expiring_waits: int = 0  # batches that waited while expiring groups were in flight (wait_for_expiring)
    expiring_wait_timeouts: int = 0  # of those, formed anyway after expiring_wait_s
    last_error: str | None = None


class _PrioritisedEngine:
    """The engine as one episode sees it: every ``generate`` call carries the episode's
    priority (its admission sequence), everything else is the engine itself. Workflows,
    tools and agents call ``engine.generate(ids, params)`` unchanged."""

    def __init__(self, engine, priority: int) -> None:
        self._engine = engine
        self._priority = priority

    async def generate(self, prompt_ids, params=None):
        return await self._engine.generate(prompt_ids, params, priority=self._priority)

    def __getattr__(self, name):
        return getattr(self._engine, name)


class RolloutController:
    """Runs episodes continuously under the staleness bound.

    Args:
        engine: A started inference engine (``async generate``).
        workflow: The episode logic (:class:`~conveyor.rollout.workflow.RolloutWorkflow`).
        data: The sample stream.
        staleness: Admission control (counts trajectories).
        buffer: Where accepted groups go.
        group_size: Trajectories per episode (units taken from ``staleness`` per episode).
        filter_all_equal: Dynamic filtering (DAPO, arXiv 2503.14476): reject groups whose rewards
            are all equal (no learning signal under GRPO). Never hangs: after
            ``max_filtered_in_a_row`` consecutive filtered groups the next one is accepted
            anyway and ``filter_cap_hits`` is incremented and logged.
        version: The published policy version at start.
        max_failed_in_a_row: Stop (``error`` set, the runtime raises it) after this many
            consecutive failed episodes: a systematic failure is reported, never retried forever.
            The first failure is logged with its traceback, later ones in one line each (kept
            off the console, which gets a count from the runtime).
        on_skip: Called as ``on_skip(sample, reason)`` from the controller thread when a sample
            is dropped for good (its prompt fills the model's context: ``PromptTooLongError``);
            the sample is never served again (``DataStream.skip``, checkpointed) and counted in
            ``prompts_too_long``.
        priority: ``"oldest_first"``: every engine request of an episode (each turn of a tool
            or agent episode too) carries the episode's admission sequence as its priority, so
            the engine's waiting queue serves episodes in admission order and a group admitted
            earlier -- the first to reach the staleness bound -- is not overtaken by younger
            ones (earliest deadline first; docs/results/main_job.md). Needs an engine with
            ``supports_priority`` (others run FIFO). ``"fifo"``: requests in arrival order (a
            tool call's next turn queues behind every request submitted meanwhile).
        max_engine_waiting: Engine-aware admission (issue 16): besides the capacity rule, a new
            episode starts only while the engine's waiting queue (``engine.stats()["waiting"]``,
            requests submitted and not yet in its running batch) holds at most this many
            requests. When the engine is the bottleneck, the capacity rule alone keeps
            ``min(max_concurrent, (eta + 1) * B)`` trajectories in flight, and those beyond the
            engine's batch only wait in its queue: their time in flight, and so their staleness
            and the share dropped as stale, grows without any gain in throughput. None: the
            capacity rule alone (AReaL). The check calls ``engine.stats()`` in the controller's
            event loop: meant for an in-process engine (a remote one answers over HTTP).
        wait_for_expiring: Deadline-aware hand-out (``async.wait_for_expiring``, issue 16):
            :meth:`take_batch` waits for groups still in flight that were admitted at version
            ``v - eta`` or earlier (this batch is their last chance) instead of filling the
            batch with younger groups and dropping the stragglers as stale at the next version
            (:meth:`TrajectoryBuffer.get_batch <conveyor.rollout.buffer.TrajectoryBuffer.get_batch>`).
            Episodes admitted at exactly ``v - eta`` count (older ones are already stale on
            arrival unless their first token came later). A batch is held back at most
            ``expiring_wait_s`` seconds per version, then formed as usual (an episode that never
            ends must not stop training); both counted in ``rollout/expiring_waits`` and
            ``rollout/expiring_wait_timeouts``.

    Raises:
        ValueError: ``priority`` is not ``"oldest_first"`` or ``"fifo"``, ``max_engine_waiting``
            is not None or an int >= 0, or ``expiring_wait_s`` is negative.
    """

    def __init__(self, engine, workflow: RolloutWorkflow, data: DataStream, staleness: StalenessManager, buffer: TrajectoryBuffer, *, group_size: int, filter_all_equal: bool = False, max_filtered_in_a_row: int = 64, version: int = 0,
                 max_failed_in_a_row: int = 100, on_skip=None, priority: str = "fifo",
                 max_engine_waiting: int | None = None, wait_for_expiring: bool = False,
                 expiring_wait_s: float = 300.0):
        if priority not in ("oldest_first", "fifo"):
            raise ValueError(f"priority must be 'oldest_first' or 'fifo', got {priority!r}")
        self.priority = priority if getattr(engine, "supports_priority", False) else "fifo"
        if max_engine_waiting is not None and (isinstance(max_engine_waiting, bool) or not isinstance(max_engine_waiting, int)
                                               or max_engine_waiting < 0):
            raise ValueError(f"max_engine_waiting must be None or an int >= 0, got {max_engine_waiting!r}")
        self.max_engine_waiting = max_engine_waiting
        self.wait_for_expiring = bool(wait_for_expiring)
        if not expiring_wait_s >= 0:
            raise ValueError(f"expiring_wait_s must be >= 0 seconds, got {expiring_wait_s!r}")
        self.expiring_wait_s = float(expiring_wait_s)
        self._holding: tuple[int, float] | None = None  # (version, since) of the batch held back now
        self.max_failed_in_a_row = max_failed_in_a_row
        self.on_skip = on_skip
        self._failed_in_a_row = 0
        self.engine = engine
        self.workflow = workflow
        self.data = data
        self.staleness = staleness
        self.buffer = buffer
        self.group_size = group_size
        self.filter_all_equal = filter_all_equal
        self.max_filtered_in_a_row = max_filtered_in_a_row
        self.stats = ControllerStats()
        self._version = version
        # batches the trainer consumed without a policy update (the critic warm-up): the capacity
        # rule counts them like versions, or admission would stop after eta + 1 warm-up batches
        self.warmup_batches = 0
        self._filtered_in_a_row = 0
        self._inflight: dict[int, int] = {}  # episode id -> sample index
        self._admitted_at: dict[int, int] = {}  # episode id -> policy version at admission
        self._admitted_eta: dict[int, int | None] = {}  # episode id -> staleness bound at admission
        # samples handed out that will never reach the trainer, not yet in the audit trail
        # (take_not_trained); checkpointed, so the records survive a crash exactly
        self._ledger: list[dict] = []
        self._episode_ids = 0
        self._lock = threading.Lock()  # guards data cursor, in-flight set and buffer puts vs. snapshots
        # old-log-prob patches (partial_sync / dedicated) until their trajectory is handed out
        self.old_logprobs = OldLogprobBook()
        self._runtime_state: dict = {}  # set_runtime_state: checkpointed with the snapshot
        self._paused = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        """Start the controller thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._main, name="conveyor-rollout", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop admitting episodes and join the thread. In-flight episodes are cancelled; their
        samples stay in the checkpointable in-flight list."""
        self._stop.set()
        self._poke()
        if self._thread is not None:
            self._thread.join(timeout)

    def set_version(self, version: int) -> None:
        """Publish the policy version the engine now runs (after a weight update); forget the
        old-log-prob patches of trajectories now beyond the staleness bound."""
        self._version = version
        self.old_logprobs.prune(version, self._widest_bound())
        self._poke()

    def _widest_bound(self) -> int | None:
        """The largest staleness bound a buffered or in-flight trajectory is judged by (None:
        unbounded): what admitted work may still be trained within."""
        widest = self.buffer.widest_bound()
        with self._lock:
            for eta in self._admitted_eta.values():
                widest = judged_bound(eta, widest)
        return widest

    def set_eta(self, eta: int | None) -> None:
        """Change the staleness bound now (an adaptive controller or a monitor action, issue 13):
        the capacity rule and the buffer follow at once (``StalenessManager.set_eta``,
        ``TrajectoryBuffer.set_eta``)."""
        self.staleness.set_eta(eta)
        self.buffer.set_eta(eta)
        self._poke()

    def set_runtime_state(self, state: dict) -> None:
        """State of the runtime's own components (the steering: eta, the ratio controller, the
        monitor's evaluations) to keep in the next checkpoints (:meth:`snapshot`)."""
        with self._lock:
            self._runtime_state = dict(state)

    def apply_old_logprobs(self, patches) -> int:
        """Store old-log-prob patches (:class:`~conveyor.rollout.old_logprobs.OldLogprobPatch`)
        for the trajectories they address; returns the token values stored."""
        return self.old_logprobs.apply(patches)

    def expiring_inflight(self, version: int) -> int:
        """Trajectories of episodes in flight admitted at policy version ``version - eta``, with
        ``eta`` the bound each is judged by (the one it was admitted under, or the one in force
        when larger): a batch taken at trainer ``version`` is the last one they can join (0 with
        ``eta = None``)."""
        now = self.buffer.eta
        if now is None:
            return 0
        with self._lock:
            n = 0
            for eid, v in self._admitted_at.items():
                bound = judged_bound(self._admitted_eta.get(eid, now), now)
                if bound is not None and v == version - bound:
                    n += 1
            return self.group_size * n

    def take_batch(self, n: int, version: int) -> list[Trajectory] | None:
        """The buffer's :meth:`~conveyor.rollout.buffer.TrajectoryBuffer.get_batch` at trainer
        ``version``, holding the batch back (at most ``expiring_wait_s``) while expiring groups
        are in flight when ``wait_for_expiring`` is on; None: not ready yet (call again)."""
        pending = self.expiring_inflight(version) if self.wait_for_expiring else 0
        holding = self._holding if self._holding is not None and self._holding[0] == version else None
        timed_out = bool(pending) and holding is not None and time.monotonic() - holding[1] > self.expiring_wait_s
        if timed_out:
            pending = 0  # waited long enough: form the batch as usual
        batch = self.buffer.get_batch(n, version, pending_expiring=pending)
        if batch is None:
            # from now on this version's batch waits for them (only when it was held back: a batch
            # that is merely not complete yet, e.g. every group of a synchronous step in flight,
            # is neither a wait nor on the expiring_wait_s clock)
            if pending and holding is None and self.buffer.last_held_back:
                self._holding = (version, time.monotonic())
            return None
        if holding is not None:  # this batch waited while expiring groups were in flight
            self.stats.expiring_waits += 1
            self.stats.expiring_wait_timeouts += timed_out
        self._holding = None
        return batch

    def hand_out(self, batch: list[Trajectory]) -> list[Trajectory]:
        """A batch leaving for the trainer: its old-log-prob patches are attached
        (``metadata["old_logprobs"]``) and forgotten here."""
        self.old_logprobs.attach(batch)
        return batch

    def set_warmup_batches(self, n: int) -> None:
        """Batches consumed so far by critic-only warm-up steps (``critic.warmup_steps``): they
        free admission capacity like a version does, while the policy (and its version) stay
        at 0. Set it before :meth:`restore` on a resume."""
        self.warmup_batches = n
        self._poke()

    def pause(self) -> None:
        """Admit no new episodes until :meth:`resume` (running ones continue)."""
        self._paused.set()

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        self._paused.clear()
        self._poke()

    @property
    def version(self) -> int:
        """The published policy version."""
        return self._version

    def _poke(self) -> None:
        if self._loop is not None and self._wake is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # loop closed
                pass

    def take_not_trained(self) -> list[dict]:
        """Remove and return the records of samples handed out since the last call that will
        never be trained: ``{"sample", "outcome", ...}`` with outcome ``dropped_stale`` (the
        buffer's staleness bound), ``filtered`` (all-equal rewards), ``rejected`` (the workflow
        returned None), ``failed`` (the episode raised) or ``prompt_too_long``. With the groups
        trained, they account for every sample the data stream handed out (``trained.jsonl``;
        the chaos suite checks it across kills and resumes)."""
        with self._lock:
            out, self._ledger = self._ledger, []
        return self.buffer.take_dropped() + out

    # ------------------------------------------------------------------ checkpoint
    def snapshot(self) -> dict:
        """A consistent checkpointable state: data cursor with in-flight samples re-queued first,
        buffered groups (copied, not removed), staleness counters and controller stats.

        Trajectories of episodes in flight now are not saved; their samples are re-queued, so
        after a resume they are generated again (never trained twice, never skipped).
        """
        with self._lock:
            data_state = self.data.state_dict()
            data_state["requeue"] = list(self._inflight.values()) + data_state["requeue"]
            bounded = self.buffer.snapshot_with_bounds()
            groups = [g for g, _ in bounded]
            # the buffered trajectories carry their patches into the checkpoint
            self.old_logprobs.attach([t for g in groups for t in g], keep=True)
            st = dict(self.stats.__dict__)
            return {
                "data": data_state,
                "buffer": groups,
                "buffer_eta": [eta for _, eta in bounded],  # each group's admission bound
                # recorded, not yet logged (the next step's trained.jsonl row lists them)
                "not_trained": self.buffer.take_dropped(keep=True) + list(self._ledger),
                "staleness": self.staleness.state_dict(),
                "stats": st,
                "runtime": dict(self._runtime_state),
                "inflight": len(self._inflight),  # episodes whose samples lead "requeue" (information)
            }

    def restore(self, state: dict, version: int) -> None:
        """Restore :meth:`snapshot` output before :meth:`start` (resume at trainer ``version``):
        re-queues samples, puts buffered groups back and resets the accepted count to
        ``(version + warmup_batches) * B + buffered`` (MISSION.md section 1)."""
        self.data.load_state_dict(state["data"])
        self.staleness.load_state_dict(state["staleness"])
        buffered = 0
        bounds = state.get("buffer_eta") or [IN_FORCE] * len(state["buffer"])  # saved before bounds were: in force
        for g, eta in zip(state["buffer"], bounds, strict=True):
            for i, t in enumerate(g):  # saved before request keys existed: one span, its own key
                if "request_spans" not in t.metadata:
                    t.metadata["request_spans"] = [[f"restored:{t.group_id}:{i}", 0, len(t.response_ids)]]
            self.buffer.put(g, eta=eta)
            buffered += len(g)
        self.staleness.reset_after_resume(version + self.warmup_batches, buffered=buffered)
        for k, v in state.get("stats", {}).items():
            if hasattr(self.stats, k):
                setattr(self.stats, k, v)
        self._ledger = list(state.get("not_trained", []))  # logged with the next step
        self._runtime_state = dict(state.get("runtime", {}))
        self._version = version

    # ------------------------------------------------------------------ the loop
    def _engine_waiting(self) -> int:
        """Requests waiting in the engine's queue now (0 when the engine does not say): the
        engine's ``waiting_requests()`` where it has one (an
        :class:`~conveyor.rollout.engine.router.EngineRouter`: no call to remote engines on this
        event loop), else ``stats()["waiting"]``."""
        try:
            waiting = getattr(self.engine, "waiting_requests", None)
            if callable(waiting):
                return int(waiting())
            return int(self.engine.stats().get("waiting", 0))
        except Exception:  # an engine without stats (or gone): admission falls back to the capacity rule
            return 0

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as e:  # surfaced to the runtime through .error
            log.exception("rollout controller crashed")
            self.error = e

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        tasks: set[asyncio.Task] = set()
        while not self._stop.is_set():
            if not self._paused.is_set():
                cap = self.staleness.capacity(self._version + self.warmup_batches)
                while cap >= self.group_size and not self._stop.is_set():
                    if self.max_engine_waiting is not None and self._engine_waiting() > self.max_engine_waiting:
                        break  # the engine has no free decode slot: a new episode would only queue there
                    with self._lock:
                        idx, sample = self.data.next()
                        eid = self._episode_ids
                        self._episode_ids += 1
                        self._inflight[eid] = idx
                        self._admitted_at[eid] = self._version
                        self._admitted_eta[eid] = self.staleness.eta  # its bound in the buffer
                    self.staleness.on_start(self.group_size)
                    self.stats.episodes_started += 1
                    t = asyncio.create_task(self._episode(eid, sample))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                    cap -= self.group_size
                    if self.max_engine_waiting is not None:
                        for _ in range(4):  # let the episode submit its first requests before re-checking
                            await asyncio.sleep(0)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=0.5)
            except TimeoutError:
                pass
        for t in list(tasks):
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _episode(self, eid: int, sample: Sample) -> None:
        try:
            await self._run_episode(eid, sample)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a defect past the workflow (e.g. a group of the wrong size): stop the run
            log.exception("episode for %s: the controller cannot continue", sample.id)
            if self.error is None:
                self.error = e
            self._stop.set()
        finally:
            with self._lock:
                self._admitted_at.pop(eid, None)  # however it ended: never waited for again
                self._admitted_eta.pop(eid, None)
            self._poke()

    async def _run_episode(self, eid: int, sample: Sample) -> None:
        G = self.group_size
        try:
            engine = self.engine if self.priority == "fifo" else _PrioritisedEngine(self.engine, eid)
            group = await self.workflow.run_episode(engine, sample)
        except asyncio.CancelledError:
            raise  # stopping: the sample stays in _inflight and is re-queued by snapshot()
        except PromptTooLongError as e:  # retrying can never help: drop the sample for good
            with self._lock:
                idx = self._inflight.pop(eid, None)
                if idx is not None:
                    self.data.skip.add(idx)
                self._ledger.append({"sample": sample.id, "outcome": "prompt_too_long"})
            self.stats.prompts_too_long += 1
            if self.stats.prompts_too_long == 1:
                log.warning("sample %s skipped for the rest of the run: %s (further ones are "
                            "counted in rollout/prompts_too_long and events.jsonl)", sample.id, e)
            if self.on_skip is not None:
                self.on_skip(sample, str(e))
            self.staleness.on_reject(G)
            self._poke()
            return
        except Exception as e:
            self.stats.episodes_failed += 1
            self._failed_in_a_row += 1
            self.stats.last_error = f"{type(e).__name__}: {e}"
            if self.stats.episodes_failed == 1:
                log.exception("episode for %s failed", sample.id)
            else:  # one line each, in train.log only
                log.warning("episode for %s failed: %s", sample.id, self.stats.last_error,
                            extra={"console": False})
            with self._lock:
                self._inflight.pop(eid, None)
                self._ledger.append({"sample": sample.id, "outcome": "failed",
                                     "error": self.stats.last_error[:200]})
            self.staleness.on_reject(G)
            if isinstance(e, EngineGoneError) and self.error is None:  # the engine's server died: stop now
                self.error = e
                self._stop.set()
            if self._failed_in_a_row >= self.max_failed_in_a_row and self.error is None:
                groups = (f" (groups of rollout.group_size={G} episodes: one raising episode fails its group, as "
                          "the group's advantages need every member)" if G > 1 else "")
                self.error = EpisodesFailedError(f"{self._failed_in_a_row} episodes in a row failed{groups}; the "
                                          f"last: {self.stats.last_error} (tracebacks in train.log)")
                self._stop.set()
            self._poke()
            return
        self._failed_in_a_row = 0
        accept = group is not None and len(group) > 0
        if accept and len(group) != G:
            raise RuntimeError(f"workflow returned {len(group)} trajectories, expected group_size={G}")
        if accept and self.filter_all_equal and len({t.reward for t in group}) == 1:
            if self._filtered_in_a_row < self.max_filtered_in_a_row:
                self._filtered_in_a_row += 1
                self.stats.groups_filtered += 1
                accept = False
            else:
                self.stats.filter_cap_hits += 1
                log.warning(
                    "dynamic filtering: %d groups in a row had all-equal rewards; accepting this one "
                    "to avoid starving the trainer (rollout.max_filtered_in_a_row)", self._filtered_in_a_row,
                )
                self._filtered_in_a_row = 0
        elif accept:
            self._filtered_in_a_row = 0
        if accept:
            # accept before put: once in the buffer the trainer may drop the group as stale,
            # and on_drop must find it counted as accepted
            self.staleness.on_accept(G)
        with self._lock:
            self._inflight.pop(eid, None)
            if accept:  # judged by the bound it was admitted under (a lowered eta throttles admission only)
                self.buffer.put(group, eta=self._admitted_eta.get(eid, IN_FORCE))
            else:  # filtered (all-equal rewards) or rejected by the workflow (None)
                self._ledger.append({
                    "sample": sample.id, "group": group[0].group_id if group else None,
                    "outcome": "filtered" if group else "rejected"})
        if accept:
            self.stats.episodes_accepted += 1
            self.stats.trajectories_accepted += G
            self.stats.reward_failures += sum(bool(t.metadata.get("reward_failed")) for t in group)
        else:
            self.staleness.on_reject(G)
            self.stats.episodes_rejected += 1
        self._poke()

    def counters(self) -> dict[str, float]:
        """Controller counters as metrics (``rollout/...``; counts are cumulative over the run).

        Units (fresh-user trial 5: mixed without a word): ``episodes_*`` and ``groups_*`` count
        episodes, one per prompt, each a group of ``group_size`` trajectories;
        ``trajectories_accepted``, ``running``, ``buffered``, ``dropped_stale``,
        ``reward_failures`` count trajectories (``trajectories_accepted`` = ``episodes_accepted``
        x ``group_size`` = trained + ``buffered`` + ``dropped_stale``, up to the batches taken
        but not yet trained); ``prompts_too_long`` samples; ``expiring_*`` batches."""
        s = self.stats
        buf = self.buffer.stats()
        return {
            "rollout/episodes_started": s.episodes_started,
            "rollout/episodes_accepted": s.episodes_accepted,
            "rollout/trajectories_accepted": s.trajectories_accepted,
            "rollout/episodes_rejected": s.episodes_rejected,
            "rollout/episodes_failed": s.episodes_failed,
            "rollout/groups_filtered": s.groups_filtered,
            "rollout/filter_cap_hits": s.filter_cap_hits,
            "rollout/reward_failures": s.reward_failures,
            "rollout/prompts_too_long": s.prompts_too_long,
            "rollout/expiring_waits": s.expiring_waits,
            "rollout/expiring_wait_timeouts": s.expiring_wait_timeouts,
            "rollout/running": self.staleness.running,
            "rollout/buffered": self.buffer.size(),
            "rollout/dropped_stale": buf["dropped_stale"],
            # of the trajectories accepted into the buffer, the share dropped as stale (0 before any)
            "rollout/dropped_stale_share": buf["dropped_stale"] / buf["put_trajectories"] if buf["put_trajectories"] else 0.0,
        }


def wait_for_batch(buffer: TrajectoryBuffer, n: int, version_fn, *, poll_s: float = 0.2, health_fn=None, stop: threading.Event | None = None,
                   take=None) -> list[Trajectory] | None:
    """Block until the buffer can hand out ``n`` trajectories at the current version.

    Args:
        buffer: The trajectory buffer.
        n: Batch size in trajectories.
        version_fn: Returns the current trainer version.
        poll_s: Seconds between checks (s).
        health_fn: Called on every poll; raise from it to abort (e.g. the controller crashed).
        stop: When set, return None.
        take: ``take(n, version) -> batch | None`` in place of ``buffer.get_batch`` (e.g.
            :meth:`RolloutController.take_batch`, which may hold a batch back for expiring groups).
    """
    take = buffer.get_batch if take is None else take
    while True:
        batch = take(n, version_fn())
        if batch is not None:
            return batch
        if stop is not None and stop.is_set():
            return None
        if health_fn is not None:
            health_fn()
        buffer.wait_for(n, timeout=poll_s)
        time.sleep(0.0 if buffer.size() < n else poll_s / 4)
