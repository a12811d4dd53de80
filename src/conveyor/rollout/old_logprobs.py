"""Old log-probs as messages (issue 12, section 1; MISSION.md section 2, recoveries 2 and 3).

``partial_sync`` and ``dedicated`` record, at each weight update, the training-side log-probs of
every token the outgoing version sampled (``log pi_old``). They used to extend a list shared by
the engine's request, the trajectory and the runtime; that cannot cross a process boundary.
Now the scorer (the paused engine, or the dedicated worker) returns :class:`OldLogprobPatch`
messages addressed by the **request key** of the engine request that generated the tokens
(``GenerationOutput.key``: ``"<engine id>:<request id>"``, unique across engines, processes and
resumes), and the rollout side keeps them in an :class:`OldLogprobBook` until the trajectory is
handed to the trainer, where :meth:`OldLogprobBook.attach` writes ``metadata["old_logprobs"]``.

A trajectory knows which request produced which of its tokens: ``metadata["request_spans"]``,
a list of ``[key, offset, n]`` (the request's ``n`` generated tokens are the response's tokens
``offset .. offset + n - 1``). A single-turn response is one span; a tool episode has one span
per action segment, and its observation tokens belong to none (they carry no loss). That is what
makes the two strategies work for tool episodes: the bookkeeping follows trajectory token spans,
not engine requests.

Each publish scores exactly the tokens stamped with the outgoing version (older ones were scored
at their own publish), so a patch holds NaN for tokens of any other version and nothing is
scored twice across messages.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from conveyor.types import SamplingMask, Trajectory

__all__ = ["OldLogprobBook", "OldLogprobPatch", "ScoringItem", "items_of_trajectory", "request_spans"]


@dataclass(frozen=True)
class OldLogprobPatch:
    """Training-side ``log pi_old`` of a range of one request's generated tokens.

    Attributes:
        key: The engine request's key (``GenerationOutput.key`` / ``PartialRequest.key``).
        start: Index, in the request's generated tokens, of ``values[0]``.
        values: Natural-log probabilities; NaN for tokens of another version than ``version``.
        version: The policy version whose tokens were scored (the outgoing one).
    """

    key: str
    start: int
    values: tuple[float, ...]
    version: int


@dataclass(frozen=True)
class ScoringItem:
    """Tokens to score: a prompt and the generated tokens after it, and where each generated
    token's old log-prob goes.

    Attributes:
        prompt_ids: The context before ``token_ids`` (length ``P``).
        token_ids: The tokens to score (length ``R``).
        versions: Policy version of each token (length ``R``).
        spans: ``(key, offset, n)``: ``token_ids[offset : offset + n]`` are the generated tokens
            ``0 .. n - 1`` of request ``key`` (tokens in no span, e.g. tool observations, are
            scored but not reported).
        sampling_mask: Kept sets of ``token_ids`` under truncated sampling (replayed so the old
            log-probs are renormalised like the trainer's), or None.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    versions: list[int]
    spans: tuple[tuple[str, int, int], ...]
    sampling_mask: SamplingMask | None = None

    @property
    def keys(self) -> set[str]:
        """The request keys this item reports on."""
        return {k for k, _, _ in self.spans}


def request_spans(t: Trajectory) -> list[tuple[str, int, int]]:
    """``metadata["request_spans"]`` of a trajectory as ``(key, offset, n)`` tuples (empty for
    trajectories built before request keys existed)."""
    return [(str(k), int(o), int(n)) for k, o, n in t.metadata.get("request_spans", ())]


def items_of_trajectory(t: Trajectory) -> ScoringItem | None:
    """A buffered trajectory as one :class:`ScoringItem` (None when it has no request spans)."""
    spans = request_spans(t)
    if not spans:
        return None
    return ScoringItem(list(t.prompt_ids), list(t.response_ids), list(t.versions), tuple(spans), t.sampling_mask)


@dataclass
class _Entry:
    values: dict[int, float] = field(default_factory=dict)  # request token index -> log-prob
    oldest: int = 1 << 62  # the oldest version patched


class OldLogprobBook:
    """The rollout side's store of old-log-prob patches, until their trajectory is trained.

    Thread-safe: patches arrive from the trainer's thread (partial_sync) or the dedicated worker,
    trajectories are attached in the trainer's thread and copied for checkpoints.
    """

    def __init__(self):
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def apply(self, patches: Iterable[OldLogprobPatch]) -> int:
        """Store ``patches`` (NaN values are skipped; a later value for the same token wins).

        Returns:
            The number of token values stored.
        """
        n = 0
        with self._lock:
            for p in patches:
                e = self._entries.setdefault(p.key, _Entry())
                for i, v in enumerate(p.values, p.start):
                    if not math.isnan(v):
                        e.values[i] = float(v)
                        n += 1
                e.oldest = min(e.oldest, p.version)
        return n

    def attach(self, trajectories: Sequence[Trajectory], *, keep: bool = False) -> int:
        """Write each trajectory's ``metadata["old_logprobs"]`` (a list of length ``R``: the
        stored value of every token, NaN where none; values already there, e.g. restored from a
        checkpoint, are kept where no patch exists).

        Args:
            keep: Keep the entries (a copy for a checkpoint); otherwise they are removed, the
                trajectory being handed to the trainer.

        Returns:
            The number of token values written from patches.
        """
        n = 0
        with self._lock:
            for t in trajectories:
                spans = request_spans(t)
                if not spans:
                    continue
                r = len(t.response_ids)
                old = [float(x) for x in (t.metadata.get("old_logprobs") or ())][:r]
                old += [math.nan] * (r - len(old))
                for key, offset, length in spans:
                    e = self._entries.get(key) if keep else self._entries.pop(key, None)
                    if e is None:
                        continue
                    for i, v in e.values.items():
                        if 0 <= i < length and offset + i < r:
                            old[offset + i] = v
                            n += 1
                t.metadata["old_logprobs"] = old
        return n

    def prune(self, version: int, eta: int | None) -> int:
        """Forget the entries holding a token older than ``version - eta``: their trajectories
        are beyond the staleness bound at trainer ``version`` and will be dropped, never
        trained (MISSION.md section 1). ``eta`` None (unbounded staleness) keeps everything.

        Returns:
            How many entries were forgotten.
        """
        if eta is None:
            return 0
        with self._lock:
            stale = [k for k, e in self._entries.items() if e.oldest < version - eta]
            for k in stale:
                del self._entries[k]
        return len(stale)
