"""A discrete-event model of an asynchronous RL pipeline, for planning runs on machines conveyor
has never run on (``conveyor simulate``).

Built on ``simpy``. The model follows the runtime of :mod:`conveyor.train` (MISSION.md section 1):

- **Rollout workers** (one inference engine each) run continuous batching: between decode steps
  waiting requests join the running batch (up to ``max_batch_size``), paying a prefill of
  ``prefill_s_per_token`` per prompt token; one decode step of a batch of ``b`` sequences takes
  ``decode_base_s + decode_per_seq_s * b`` seconds and gives every sequence one token. With
  ``shared_prefill`` (default, as conveyor's engine: identical prompts admitted together are
  prefilled once, a later one finds them in the prefix cache and joins the running batch, whose
  next decode step runs its last token) the requests of a group sharing a context pay its
  prefill once per weight version (the others nothing more); the cache is emptied by every weight
  update, and a re-encode after an update runs a prompt that two or more of its requests share
  once (then cached) and each request's response so far, a request sharing nothing whole
  (``InferenceEngine._reencode_requests``). A group-mate is routed to the worker that has its prompt (as conveyor's
  ``EngineRouter`` does, within ``affinity_slack`` = 8 requests of the least loaded worker).
- **Episodes** (groups of ``group_size`` trajectories sharing a prompt) wait ``env_latency_s``
  (a simulated environment / tool call) after each of their ``turns`` generation turns.
- **Controller**: AReaL's capacity rule (MISSION.md section 1):
  ``capacity(v) = min(max_concurrent - running, (eta + v + 1) * B - (accepted + running))`` with
  ``B = batch_size * group_size`` trajectories per update; ``eta = 0`` is synchronous training,
  ``eta = 1`` one-step overlap.
- **Buffer / trainer**: the trainer takes the ``B`` oldest finished trajectories, drops any older
  than ``eta`` versions (counted), trains for ``step_base_s + s_per_token * tokens`` seconds
  (tokens = prompt + response of the batch), then publishes weights: ``sync.seconds`` during
  which the trainer waits and every engine is paused; with ``sync.reencode`` the in-flight
  requests are re-encoded (prefill of prompt + partial response) afterwards.
- **Dedicated old-logit model** (MISSION.md section 2, optional): each finished trajectory is
  queued on ``proximal.devices`` servers for ``proximal.s_per_token * tokens`` seconds before it
  reaches the buffer; with ``devices = 0`` and ``s_per_token > 0`` the trainer recomputes the
  proximal log-probs itself (the time is added to its step).

Staleness of a trajectory = trainer version at its update minus the version that produced its
oldest response token (the first decode step that reached it), as in the real trainer.

All times are seconds of simulated wall-clock; token counts are tokens.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from conveyor.runlog import read_jsonl


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Dist(_Strict):
    """Distribution of a non-negative quantity (tokens or seconds).

    Attributes:
        kind: ``constant`` (``value``), ``lognormal`` (``median`` and ``sigma`` of the underlying
            normal), ``uniform`` (``low``..``high``) or ``empirical`` (resample ``values``).
        scale: Multiplier applied to every draw (e.g. 32k-token responses from a measured shape).
        max: Optional upper bound applied after scaling (e.g. max new tokens).
        shift: Added to every draw after ``max`` (e.g. a reward-scoring latency on top of an
            environment wait).
        integer: Round draws to the nearest integer >= 1 (token counts).
    """

    kind: Literal["constant", "lognormal", "uniform", "empirical"] = "constant"
    value: float = 0.0
    median: float = 1.0
    sigma: float = 1.0
    low: float = 0.0
    high: float = 1.0
    values: list[float] = Field(default_factory=list)
    scale: float = 1.0
    max: float | None = None
    shift: float = 0.0
    integer: bool = False

    @model_validator(mode="after")
    def _check(self) -> Dist:
        if self.kind == "empirical" and not self.values:
            raise ValueError("an empirical distribution needs a non-empty 'values' list")
        if self.kind == "lognormal" and (self.median <= 0 or self.sigma < 0):
            raise ValueError(f"lognormal needs median > 0 and sigma >= 0, got {self.median}, {self.sigma}")
        if self.kind == "uniform" and self.high < self.low:
            raise ValueError(f"uniform needs low <= high, got {self.low}, {self.high}")
        if self.scale < 0:
            raise ValueError(f"scale must be >= 0, got {self.scale}")
        return self

    def draw(self, rng: random.Random) -> float:
        """One draw (after ``scale``, ``max`` and ``integer``)."""
        if self.kind == "constant":
            x = self.value
        elif self.kind == "lognormal":
            x = self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        elif self.kind == "uniform":
            x = rng.uniform(self.low, self.high)
        else:
            x = rng.choice(self.values)
        x *= self.scale
        if self.max is not None:
            x = min(x, self.max)
        x = max(0.0, x + self.shift)
        return float(max(1, round(x))) if self.integer else x

    def mean(self) -> float:
        """Expected value before ``max`` (exact for constant / uniform / empirical / lognormal)."""
        if self.kind == "constant":
            m = self.value
        elif self.kind == "lognormal":
            m = self.median * math.exp(self.sigma**2 / 2)
        elif self.kind == "uniform":
            m = (self.low + self.high) / 2
        else:
            m = sum(self.values) / len(self.values)
        return m * self.scale + self.shift


class RolloutSim(_Strict):
    """Rollout side: ``workers`` engines with continuous batching (see the module docstring).
    ``shared_prefill``: a group's requests with the same context are prefilled once per weight
    version on a worker (identical-prompt deduplication and the prefix cache); false: each
    request pays its own prefill."""

    workers: int = Field(1, ge=1)
    max_batch_size: int = Field(32, ge=1)
    decode_base_s: float = Field(0.05, ge=0)
    decode_per_seq_s: float = Field(0.002, ge=0)
    prefill_s_per_token: float = Field(0.0, ge=0)
    shared_prefill: bool = True
    prompt_tokens: Dist = Field(default_factory=lambda: Dist(kind="constant", value=64, integer=True))
    response_tokens: Dist = Field(default_factory=lambda: Dist(kind="constant", value=64, integer=True))
    env_latency_s: Dist = Field(default_factory=lambda: Dist(kind="constant", value=0.0))
    turns: int = Field(1, ge=1)
    max_jump_steps: int = Field(8, ge=1)


class TrainerSim(_Strict):
    """Trainer: one update takes ``step_base_s + s_per_token * tokens / devices`` seconds;
    ``sync_mode_speedup`` divides it at ``eta = 0`` when trainer and engines share hardware (the
    synchronous trainer gets the idle rollout devices too); 1 means separate hardware."""

    devices: int = Field(1, ge=1)
    step_base_s: float = Field(0.0, ge=0)
    s_per_token: float = Field(0.01, ge=0)
    sync_mode_speedup: float = Field(1.0, gt=0)
    # a critic warm-up step (SimConfig.critic_warmup_steps): the same form, its own constants
    warmup_step_base_s: float = Field(0.0, ge=0)
    warmup_s_per_token: float = Field(0.0, ge=0)


class SyncSim(_Strict):
    """Weight publication: trainer blocked and engines paused for ``seconds``; ``reencode``
    re-prefills in-flight requests with the new weights (interruptible rollouts)."""

    seconds: float = Field(0.0, ge=0)
    reencode: bool = True


class ProximalSim(_Strict):
    """Old-logit (proximal) log-prob computation: a dedicated pool of ``devices`` servers, or
    (``devices = 0``) a recompute inside the trainer step; ``s_per_token`` = forward seconds per
    token on one device."""

    devices: int = Field(0, ge=0)
    s_per_token: float = Field(0.0, ge=0)


class SimConfig(_Strict):
    """A simulated pipeline. ``mode`` is a shorthand: ``sync`` sets eta 0, ``one_step`` eta 1,
    ``async`` keeps ``eta`` (``None`` = unbounded). ``critic_warmup_steps`` critic-only steps
    (SAO's warm-up, ``critic.warmup_steps``) come before the ``steps`` policy updates: each takes
    a batch of the initial policy's rollouts and ``trainer.warmup_step_base_s +
    trainer.warmup_s_per_token * tokens / devices`` seconds, publishes no weights (nothing goes
    stale) and counts as a version for the admission rule, as conveyor's controller does."""

    mode: Literal["sync", "one_step", "async"] = "async"
    eta: int | None = Field(2, ge=0)
    steps: int = Field(10, ge=1)
    critic_warmup_steps: int = Field(0, ge=0)
    batch_size: int = Field(8, ge=1)
    group_size: int = Field(4, ge=1)
    max_concurrent: int = Field(64, ge=1)
    seed: int = 0
    rollout: RolloutSim = Field(default_factory=RolloutSim)
    trainer: TrainerSim = Field(default_factory=TrainerSim)
    sync: SyncSim = Field(default_factory=SyncSim)
    proximal: ProximalSim = Field(default_factory=ProximalSim)

    @property
    def effective_eta(self) -> int | None:
        """eta after applying ``mode``."""
        return {"sync": 0, "one_step": 1}.get(self.mode, self.eta)


@dataclass
class SimResult:
    """What :func:`simulate` predicts.

    Attributes:
        wall_seconds: Simulated time until the last update's weights are published (s), the
            critic warm-up included (``extra["warmup_seconds"]``: its share).
        step_seconds: Wall-clock of each policy update (s), from the previous one's end.
        trainer_busy / rollout_busy: Busy fractions of ``wall_seconds`` (rollout: mean over
            workers of time spent in prefill / decode), in [0, 1] by construction
            (:class:`_BusyClock`: work still running when the last update is published counts
            only up to that moment).
        staleness: Histogram ``{version lag: trajectories}`` of trained trajectories.
        dropped_stale: Trajectories dropped as older than eta.
        trajectories_per_s / tokens_per_s: Trained trajectories and tokens per second.
        proximal_busy: Busy fraction of the dedicated old-logit pool (0 without one).
    """

    wall_seconds: float
    step_seconds: list[float]
    trainer_busy: float
    rollout_busy: float
    staleness: dict[int, int]
    dropped_stale: int
    trajectories_per_s: float
    tokens_per_s: float
    proximal_busy: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary (staleness as mean / max / histogram)."""
        n = sum(self.staleness.values())
        mean = sum(k * v for k, v in self.staleness.items()) / n if n else 0.0
        return {
            "wall_seconds": self.wall_seconds,
            "mean_step_seconds": statistics.fmean(self.step_seconds) if self.step_seconds else 0.0,
            "trainer_busy": self.trainer_busy,
            "trainer_idle": 1.0 - self.trainer_busy,
            "rollout_busy": self.rollout_busy,
            "rollout_idle": 1.0 - self.rollout_busy,
            "proximal_busy": self.proximal_busy,
            "staleness_mean": mean,
            "staleness_max": max(self.staleness) if self.staleness else 0,
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
            "dropped_stale": self.dropped_stale,
            "trajectories_per_s": self.trajectories_per_s,
            "tokens_per_s": self.tokens_per_s,
            "warmup_seconds": self.extra.get("warmup_seconds", 0.0),  # of wall_seconds: the critic warm-up
        }


# ----------------------------------------------------------------------------- the model
@dataclass
class _Req:
    prompt: int
    remaining: int
    done: Any  # simpy event
    generated: int = 0
    first_version: int | None = None
    needs_reencode: bool = False
    prefix: tuple | None = None  # (episode, context tokens): the group-mates sharing this context


@dataclass
class _Traj:
    tokens: int
    oldest_version: int


class _BusyClock:
    """Busy time of a station (one or more servers), on the simulation clock.

    A busy stretch is recorded by its start and end instants (:meth:`begin` / :meth:`end`, both
    ``env.now``), never as the planned duration added up front: a decode step, prefill or
    old-logit pass still running when the simulation stops (at the last publication) counts only
    up to that moment. The busy seconds are then a sum of disjoint stretches inside
    ``[0, wall]`` per server, and :meth:`fraction` sums the end points with exact rational
    arithmetic (``fractions.Fraction``; floats are exact rationals), so ``busy <= servers * wall``
    holds exactly and the fraction is in ``[0, 1]`` without clamping (the division, rounded to the
    nearest float, cannot exceed 1.0). Back-to-back stretches are merged (``[a, b] + [b, c] =
    [a, c]``), so a continuously busy worker keeps few numbers.
    """

    def __init__(self, env):
        self.env = env
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.open: dict[int, float] = {}  # stretches in progress: key -> start
        self._next = 0

    def begin(self) -> int:
        """Start a busy stretch now; returns its key for :meth:`end`."""
        key, self._next = self._next, self._next + 1
        self.open[key] = self.env.now
        return key

    def end(self, key: int) -> None:
        """End the stretch ``key`` now."""
        start, now = self.open.pop(key), self.env.now
        if self.ends and self.ends[-1] == start:
            self.ends[-1] = now  # contiguous with the previous stretch: one stretch
        else:
            self.starts.append(start)
            self.ends.append(now)

    def seconds(self) -> Fraction:
        """Exact busy seconds up to now (stretches in progress cut at now)."""
        now = Fraction(self.env.now)
        ends = sum(map(Fraction, self.ends), Fraction(0)) + now * len(self.open)
        return ends - sum(map(Fraction, self.starts), Fraction(0)) - sum(map(Fraction, self.open.values()), Fraction(0))

    def fraction(self, wall: float, servers: int = 1) -> float:
        """Busy share of ``servers * wall`` seconds, in [0, 1] (0 when ``wall`` is 0)."""
        if wall <= 0 or servers <= 0:
            return 0.0
        return float(self.seconds() / (Fraction(wall) * servers))


AFFINITY_SLACK = 8  # EngineRouter's default affinity_slack (requests in flight)


class _Worker:
    def __init__(self, env, cfg: RolloutSim, sim: _Sim):
        self.env, self.cfg, self.sim = env, cfg, sim
        self.active: list[_Req] = []
        self.queue: list[_Req] = []
        self.wake = env.event()
        self.busy = _BusyClock(env)
        self.cached: set[tuple] = set()  # contexts prefilled with the current weights (prefix cache)
        self.cached_version = 0
        self.proc = env.process(self.run())

    def load(self) -> int:
        return len(self.active) + len(self.queue)

    def has(self, prefix: tuple) -> bool:
        """Whether this worker holds or will hold ``prefix``'s prefill (routing affinity)."""
        return prefix in self.cached or any(r.prefix == prefix for r in self.queue) or any(
            r.prefix == prefix for r in self.active)

    def submit(self, req: _Req) -> None:
        self.queue.append(req)
        if not self.wake.triggered:
            self.wake.succeed()

    def run(self):
        env, cfg = self.env, self.cfg
        while True:
            if self.sim.paused is not None:
                yield self.sim.paused
                continue
            prefill_tokens = 0
            if self.cached_version != self.sim.version:  # new weights: the prefix cache is emptied
                self.cached.clear()
                self.cached_version = self.sim.version
            again = [r for r in self.active if r.needs_reencode]
            rows = Counter(r.prefix for r in again if cfg.shared_prefill and r.prefix is not None)
            for r in again:
                if rows[r.prefix] < 2:  # (Counter: 0 for None) a row sharing nothing runs whole
                    prefill_tokens += r.prompt + r.generated
                else:  # a prompt several rows share is re-encoded once (and cached), each row its response
                    if r.prefix not in self.cached:
                        prefill_tokens += r.prompt
                        self.cached.add(r.prefix)
                    prefill_tokens += r.generated
                r.needs_reencode = False
            now: set[tuple] = set()  # contexts prefilled in this admission (deduplicated)
            while self.queue and len(self.active) < cfg.max_batch_size:
                r = self.queue.pop(0)
                key = r.prefix if cfg.shared_prefill else None
                if key is not None and key in now:
                    pass  # an identical prompt admitted together: prefilled once
                elif key is not None and key in self.cached:
                    pass  # a group-mate's context is cached: it joins the batch, whose decode step runs its last token
                else:
                    prefill_tokens += r.prompt
                    if key is not None:
                        now.add(key)
                        self.cached.add(key)
                self.active.append(r)
            if not self.active:
                self.wake = env.event()
                yield self.wake
                continue
            if prefill_tokens:
                dt = prefill_tokens * cfg.prefill_s_per_token
                k = self.busy.begin()
                yield env.timeout(dt)
                self.busy.end(k)
            for r in self.active:
                if r.first_version is None:
                    r.first_version = self.sim.version
            b = len(self.active)
            n = min(min(r.remaining for r in self.active), cfg.max_jump_steps)
            dt = n * (cfg.decode_base_s + cfg.decode_per_seq_s * b)
            k = self.busy.begin()
            yield env.timeout(dt)
            self.busy.end(k)
            still = []
            for r in self.active:
                r.remaining -= n
                r.generated += n
                if r.remaining <= 0:
                    r.done.succeed()
                else:
                    still.append(r)
            self.active = still


class _Sim:
    def __init__(self, cfg: SimConfig):
        import simpy

        self.cfg = cfg
        self.env = simpy.Environment()
        self.rng = random.Random(cfg.seed)
        self.eta = cfg.effective_eta
        self.B = cfg.batch_size * cfg.group_size
        self.version = 0
        self.warmup_done = 0  # critic warm-up steps taken: versions for the admission rule only
        self.warmup_seconds = 0.0
        self.running = 0
        self.accepted = 0
        self.episodes = 0
        self.paused = None
        self.buffer: list[_Traj] = []
        self.buffer_event = self.env.event()
        self.controller_event = self.env.event()
        self.workers = [_Worker(self.env, cfg.rollout, self) for _ in range(cfg.rollout.workers)]
        self.proximal = simpy.Resource(self.env, capacity=cfg.proximal.devices) if cfg.proximal.devices else None
        self.proximal_busy = _BusyClock(self.env)
        self.trainer_busy = _BusyClock(self.env)
        self.staleness: Counter[int] = Counter()
        self.dropped = 0
        self.step_seconds: list[float] = []
        self.trained_tokens = 0
        self.finished = self.env.event()

    def _route(self, req: _Req) -> _Worker:
        """The least loaded worker, except that a group-mate goes to the worker that has its
        prompt (queued, running or cached) while that one has at most ``AFFINITY_SLACK`` more
        requests than the least loaded (conveyor's EngineRouter, ``affinity_slack``)."""
        least = min(self.workers, key=lambda w: w.load())
        if req.prefix is not None and self.cfg.rollout.shared_prefill:
            for w in self.workers:
                if w.has(req.prefix) and w.load() <= least.load() + AFFINITY_SLACK:
                    return w
        return least

    def _notify_controller(self):
        if not self.controller_event.triggered:
            self.controller_event.succeed()

    def capacity(self) -> int:
        free = self.cfg.max_concurrent - self.running
        if self.eta is None:
            return free
        return min(free, (self.eta + self.version + self.warmup_done + 1) * self.B - (self.accepted + self.running))

    def controller(self):
        G = self.cfg.group_size
        while not self.finished.triggered:
            while self.capacity() >= G:
                self.running += G
                self.env.process(self.episode())
            self.controller_event = self.env.event()
            yield self.controller_event | self.finished

    def episode(self):
        cfg = self.cfg.rollout
        G = self.cfg.group_size
        prompt = int(cfg.prompt_tokens.draw(self.rng))
        self.episodes += 1
        eid = self.episodes
        trajs = []
        for _g in range(G):
            trajs.append({"context": prompt, "tokens": prompt, "oldest": None})

        def generate(t):
            resp = int(cfg.response_tokens.draw(self.rng))
            # the first turn's context is the group's shared prompt; later turns' contexts differ
            req = _Req(prompt=t["context"], remaining=resp, done=self.env.event(),
                       prefix=(eid, t["context"]) if t["context"] == prompt else None)
            self._route(req).submit(req)
            yield req.done
            if t["oldest"] is None:
                t["oldest"] = req.first_version
            t["context"] += resp
            t["tokens"] += resp

        def old_logits(t):
            with self.proximal.request() as slot:
                yield slot
                dt = self.cfg.proximal.s_per_token * t["tokens"]
                k = self.proximal_busy.begin()
                yield self.env.timeout(dt)
                self.proximal_busy.end(k)

        for _turn in range(cfg.turns):
            # the group's responses are generated concurrently, then the episode waits once on
            # its environment (as conveyor's EnvLatencyWorkflow does)
            yield self.env.all_of([self.env.process(generate(t)) for t in trajs])
            lat = cfg.env_latency_s.draw(self.rng)
            if lat > 0:
                yield self.env.timeout(lat)
        if self.proximal is not None and self.cfg.proximal.s_per_token > 0:
            yield self.env.all_of([self.env.process(old_logits(t)) for t in trajs])
        self.running -= G
        self.accepted += G
        self.buffer.extend(_Traj(t["tokens"], t["oldest"] if t["oldest"] is not None else self.version) for t in trajs)
        if not self.buffer_event.triggered:
            self.buffer_event.succeed()
        self._notify_controller()

    def trainer(self):
        cfg = self.cfg
        last = 0.0
        for _ in range(cfg.critic_warmup_steps):  # critic-only steps on the initial policy's rollouts
            while len(self.buffer) < self.B:
                self.buffer_event = self.env.event()
                yield self.buffer_event
            batch, self.buffer = self.buffer[: self.B], self.buffer[self.B :]
            tokens = sum(t.tokens for t in batch)
            k = self.trainer_busy.begin()
            yield self.env.timeout(cfg.trainer.warmup_step_base_s
                                   + cfg.trainer.warmup_s_per_token * tokens / cfg.trainer.devices)
            self.trainer_busy.end(k)
            self.warmup_done += 1
            self._notify_controller()
        self.warmup_seconds = last = self.env.now
        for _ in range(cfg.steps):
            while True:
                if self.eta is not None:
                    fresh = [t for t in self.buffer if self.version - t.oldest_version <= self.eta]
                    dropped = len(self.buffer) - len(fresh)
                    if dropped:
                        self.dropped += dropped
                        self.buffer = fresh
                        self.accepted -= dropped  # freed capacity, as StalenessManager.on_drop
                        self._notify_controller()
                if len(self.buffer) >= self.B:
                    break
                self.buffer_event = self.env.event()
                yield self.buffer_event
            self.buffer.sort(key=lambda t: t.oldest_version)
            batch, self.buffer = self.buffer[: self.B], self.buffer[self.B :]
            tokens = sum(t.tokens for t in batch)
            for t in batch:
                self.staleness[self.version - t.oldest_version] += 1
            dt = cfg.trainer.step_base_s + cfg.trainer.s_per_token * tokens / cfg.trainer.devices
            if self.proximal is None and cfg.proximal.s_per_token > 0:
                dt += cfg.proximal.s_per_token * tokens / cfg.trainer.devices
            if self.eta == 0:
                dt /= cfg.trainer.sync_mode_speedup
            k = self.trainer_busy.begin()
            yield self.env.timeout(dt)
            if cfg.sync.seconds > 0:  # publishing the weights keeps the trainer busy too
                self.paused = self.env.event()
                yield self.env.timeout(cfg.sync.seconds)
                ev, self.paused = self.paused, None
                ev.succeed()
            self.trainer_busy.end(k)
            self.version += 1
            self.trained_tokens += tokens
            if cfg.sync.reencode:
                for w in self.workers:
                    for r in w.active:
                        r.needs_reencode = True
            self.step_seconds.append(self.env.now - last)
            last = self.env.now
            self._notify_controller()
        self.finished.succeed()

    def run(self) -> SimResult:
        self.env.process(self.controller())
        self.env.process(self.trainer())
        self.env.run(until=self.finished)
        wall = self.env.now
        n = self.cfg.steps * self.B
        rollout = sum((w.busy.seconds() for w in self.workers), Fraction(0))
        return SimResult(
            wall_seconds=wall,
            step_seconds=self.step_seconds,
            trainer_busy=self.trainer_busy.fraction(wall),
            rollout_busy=float(rollout / (Fraction(wall) * len(self.workers))) if wall else 0.0,
            staleness=dict(self.staleness),
            dropped_stale=self.dropped,
            trajectories_per_s=n / wall if wall else 0.0,
            tokens_per_s=self.trained_tokens / wall if wall else 0.0,
            proximal_busy=self.proximal_busy.fraction(wall, self.cfg.proximal.devices) if self.proximal else 0.0,
            extra={"warmup_seconds": self.warmup_seconds} if self.cfg.critic_warmup_steps else {},
        )


def simulate(cfg: SimConfig) -> SimResult:
    """Run the discrete-event model of ``cfg`` (see the module docstring) until ``cfg.steps``
    updates are published.

    Returns:
        A :class:`SimResult` (seconds of simulated wall-clock, busy fractions, staleness).
    """
    return _Sim(cfg).run()


# ----------------------------------------------------------------------------- calibration
def _fit_line(xs: list[float], ys: list[float], ws: list[float] | None = None) -> tuple[float, float]:
    """Weighted least squares ``y = a + b x``; ``a, b`` clamped to >= 0 (refit through the origin
    when the intercept would be negative)."""
    ws = ws or [1.0] * len(xs)
    sw = sum(ws)
    if sw == 0 or not xs:
        raise ValueError("no data to fit")
    mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / sw
    my = sum(w * y for w, y in zip(ws, ys, strict=True)) / sw
    vxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
    if vxx <= 1e-12:
        return (max(0.0, my - 0.0), 0.0) if mx == 0 else (0.0, max(0.0, my / mx))
    b = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True)) / vxx
    a = my - b * mx
    if a < 0:
        b = sum(w * x * y for w, x, y in zip(ws, xs, ys, strict=True)) / sum(w * x * x for w, x in zip(ws, xs, strict=True))
        a = 0.0
    return a, max(0.0, b)


