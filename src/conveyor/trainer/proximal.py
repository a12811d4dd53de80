"""Proximal ("old logits") strategies: where the denominator of the policy ratio comes from when
training data is stale (MISSION.md section 2, arXiv 2605.12070; AReaL arXiv 2505.24298 eq. 5).

One config key, ``proximal.method``:

============== ======================================================= =================== =========================
method         old log-probs of a token sampled at version u           exact?              extra cost
============== ======================================================= =================== =========================
recompute      forward pass with the current parameters (version v)    only when u = v     one forward (free when
                                                                                           ``minibatches = 1``: the
                                                                                           gradient pass is reused)
behavior       the engine's log-probs (bypass)                         inference-side      none
snapshot       forward with a stored copy of the version-u parameters  yes (training side) (eta + 1) parameter copies,
                                                                                           one forward per version
partial_sync   scored at the weight update that retires version u:     yes (training side) engine paused for one
               rollouts pause, every unscored token (in flight,                            forward over all partial
               finished, buffered) gets the outgoing parameters'                           and unscored trajectories
               log-prob, then the update and resume                                        per update
dedicated      a separate old-logit worker (own weight copy, own       yes (training side) one parameter copy, its
               thread) scores version u's tokens after the engine                          own compute; the trainer
               moved to u + 1, concurrently with training                                  waits only if it lags
interpolate    loglinear / linear mix of pi_behav and pi_theta with    no (rescales clip   none
               AReaL's per-token alpha                                 bounds only)
ewma           forward with an EWMA of the parameters (bias-corrected, no (proxy)          one parameter copy, one
               adaptive decay, auto-reset on a low keep-rate)                              forward
auto           the cheapest exact method that fits                     --                  see the chosen one
               ``proximal.memory_budget_bytes``, else ewma
============== ======================================================= =================== =========================

A strategy never changes the trainer's parameters. Each reports its cost (``extra_bytes``: host
memory it holds; the trainer logs the seconds it spends as ``time/proximal_s``) so the run report
can compare methods.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch

from conveyor.hardware import set_own_thread_count
from conveyor.sync import WeightUpdate, apply_update
from conveyor.trainer.corrections import interpolated_proximal, interpolation_alpha

log = logging.getLogger(__name__)

METHODS = ("recompute", "behavior", "snapshot", "partial_sync", "dedicated", "interpolate", "ewma", "auto")


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of one copy of ``model``'s parameters and buffers (tied tensors counted once)."""
    seen = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


@dataclass
class ProximalStats:
    """Per-step facts a strategy reports (merged into the trainer's metrics as ``proximal/*``)."""

    values: dict[str, float] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)


class ProximalStrategy:
    """Base class. The trainer calls, per step:

    1. ``old_logprobs(trainer, mb)`` for every micro-batch before any optimiser step: a ``[R, L]``
       tensor of old log-probs, or None to use the (detached) log-probs of the gradient forward
       pass, computed with the current parameters;
    2. ``from_forward(theta_logprobs, mb, version)`` when ``old_logprobs`` returned None and the
       gradient pass has run: may transform the detached current log-probs (interpolation);
    3. ``on_optimizer_step(model, window)`` after every optimiser step of the update (EWMA);
    4. ``after_update(model, new_version, metrics)`` after the optimiser step(s).

    Attributes:
        name: The method name. exact: True if it recovers pi_old_train exactly at any staleness.
    """

    name = "base"
    exact = False

    def old_logprobs(self, trainer, mb) -> torch.Tensor | None:
        return None

    def from_forward(self, theta_logprobs: torch.Tensor, mb, version: int) -> torch.Tensor:
        return theta_logprobs

    def on_optimizer_step(self, model: torch.nn.Module, window: int) -> None:
        """Called after every optimiser step with ``model``'s new parameters; ``window`` is the
        width of the batch's version window in optimiser steps (its largest staleness x the
        optimiser steps per update; 0 in a synchronous run)."""
        return None

    def after_update(self, model: torch.nn.Module, new_version: int, metrics: dict[str, float]) -> ProximalStats:
        return ProximalStats()

    def extra_bytes(self) -> int:
        """Host memory held by the strategy (bytes)."""
        return 0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None

    def on_load(self, model: torch.nn.Module, version: int) -> None:
        """The trainer's parameters were replaced by a checkpoint at ``version``."""
        return None


