"""Old log-probs as messages (issue 12 section 1): patches addressed by request key, the rollout
side's book, trajectories spanning several requests (tool episodes), checkpoints, and the one
output type (GenerationOutput.extend / observe)."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.rollout.engine import GenerationOutput
from conveyor.rollout.old_logprobs import OldLogprobBook, OldLogprobPatch, items_of_trajectory
from conveyor.runtime.publish import scoring_items
from conveyor.types import Sample, SamplingMask, Trajectory

NAN = float("nan")


def traj(n, spans, versions=None, old=None):
    meta = {"request_spans": [list(s) for s in spans]}
    if old is not None:
        meta["old_logprobs"] = old
    return Trajectory(sample=Sample("s", "q", "1", "t"), group_id="g", prompt_ids=[1, 2], response_ids=list(range(n)),
                      behaviour_logprobs=[0.0] * n, versions=versions or [0] * n, metadata=meta)


def same(a, b):
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=True))


def test_book_attaches_patches_across_request_spans_of_a_tool_episode():
    # response: action segment A (tokens 0-2), observation (3-4), action segment B (5-6)
    t = traj(7, [("A", 0, 3), ("B", 5, 2)], versions=[0, 0, 1, 1, 1, 1, 2])
    book = OldLogprobBook()
    # version 0's publish scored A's tokens 0, 1; version 1's scored A's token 2 and B's token 0
    assert book.apply([OldLogprobPatch("A", 0, (-0.1, -0.2), 0)]) == 2
    assert book.apply([OldLogprobPatch("A", 2, (-0.3,), 1), OldLogprobPatch("B", 0, (-0.6, NAN), 1)]) == 2
    assert book.attach([t]) == 4
    # observations (3, 4) and B's token of version 2 (current: the trainer's forward) stay NaN
    assert same(t.metadata["old_logprobs"], [-0.1, -0.2, -0.3, NAN, NAN, -0.6, NAN])
    assert len(book) == 0


def test_book_keeps_restored_values_and_keep_true_copies_for_checkpoints():
    t = traj(3, [("A", 0, 3)], old=[-1.0, -2.0])  # restored from a checkpoint: two tokens known
    book = OldLogprobBook()
    book.apply([OldLogprobPatch("A", 2, (-3.0,), 4)])
    assert book.attach([t], keep=True) == 1 and len(book) == 1  # a checkpoint copy
    assert t.metadata["old_logprobs"] == [-1.0, -2.0, -3.0]
    book.attach([t])
    assert len(book) == 0


def test_book_prunes_entries_beyond_the_staleness_bound():
    book = OldLogprobBook()
    book.apply([OldLogprobPatch("old", 0, (-1.0,), 3), OldLogprobPatch("new", 0, (-1.0,), 5)])
    assert book.prune(7, eta=None) == 0  # unbounded staleness keeps everything
    assert book.prune(5, eta=2) == 0  # version 3 is still admissible at 5 with eta 2
    assert book.prune(6, eta=2) == 1 and len(book) == 1  # 3 < 6 - 2: its trajectory is dropped


def test_scoring_items_dedupe_requests_and_buffered_trajectories():
    class Part:
        def __init__(self, key, n):
            self.key, self.prompt_ids, self.token_ids, self.versions = key, [1], list(range(n)), [0] * n
            self.sampling_mask = None

    a = traj(3, [("A", 0, 3)])
    b = traj(4, [("B", 0, 2), ("C", 3, 1)])
    none = traj(2, [])  # built before request keys: nothing to address
    none.metadata.pop("request_spans")
    items = scoring_items([Part("A", 3)], [a, b, none])
    assert [sorted(it.keys) for it in items] == [["A"], ["B", "C"]]
    assert items_of_trajectory(none) is None
    assert items[1].prompt_ids == [1, 2] and items[1].token_ids == [0, 1, 2, 3]


def test_score_old_logprobs_patches_only_the_outgoing_versions_tokens(tiny):
    from conveyor.config import LossConfig, TrainerConfig
    from conveyor.trainer.proximal import score_old_logprobs
    from conveyor.trainer.trainer import Trainer

    tr = Trainer(tiny.model, TrainerConfig(bf16=False), LossConfig())
    t = traj(6, [("A", 0, 3), ("B", 4, 2)], versions=[0, 1, 1, 1, 1, 2])
    t.prompt_ids = [5, 6, 7]
    t.response_ids = [11, 12, 13, 14, 15, 16]
    patches, n = score_old_logprobs(tr.scoring_spec(), tr.model, [items_of_trajectory(t)], 1)
    assert n == 3  # A's tokens 1, 2 and B's token 0 (token 3 is an observation in no span)
    by = {p.key: p for p in patches}
    assert by["A"].start == 1 and len(by["A"].values) == 2 and by["B"].start == 0 and len(by["B"].values) == 1
    # the values are the trainer's own log-probs of those tokens
    from conveyor.trainer.batch import pack

    mb = pack([t], torch.zeros(1), [[0]])
    with torch.no_grad():
        lp, _ = tr._logprobs(tr.model, mb)
    ref = lp[mb.mask > 0].tolist()
    assert by["A"].values == pytest.approx(ref[1:3], abs=1e-6) and by["B"].values[0] == pytest.approx(ref[4], abs=1e-6)
    assert score_old_logprobs(tr.scoring_spec(), tr.model, [items_of_trajectory(t)], 7) == ([], 0)


def test_generation_output_extend_and_observe_build_one_tool_episode():
    m = SamplingMask(torch.tensor([3, 4, 5]), torch.tensor([0, 2, 3]))  # two tokens with kept sets
    seg1 = GenerationOutput(prompt_ids=[1, 2], token_ids=[7, 8], logprobs=[-0.5, -0.25], versions=[3, 3],
                            finish_reason="stop", num_interruptions=1, sampling_mask=m, key="e:0")
    out = GenerationOutput(prompt_ids=[1, 2], action_mask=[]).extend(seg1).observe([40, 41], 3)
    seg2 = GenerationOutput(prompt_ids=[1, 2, 7, 8, 40, 41], token_ids=[9], logprobs=[-1.0], versions=[4],
                            finish_reason="length", key="e:5")
    out = out.extend(seg2)
    assert out.token_ids == [7, 8, 40, 41, 9] and out.logprobs == [-0.5, -0.25, 0.0, 0.0, -1.0]
    assert out.versions == [3, 3, 3, 3, 4] and out.action_mask == [1, 1, 0, 0, 1]
    assert out.tool_calls == 1 and out.num_interruptions == 1 and out.finish_reason == "length"
    assert out.spans() == [("e:0", 0, 2), ("e:5", 4, 1)] and out.key == ""
    assert out.sampling_mask.sizes().tolist() == [2, 1, 0, 0, 0]
    assert seg1.spans() == [("e:0", 0, 2)]
    with pytest.raises(ValueError, match="re-tokenised"):
        out.extend(GenerationOutput(prompt_ids=[1, 2, 7], token_ids=[1], logprobs=[0.0], versions=[4]))