def trace_eta(steps: list[dict], configured: int | None) -> tuple[int | None, str | None]:
    """The staleness bound a run trained under, from its metrics rows' ``staleness/eta`` (the
    bound in force at each update: the adaptive controller, a monitor action or a resume with
    another ``async.eta`` may move it away from ``config.json``'s ``async.eta``; fresh-user
    finding): the value in force for the most updates (ties: the later one), NaN meaning
    unbounded (None). Rows without the metric (runs from before it was logged) give
    ``configured``.

    Returns:
        ``(eta, note)``: ``note`` says how the trace's bound differs from ``configured`` (None
        when it does not).
    """
    seen = [m["staleness/eta"] for m in steps if isinstance(m.get("staleness/eta"), int | float)]
    if not seen:
        return configured, None
    values = [None if math.isnan(v) else int(v) for v in seen]
    counts: dict[int | None, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    best = max(counts.values())
    eta = [v for v in values if counts[v] == best][-1]
    if len(counts) == 1 and eta == configured:
        return eta, None
    spread = ", ".join(f"{'unbounded' if v is None else v} for {n}" for v, n in counts.items())
    return eta, (f"the run trained at eta {spread} of its {len(values)} updates (config.json's async.eta: "
                 f"{configured}); simulating eta {eta}, the bound in force longest")


def calibrate(run_dir: str | Path, notes: list[str] | None = None) -> SimConfig:
    """A :class:`SimConfig` reproducing a real run, from the trace its run directory holds.

    Reads ``config.json`` (batch, group, concurrency, steps, ``rollout.num_engines`` as the
    number of engine workers), ``engine_stats.json`` (decode
    forward seconds per batch size, fitted to ``base + per_seq * b``, plus the sampling seconds
    per generated token added to ``per_seq``; prefill seconds per token the model ran, after
    identical-prompt deduplication and prefix-cache hits, matching the simulator's
    ``shared_prefill`` charge),
    ``trained.jsonl`` (prompt / response lengths of every trained trajectory, and its episode's
    environment wait plus reward-scoring latency as ``env_latency_s``: empirical distributions)
    and ``metrics.jsonl`` (trainer seconds vs tokens per update, fitted to ``base + s_per_token *
    tokens``, the first update excluded as warm-up when there are more than two, plus the median
    bookkeeping seconds between updates; weight-sync seconds, median; the staleness bound in
    force, :func:`trace_eta`, else ``config.json``'s ``async.eta``) and, for a run with a critic
    warm-up (``critic.warmup_steps``), ``critic_warmup.jsonl`` (critic-only step seconds vs
    tokens, fitted the same way: ``critic_warmup_steps`` and ``trainer.warmup_*``).

    Args:
        run_dir: The run directory.
        notes: When given, what the calibration should tell the user is appended to it (e.g.
            :func:`trace_eta`'s note on a bound that moved during the run).

    Raises:
        FileNotFoundError: a required file is missing (the message names it).
        ValueError: the trace holds too little data to fit (e.g. no finished update).
    """
    run_dir = Path(run_dir)
    paths = {n: run_dir / n for n in ("config.json", "engine_stats.json", "trained.jsonl", "metrics.jsonl")}
    for n, p in paths.items():
        if not p.is_file():
            if n == "engine_stats.json" and paths["config.json"].is_file():  # a run whose process has not ended
                from conveyor.runtime_files import holder_name, lock_holder

                holder = lock_holder(run_dir)
                if holder is not None:
                    who = holder_name(holder)
                    raise FileNotFoundError(f"{p}: missing: the run is being trained now by {who}, and a training "
                                            "process writes it when it ends; calibrate once the run has finished "
                                            "or stopped (Ctrl-C)")
                raise FileNotFoundError(f"{p}: missing: the run's last process ended without writing it (killed, "
                                        f"e.g. by SIGKILL or out of memory); `conveyor train --resume {run_dir}` "
                                        "and let it end (or stop it with Ctrl-C), then calibrate")
            raise FileNotFoundError(f"{p}: missing; calibrate needs a run directory written by `conveyor train` ({n})")
    conf = json.loads(paths["config.json"].read_text())
    eng = json.loads(paths["engine_stats.json"].read_text())
    prof = {int(b): v for b, v in eng.get("decode_profile", {}).items()}
    if not prof and eng.get("engine") in ("vllm", "sglang"):
        raise ValueError(f"{paths['engine_stats.json']}: the run generated with rollout.engine={eng['engine']}, whose "
                         "server reports no per-batch decode profile; calibrate from a run with rollout.engine=local")
    if not prof:
        raise ValueError(f"{paths['engine_stats.json']}: no decode_profile (no decode step was run)")
    bs = sorted(prof)
    base, per_seq = _fit_line([float(b) for b in bs], [prof[b][1] / prof[b][0] for b in bs], [float(prof[b][0]) for b in bs])
    if eng.get("generated_tokens"):  # sampling runs once per generated token, outside the profile
        per_seq += eng.get("sample_seconds", 0.0) / eng["generated_tokens"]
    prefill = eng["prefill_seconds"] / eng["prefill_tokens"] if eng.get("prefill_tokens") else 0.0
    prompts: list[float] = []
    responses: list[float] = []
    env_waits: list[float] = []
    reward_waits: list[float] = []
    # one row per step: a run directory written before resumes superseded their rows may hold a
    # step twice, and a killed process may leave a half-written last line (conveyor.runlog)
    for rec in read_jsonl(paths["trained.jsonl"], by_step=True):
        for g in rec["groups"]:
            for p, r in g.get("lengths", []):
                prompts.append(p)
                responses.append(r)
            env = g.get("env_seconds") or [0.0] * len(g.get("lengths", []))
            rew = g.get("reward_seconds") or [0.0] * len(env)
            env_waits.extend(e + r for e, r in zip(env, rew, strict=False))  # the episode waits for both
            reward_waits.extend(rew)
    if not responses:
        raise ValueError(f"{paths['trained.jsonl']}: no trajectory lengths recorded")
    steps = read_jsonl(paths["metrics.jsonl"], by_step=True)
    steps = [m for m in steps if "time/train_step_s" in m]
    if not steps:
        raise ValueError(f"{paths['metrics.jsonl']}: no finished update")
    fit = steps[1:] if len(steps) > 2 else steps
    # train/tokens counts response tokens; the simulator's tokens are prompt + response
    mean_prompt = statistics.fmean(prompts)
    B = conf["trainer"]["batch_size"] * conf["rollout"]["group_size"]
    t_base, t_tok = _fit_line([m["train/tokens"] + B * mean_prompt for m in fit], [m["time/train_step_s"] for m in fit])
    sync_s = statistics.median(m.get("time/weight_sync_s", 0.0) for m in steps)
    books = [m["time/bookkeeping_s"] for m in steps if "time/bookkeeping_s" in m]
    t_base += statistics.median(books) if books else 0.0  # metrics, logs, checkpoints between updates
    lat = conf["rollout"].get("env_latency") or {}
    if lat.get("median_s", 0) > 0:
        # a configured (simulated) environment: its exact distribution, not the waits of the
        # trajectories that happened to be trained (short waits are over-represented there: the
        # long ones were still in flight when the run ended)
        env = Dist(kind="lognormal", median=lat["median_s"], sigma=lat["sigma"], max=lat["max_s"],
                   shift=statistics.fmean(reward_waits) if reward_waits else 0.0)
    elif any(w > 0 for w in env_waits):
        env = Dist(kind="empirical", values=env_waits)
    else:
        env = Dist(kind="constant", value=0.0)
    warmup_steps, w_base, w_tok = 0, 0.0, 0.0
    warm_path = run_dir / "critic_warmup.jsonl"
    if conf.get("loss", {}).get("advantage") == "gae" and conf.get("critic", {}).get("warmup_steps", 0) > 0:
        warmup_steps = int(conf["critic"]["warmup_steps"])
        warm = [m for m in (read_jsonl(warm_path, by_step=True) if warm_path.is_file() else [])
                if "time/critic_warmup_step_s" in m and "train/tokens" in m]
        if warm:
            w_base, w_tok = _fit_line([m["train/tokens"] + B * mean_prompt for m in warm],
                                      [m["time/critic_warmup_step_s"] for m in warm])
            w_base += statistics.median(books) if books else 0.0
        elif notes is not None:
            notes.append(f"critic.warmup_steps={warmup_steps} but {warm_path} holds no timed warm-up step: the "
                         "warm-up is simulated at no cost")
    eta, eta_note = trace_eta(steps, conf["async"]["eta"])
    if notes is not None and eta_note is not None:
        notes.append(eta_note)
    return SimConfig(
        mode="async",
        eta=eta,
        steps=len(steps),
        critic_warmup_steps=warmup_steps,
        batch_size=conf["trainer"]["batch_size"],
        group_size=conf["rollout"]["group_size"],
        max_concurrent=max(conf["rollout"]["max_concurrent"], conf["rollout"]["group_size"]),
        seed=conf["run"]["seed"],
        rollout=RolloutSim(
            workers=int(conf["rollout"].get("num_engines", 1)), max_batch_size=conf["rollout"]["max_batch_size"],
            decode_base_s=base, decode_per_seq_s=per_seq,
            prefill_s_per_token=prefill, prompt_tokens=Dist(kind="empirical", values=prompts, integer=True),
            response_tokens=Dist(kind="empirical", values=responses, integer=True), env_latency_s=env,
        ),
        trainer=TrainerSim(step_base_s=t_base, s_per_token=t_tok, warmup_step_base_s=w_base,
                           warmup_s_per_token=w_tok),
        sync=SyncSim(seconds=sync_s),
    )


def validate_sim_config(data: dict[str, Any], src: str) -> SimConfig:
    """:class:`SimConfig` from a mapping; a validation error as ``conveyor train``'s config errors
    are (:func:`conveyor.config.format_validation_error`: one line per key, no pydantic codes).

    Args:
        data: The config mapping. src: where it came from (a file, a run directory, overrides).

    Raises:
        conveyor.config.ConfigError: invalid content (a ``ValueError``; the message names ``src``
            and each key).
    """
    from pydantic import ValidationError

    from conveyor.config import ConfigError, format_validation_error

    try:
        return SimConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, src, what="simulator config")) from e