class Recompute(ProximalStrategy):
    """Current parameters (AReaL's recompute); exact only for tokens sampled by them (u = v)."""

    name = "recompute"


class Behavior(ProximalStrategy):
    """The inference engine's log-probs (no training-side old log-probs at all)."""

    name = "behavior"

    def old_logprobs(self, trainer, mb):
        return mb.behaviour_logprobs


class PartialSync(ProximalStrategy):
    """Partial-rollout interruption sync (MISSION.md section 2, recovery 3): no stored history.

    At every weight update the publisher (:class:`~conveyor.runtime.publish.PartialSyncPublisher`)
    pauses the engine, which still holds the outgoing parameters (version v), and asks it to
    score (:func:`score_old_logprobs`) every token sampled by version v -- in in-flight
    requests, finished ones, buffered trajectories -- with a training-side forward pass (the
    trainer's :class:`~conveyor.trainer.logprobs.ScoringSpec`); the patches go to the rollout
    side and reach the trajectory when it is handed to the trainer. At training time a token of the trainer's current version uses the gradient
    pass's log-probs (exact), older tokens their recorded value. Tokens with neither (e.g.
    sampled before a resume) fall back to the current parameters and are counted
    (``proximal/partial_sync_missing_frac``).
    """

    name = "partial_sync"
    exact = True

    def __init__(self):
        self._missing = 0
        self._tokens = 0

    def from_forward(self, theta_logprobs, mb, version):
        stored = mb.old_logprobs if mb.old_logprobs is not None else torch.full_like(theta_logprobs, float("nan"))
        out = torch.where(mb.versions == version, theta_logprobs, stored)
        m = mb.mask > 0
        missing = torch.isnan(out) & m
        self._missing += int(missing.sum())
        self._tokens += int(m.sum())
        return torch.where(torch.isnan(out), theta_logprobs, out)

    def after_update(self, model, new_version, metrics):
        st = ProximalStats({"proximal/partial_sync_missing_frac": self._missing / max(1, self._tokens)})
        self._missing = self._tokens = 0
        return st


def score_old_logprobs(spec, model: torch.nn.Module, items, version: int):
    """Partial-rollout sync's scoring (MISSION.md section 2, recoveries 2 and 3): the
    training-side log-probs, under ``model`` (the outgoing parameters, version ``version``), of
    every token of ``items`` sampled by ``version``, as old-log-prob patches addressed to the
    engine requests that generated them (:mod:`conveyor.rollout.old_logprobs`). Tokens of other
    versions get NaN (older ones were scored at their own publish). Items without a token of
    ``version`` are skipped (no forward pass).

    Args:
        spec: The trainer's :class:`~conveyor.trainer.logprobs.ScoringSpec` (same temperature,
            autocast, chunking and packing as training, kept sets replayed: the values equal the
            trainer's own for the same parameters).
        model: The model holding version ``version`` (the paused engine's, or the dedicated
            worker's copy).
        items: :class:`~conveyor.rollout.old_logprobs.ScoringItem` s (in-flight / finished
            requests, buffered trajectories).
        version: The outgoing version.

    Returns:
        ``(patches, n)``: a list of :class:`~conveyor.rollout.old_logprobs.OldLogprobPatch`
        (one per request span with a token of ``version``, covering the first to the last such
        token) and ``n``, the number of tokens scored.
    """
    from conveyor.rollout.old_logprobs import OldLogprobPatch
    from conveyor.trainer.batch import pack, plan_micro_batches
    from conveyor.types import Sample, Trajectory

    items = [it for it in items if version in it.versions]
    if not items:
        return [], 0
    # the kept sets of truncated sampling are replayed here too, so old log-probs are renormalised
    # over the same sets as the behaviour and current ones (docs/design.md, "Truncated sampling")
    trajs = [Trajectory(sample=Sample(f"old-logprob scoring {i}", "", "", ""), group_id=str(i),
                        prompt_ids=list(it.prompt_ids), response_ids=list(it.token_ids),
                        behaviour_logprobs=[0.0] * len(it.token_ids), versions=list(it.versions),
                        sampling_mask=it.sampling_mask)
             for i, it in enumerate(items)]
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
    patches: list[OldLogprobPatch] = []
    scored = 0
    zeros = torch.zeros(len(trajs))
    for rows in plan_micro_batches(lengths, spec.micro_batch_tokens, spec.pack_row_tokens):
        mb = pack(trajs, zeros, rows)
        lp = spec.logprobs(model, mb)
        for s, i in enumerate(mb.indices):
            vals = lp[(mb.seq_index == s) & (mb.mask > 0)].tolist()
            it = items[i]
            for key, offset, n in it.spans:
                own = [k for k in range(n) if it.versions[offset + k] == version]
                if not own:
                    continue
                lo, hi = own[0], own[-1] + 1
                patches.append(OldLogprobPatch(key, lo, tuple(
                    vals[offset + k] if it.versions[offset + k] == version else float("nan")
                    for k in range(lo, hi)), version))
                scored += len(own)
    return patches, scored