def load_sim_config(path: str | Path, overrides: list[str] | None = None) -> SimConfig:
    """Read a YAML / JSON simulator config and apply ``key.sub=value`` overrides (values parsed as
    YAML, e.g. ``eta=4``, ``rollout.workers=64``).

    Raises:
        FileNotFoundError: no such file. ValueError: invalid content (a
            :class:`~conveyor.config.ConfigError`; the message names the file and the field).
    """
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such simulator config")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{p}: a simulator config must be a mapping, got {type(data).__name__}")
    from conveyor.config import ConfigError, TrainConfig

    # top-level sections of a training config (field names and their file spellings, e.g. async)
    # that a simulator config never has
    train_sections = {n for name, f in TrainConfig.model_fields.items() for n in (name, f.alias) if n}
    train_only = sorted(set(data) & (train_sections - set(SimConfig.model_fields)))
    if train_only:  # fresh-user trial 5: a list of "unknown key" lines said nothing of what went wrong

        raise ConfigError(
            f"{p} is a `conveyor train` config (sections {', '.join(train_only)}), not a simulator config: "
            "conveyor simulate takes a simulator config (configs/simulate/) or the directory of a finished run "
            "(calibrated from its trace, e.g. conveyor simulate runs/<run>)")
    data = apply_overrides(data, overrides or [])
    return validate_sim_config(data, " + ".join([str(p), *(overrides or [])]))


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set ``section.key=value`` overrides (values parsed as YAML) in a config mapping, in place.

    Raises:
        ValueError: an override without ``=`` or with an empty key
            (:func:`conveyor.config.split_override`), or through a non-section key.
    """
    import yaml

    from conveyor.config import split_override

    for ov in overrides:
        key, val = split_override(ov, command="conveyor simulate", others=overrides, example="rollout.workers=64")
        node = data
        parts = key.split(".")
        for k in parts[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {ov!r}: {k} is not a section")
        node[parts[-1]] = yaml.safe_load(val)
    return data