class Dedicated(PartialSync):
    """A dedicated old-logit model (MISSION.md section 2, recovery 2): a worker thread with its
    own copy of the weights (``threads`` intra-op threads) that lags the engine by one version.
    After each weight update the publisher hands it (:meth:`retire`) a snapshot of the engine's
    requests and the buffered trajectories plus the new weights; the worker scores every token of
    its current version (the one the engine just replaced) with :func:`score_old_logprobs`,
    delivers the patches (to the rollout side's book), then loads the new weights. Training overlaps with this; before an update at version w the
    trainer waits (:meth:`wait_retired`) until every version below w is scored, and the wait is
    the method's visible time cost (``proximal/dedicated_wait_s``). Exact like partial_sync
    without pausing rollouts; costs one parameter copy and the worker's compute (on a 2-core CPU
    it competes with the engine and the trainer).
    """

    name = "dedicated"
    exact = True

    def __init__(self, model: torch.nn.Module, version: int, threads: int = 1,
                 lora_base: dict[str, torch.Tensor] | None = None):
        import queue
        import threading

        from conveyor.trainer.lora import inference_copy

        super().__init__()
        # like an engine: a plain copy (a LoRA policy's adapters merged), and the base weights
        # W0 that adapter updates (lora.sync=adapter) are merged onto
        self.model = inference_copy(model).eval()
        self._lora_base = lora_base
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.version = version
        self.retired = version - 1  # every token of versions <= retired has an old log-prob
        self.threads = threads
        self._copy_bytes = param_bytes(model)
        self._jobs: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._spec = None
        self.error: BaseException | None = None
        self.busy_seconds = 0.0
        self.scored_tokens = 0
        self._wait = 0.0

    def start(self, trainer) -> None:
        """Start the worker thread (it scores with ``trainer.scoring_spec()``)."""
        import threading

        self._spec = trainer.scoring_spec()
        self._thread = threading.Thread(target=self._loop, name="conveyor-old-logits", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the worker after the queued jobs."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=60)
            self._thread = None

    def retire(self, items: list, update, deliver) -> None:
        """Queue: score ``items``' tokens of the worker's current version
        (:class:`~conveyor.rollout.old_logprobs.ScoringItem` s), call ``deliver(patches)``,
        then load ``update`` (a :class:`~conveyor.sync.WeightUpdate`); :meth:`wait_retired`
        returns only after the delivery."""
        self._jobs.put((items, update, deliver))

    def _loop(self) -> None:
        import time

        set_own_thread_count(self.threads)  # (the process-wide default stays as it was)
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                items, update, deliver = job
                t0 = time.perf_counter()
                patches, n = score_old_logprobs(self._spec, self.model, items, self.version)
                deliver(patches)
                with torch.no_grad():
                    if update.lora:  # LoRA factors: merged onto the base weights, like the engine
                        apply_update(dict(self.model.state_dict()), update, self._lora_base)
                    else:
                        self.model.load_state_dict(update.state_dict(), strict=False)
                with self._cond:
                    self.busy_seconds += time.perf_counter() - t0
                    self.scored_tokens += n
                    self.retired = self.version
                    self.version = update.version
                    self._cond.notify_all()
        except BaseException as e:  # reported to the trainer by wait_retired
            log.exception("dedicated old-logit worker crashed")
            with self._cond:
                self.error = e
                self._cond.notify_all()

    def wait_retired(self, version: int, timeout: float = 600.0) -> float:
        """Block until every version below ``version`` is scored; returns the seconds waited.

        Raises:
            RuntimeError: the worker crashed or did not catch up within ``timeout`` seconds.
        """
        import time

        t0 = time.perf_counter()
        with self._cond:
            while self.retired < version - 1 and self.error is None:
                if not self._cond.wait(timeout=max(0.0, timeout - (time.perf_counter() - t0))):
                    raise RuntimeError(f"dedicated old-logit worker did not retire version {version - 1} within {timeout} s")
            if self.error is not None:
                raise RuntimeError(f"dedicated old-logit worker failed: {self.error!r}") from self.error
        dt = time.perf_counter() - t0
        self._wait += dt
        return dt

    def after_update(self, model, new_version, metrics):
        st = super().after_update(model, new_version, metrics)
        st.values["proximal/dedicated_wait_s"] = self._wait
        st.values["proximal/dedicated_busy_s"] = self.busy_seconds
        self._wait = 0.0
        return st

    def extra_bytes(self) -> int:
        return self._copy_bytes


class Interpolate(ProximalStrategy):
    """AReaL's ``loglinear`` / ``linear`` proximal approximation with per-token alpha
    (:func:`conveyor.trainer.corrections.interpolated_proximal`)."""

    name = "interpolate"

    def __init__(self, kind: str = "loglinear"):
        if kind not in ("loglinear", "linear"):
            raise ValueError(f"proximal.interpolation must be 'loglinear' or 'linear', got {kind!r}")
        self.kind = kind

    def from_forward(self, theta_logprobs, mb, version):
        alpha = interpolation_alpha(mb.versions, version)
        return interpolated_proximal(theta_logprobs, mb.behaviour_logprobs, alpha, mb.mask, kind=self.kind)


class Snapshot(ProximalStrategy):
    """Parameter snapshots of every version inside the staleness window (host memory); each
    token's old log-prob is recomputed with the version that sampled it, version by version, so
    a trajectory spanning versions is recomputed segment by segment.

    Holds at most ``eta + 1`` copies: versions ``v - eta .. v``. Tokens whose version has no
    snapshot (e.g. right after a resume: snapshots are not checkpointed) fall back to the
    current parameters and are counted (``proximal/snapshot_missing_frac``).
    """

    name = "snapshot"
    exact = True

    def __init__(self, model: torch.nn.Module, eta: int, version: int):
        if eta is None:
            raise ValueError("proximal.method=snapshot needs a finite async.eta (the window to keep)")
        self.eta = eta
        self.snapshots: dict[int, WeightUpdate] = {}
        self._scratch = copy.deepcopy(model).eval()
        for p in self._scratch.parameters():
            p.requires_grad_(False)
        self._copy_bytes = param_bytes(model)
        self.store(model, version)
        self._missing = 0
        self._tokens = 0

    def store(self, model: torch.nn.Module, version: int) -> None:
        """Keep a copy of ``model``'s parameters as ``version``; evict those older than
        ``version - eta``."""
        self.snapshots[version] = WeightUpdate.from_model(model, version)  # tied tensors stored once
        for old in [u for u in self.snapshots if u < version - self.eta]:
            del self.snapshots[old]

    def old_logprobs(self, trainer, mb):
        out = None
        vers = mb.versions
        present = sorted(int(u) for u in torch.unique(vers[mb.mask > 0]).tolist())
        cur = trainer.version
        for u in present:
            sel = (vers == u) & (mb.mask > 0)
            state = self.snapshots.get(u)
            if u == cur or state is None:
                if state is None and u != cur:
                    self._missing += int(sel.sum())
                model = trainer.model
            else:
                self._scratch.load_state_dict(state.state_dict(), strict=True)
                model = self._scratch
            with torch.no_grad():
                lp, _ = trainer._logprobs(model, mb)
            out = lp if out is None else torch.where(sel, lp, out)
            self._tokens += int(sel.sum())
        return out if out is not None else torch.zeros_like(mb.behaviour_logprobs)

    def on_load(self, model, version):
        self.snapshots = {}
        self.store(model, version)

    def after_update(self, model, new_version, metrics):
        self.store(model, new_version)
        st = ProximalStats({"proximal/snapshots": float(len(self.snapshots)),
                            "proximal/snapshot_missing_frac": self._missing / max(1, self._tokens)})
        self._missing = self._tokens = 0
        return st

    def extra_bytes(self) -> int:
        return self._copy_bytes * (len(self.snapshots) + 1)  # snapshots + the scratch model


class EWMA(ProximalStrategy):
    """PPO-EWMA (revised, MISSION.md section 2; PPO-EWMA: Hilton, Cobbe & Schulman 2021, "Batch
    size-invariance for policy optimization", arXiv 2110.00641): the proximal policy is a
    bias-corrected exponentially weighted moving average of the parameters, updated after every
    optimiser step (:meth:`on_optimizer_step`)::

        W_t = beta * W_{t-1} + 1                  (the bias-correction normaliser, W_0 = 1)
        theta_ewma <- (beta * W_{t-1} / W_t) * theta_ewma + theta / W_t

    ``beta`` is fixed (``proximal.ewma_beta``, per optimiser step) or adaptive:
    ``beta = w / (w + 2)`` with ``w`` the width of the current version window in optimiser
    steps: the batch's largest staleness (versions between its oldest token and the trainer's
    version, the async degree) times the optimiser steps per update (``trainer.minibatches``; 1
    by default, so ``w`` is the async degree itself). The average's centre of mass,
    ``beta / (1 - beta) = w / 2`` steps back, is then the middle of the window; a synchronous
    batch (``w = 0``) gives ``beta = 0``: the EWMA is exactly the current parameters and the
    proximal policy equals ``recompute``'s (nothing is averaged).

    Auto-reset: when the discrepancy keep-rate of an update's batch (share of response tokens
    whose ``pi_ewma / pi_behav`` lies in the loss's discrepancy band) falls below
    ``reset_keep_rate`` (default 0.90), the EWMA is set to the current parameters after that
    update and averaging restarts (``W_t = 1``); the reset is reported as an ``ewma_reset``
    event. docs/results/proximal.md ("EWMA: as specified, and why the auto-reset fires")
    measures when it fires and why: with a policy that moves fast per update it fires every time.

    Checkpoint state (format 2): ``W``, ``resets``, ``updates``, ``params``; format-1 states
    (before issue 10: no ``format`` key) load unchanged, as ``W`` and the parameters mean the same.

    Args:
        model: The policy; its parameters seed the average.
        beta: Fixed decay per optimiser step in ``[0, 1)``, or None (adaptive).
        reset_keep_rate: Keep-rate below which the EWMA resets, in ``[0, 1]``.
        discrepancy_low / discrepancy_high: The discrepancy band of ``pi_ewma / pi_behav``.

    Raises:
        ValueError: ``beta`` out of range.
    """

    name = "ewma"
    STATE_FORMAT = 2

    def __init__(self, model: torch.nn.Module, *, beta: float | None = None, reset_keep_rate: float = 0.90,
                 discrepancy_low: float = 0.8, discrepancy_high: float = 1.25):
        if beta is not None and not 0.0 <= beta < 1.0:
            raise ValueError(f"proximal.ewma_beta must be in [0, 1) or null (adaptive), got {beta}")
        self.beta = beta
        self.reset_keep_rate = reset_keep_rate
        self.lo, self.hi = discrepancy_low, discrepancy_high
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.W = 1.0  # the initial parameters count as one observation
        self._copy_bytes = param_bytes(model)
        self._kept = 0
        self._counted = 0
        self.resets = 0
        self.updates = 0  # EWMA steps (= optimiser steps) since the start of the run
        self._step_updates = 0  # ... in the current policy update
        self._window: int | None = None  # the window of the last EWMA step

    def old_logprobs(self, trainer, mb):
        with torch.no_grad():
            lp, _ = trainer._logprobs(self.model, mb)
        m = mb.mask > 0
        rho = torch.exp((lp - mb.behaviour_logprobs).clamp(-20, 20))
        self._kept += int(((rho >= self.lo) & (rho <= self.hi) & m).sum())
        self._counted += int(m.sum())
        return lp

    def current_beta(self, window: int) -> float:
        """The decay: fixed, or ``w / (w + 2)`` for a version window ``w`` optimiser steps wide.

        Raises:
            ValueError: ``window < 0``.
        """
        if window < 0:
            raise ValueError(f"the version window must be >= 0 optimiser steps, got {window}")
        return self.beta if self.beta is not None else window / (window + 2.0)

    @torch.no_grad()
    def update(self, model: torch.nn.Module, window: int) -> None:
        """One bias-corrected EWMA step towards ``model``'s parameters (``window``: see
        :meth:`current_beta`). With ``beta = 0`` the EWMA becomes an exact copy."""
        beta = self.current_beta(window)
        w_prev = self.W
        self.W = beta * w_prev + 1.0
        a = beta * w_prev / self.W
        src = dict(model.state_dict())
        done: set[int] = set()
        for k, t in self.model.state_dict().items():
            if t.data_ptr() in done:  # a tied weight (embedding = output projection): once
                continue
            done.add(t.data_ptr())
            if t.is_floating_point() and a > 0.0:
                t.mul_(a).add_(src[k].to(t.dtype), alpha=1.0 / self.W)
            else:
                t.copy_(src[k])

    def on_optimizer_step(self, model, window):
        self.update(model, window)
        self.updates += 1
        self._step_updates += 1
        self._window = window

    @torch.no_grad()
    def reset(self, model: torch.nn.Module) -> None:
        """Set the EWMA to ``model``'s parameters and restart averaging."""
        self.model.load_state_dict(model.state_dict())
        self.W = 1.0
        self.resets += 1

    def after_update(self, model, new_version, metrics):
        keep = self._kept / self._counted if self._counted else 1.0
        window = self._window if self._window is not None else 0
        st = ProximalStats({
            "proximal/ewma_keep_rate": keep, "proximal/ewma_beta": self.current_beta(window),
            "proximal/ewma_window": float(window), "proximal/ewma_W": self.W,
            "proximal/ewma_updates": float(self._step_updates),
        })
        if self._counted and keep < self.reset_keep_rate:
            self.reset(model)
            st.events.append({"event": "ewma_reset", "version": new_version, "keep_rate": keep,
                              "threshold": self.reset_keep_rate})
            log.info("EWMA proximal policy reset at version %d (keep-rate %.3f < %.2f)", new_version, keep, self.reset_keep_rate)
        st.values["proximal/ewma_resets"] = float(self.resets)
        self._kept = self._counted = self._step_updates = 0
        return st

    def extra_bytes(self) -> int:
        return self._copy_bytes

    def state_dict(self) -> dict:
        params = {k: v.clone() for k, v in self.model.state_dict().items()}
        return {"format": self.STATE_FORMAT, "W": self.W, "resets": self.resets,
                "updates": self.updates, "params": params}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (format 2, or format 1 from before issue 10).

        Raises:
            ValueError: a state of an unknown (newer) format, or one without ``W`` / ``params``.
        """
        if not state:
            return
        fmt = int(state.get("format", 1))
        if fmt > self.STATE_FORMAT or "W" not in state or "params" not in state:
            raise ValueError(
                f"EWMA proximal state: format {fmt} with keys {sorted(state)} cannot be loaded by "
                f"this version of conveyor (reads formats 1-{self.STATE_FORMAT} with W and params)")
        self.W = float(state["W"])
        self.resets = int(state.get("resets", 0))
        self.updates = int(state.get("updates", 0))
        self.model.load_state_dict(state["params"])


def choose_auto(model: torch.nn.Module, eta: int | None, budget_bytes: int) -> tuple[str, str]:
    """``auto``: the cheapest exact method that fits ``budget_bytes`` of host memory, else ewma.

    Returns:
        ``(method, reason)``.
    """
    one = param_bytes(model)
    if eta == 0:
        return "recompute", "eta = 0: every token comes from the current parameters, recompute is exact and free"
    if eta is not None and (eta + 2) * one <= budget_bytes:
        return "snapshot", f"snapshots need (eta + 2) x {one / 2**20:.0f} MiB = {(eta + 2) * one / 2**20:.0f} MiB <= budget {budget_bytes / 2**20:.0f} MiB"
    need = "unbounded eta" if eta is None else f"{(eta + 2) * one / 2**20:.0f} MiB"
    return "ewma", f"snapshots need {need} > budget {budget_bytes / 2**20:.0f} MiB; ewma needs one copy ({one / 2**20:.0f} MiB)"


def build_strategy(method: str, model: torch.nn.Module, *, eta: int | None, version: int = 0,
                   interpolation: str = "loglinear", ewma_beta: float | None = None, ewma_reset_keep_rate: float = 0.90,
                   discrepancy_low: float = 0.8, discrepancy_high: float = 1.25,
                   memory_budget_bytes: int = 4 * 2**30, dedicated_threads: int = 1,
                   lora_base: dict[str, torch.Tensor] | None = None) -> tuple[ProximalStrategy, str]:
    """Build the strategy named ``method`` (one of ``METHODS``).

    ``lora_base``: the dedicated worker's base weights for LoRA adapter updates
    (``lora.sync=adapter``; :class:`Dedicated`).

    Returns:
        ``(strategy, note)``: ``note`` explains an ``auto`` choice (empty otherwise).

    Raises:
        ValueError: unknown method or bad options.
    """
    note = ""
    if method == "auto":
        method, note = choose_auto(model, eta, memory_budget_bytes)
    if method == "recompute":
        return Recompute(), note
    if method == "behavior":
        return Behavior(), note
    if method == "interpolate":
        return Interpolate(interpolation), note
    if method == "snapshot":
        return Snapshot(model, eta, version), note
    if method == "partial_sync":
        return PartialSync(), note
    if method == "dedicated":
        return Dedicated(model, version, threads=dedicated_threads, lora_base=lora_base), note
    if method == "ewma":
        return EWMA(model, beta=ewma_beta, reset_keep_rate=ewma_reset_keep_rate,
                    discrepancy_low=discrepancy_low, discrepancy_high=discrepancy_high), note
    raise ValueError(f"unknown proximal.method {method!r}; choose one of {METHODS}")
