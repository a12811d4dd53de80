"""Sampling-mask replay (issue 10, section 1): under truncated sampling (min-p / top-k / top-p)
the engine records the kept set of every sampled token and the trainer renormalises every
log-prob (current, proximal, partial-sync, reference) over the same set, so engine and trainer
agree for every sampling setting (docs/design.md, "Truncated sampling: which log-probs")."""

from __future__ import annotations

import asyncio
import copy
import io
import json
import math
import pickle

import pytest
import torch

from conveyor.config import LossConfig, ProximalConfig, TrainerConfig
from conveyor.rollout.engine import (
    GenerationOutput,
    InferenceEngine,
    SamplingParams,
    sample_from_logits,
)
from conveyor.trainer import logprobs as lp_lib
from conveyor.trainer.batch import group_shared_prompts, pack
from conveyor.trainer.trainer import Trainer
from conveyor.types import Sample, SamplingMask, Trajectory

T = 0.7
SETTINGS = [  # (top_p, top_k, min_p)
    (1.0, 0, 0.0),
    (0.9, 0, 0.0),
    (0.5, 0, 0.0),
    (1.0, 20, 0.0),
    (0.9, 20, 0.0),
    (0.5, 20, 0.0),
    (1.0, 0, 0.1),
    (0.9, 20, 0.05),
]
GROUP = 2  # responses per prompt (shared-prompt packing is exercised)


def _sharp(tiny):
    """The tiny model with larger random weights: less uniform next-token distributions."""
    m = copy.deepcopy(tiny.model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in sorted(m.named_parameters()):
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return m


def _traj(i, o, group, mask=True):
    return Trajectory(
        Sample(f"s{i}", "q", "1", "d"),
        f"g{group}",
        list(o.prompt_ids),
        list(o.token_ids),
        list(o.logprobs),
        list(o.versions),
        reward=float(i % 2),
        sampling_mask=o.sampling_mask if mask else None,
    )


@pytest.fixture(scope="module")
def rollouts(tiny):
    """``GROUP`` engine responses per setting (T = 0.7), one prompt per setting."""
    model = _sharp(tiny)
    eng = InferenceEngine(copy.deepcopy(model), tiny.tokenizer, seed=0, num_threads=1)
    prompts, params = [], []
    for j, (top_p, top_k, min_p) in enumerate(SETTINGS):
        for _ in range(GROUP):
            prompts.append([1, 500 + j, 600 + j, 700 + j])
            params.append(
                SamplingParams(
                    max_new_tokens=20,
                    temperature=T,
                    top_p=top_p,
                    top_k=top_k,
                    min_p=min_p,
                    ignore_eos=True,
                )
            )
    with eng:
        outs = eng.generate_batch(prompts, params)
    return model, outs


def _trainer(model, **kw):
    cfg = dict(lr=1e-7, warmup_steps=0, bf16=False, logprob_chunk_tokens=16)
    cfg.update(kw.pop("trainer", {}))
    return Trainer(
        copy.deepcopy(model),
        TrainerConfig(**cfg),
        LossConfig(**kw.pop("loss", {"kl_coef": 0.0})),
        temperature=T,
        eta=0,
        proximal_cfg=ProximalConfig(**kw),
    )


# ------------------------------------------------------------------ engine == trainer


@pytest.fixture(scope="module", params=[True, False], ids=["shared_prompts", "separate"])
def replayed(request, rollouts):
    """Every setting's trajectories packed into one batch (chunks of 16 positions mix positions
    with and without a set), shared-prompt packing on / off; the trainer's log-probs with the
    sets replayed and the full-vocabulary ones."""
    model, outs = rollouts
    share = request.param
    tr = _trainer(model, trainer={"share_prompts": share})
    trajs = [_traj(i, o, i // GROUP) for i, o in enumerate(outs)]
    units = group_shared_prompts(trajs, 4096) if share else list(range(len(trajs)))
    mb = pack(trajs, torch.zeros(len(trajs)), [units])
    assert (mb.attention_mask is not None) == share
    with torch.no_grad():
        lp, _ = tr._logprobs(tr.model, mb)
        lp_full, _ = lp_lib.token_logprobs(
            tr.model,
            mb.input_ids,
            mb.position_ids,
            mb.targets,
            temperature=T,
            mask=mb.mask,
            attention_mask=mb.attention_mask,
        )
    return outs, mb, lp, lp_full


@pytest.mark.parametrize(
    "setting", SETTINGS, ids=[f"top_p{p}-top_k{k}-min_p{m}" for p, k, m in SETTINGS]
)
def test_engine_logprobs_equal_trainer_replay(replayed, setting):
    """The trainer's recomputed log-probs (Trainer._logprobs, fp32, chunked) equal the engine's
    behaviour log-probs to 1e-4 for every setting (T = 0.7). Without the replayed sets they are
    lower by the log of the kept mass for every truncated setting."""
    outs, mb, lp, lp_full = replayed
    j = SETTINGS.index(setting)
    sel = (mb.mask > 0) & (mb.seq_index // GROUP == j)
    assert int(sel.sum()) == GROUP * 20
    assert (lp[sel] - mb.behaviour_logprobs[sel]).abs().max() < 1e-4
    truncated = setting != (1.0, 0, 0.0)
    assert (outs[j * GROUP].sampling_mask is not None) == truncated
    if (
        truncated
    ):  # the defect this replaces: the full-vocabulary log-prob is lower by log(kept mass)
        assert (lp_full[sel] - mb.behaviour_logprobs[sel]).mean() < -0.02
    else:
        assert torch.equal(lp_full[sel], lp[sel])


def test_train_step_behaviour_weight_is_one_at_staleness_zero(rollouts, monkeypatch):
    """At staleness 0 every consumer of log-probs (current, proximal recompute / snapshot / EWMA
    with a separate proximal pass, and the KL reference) gets the sets: the two-ratio loss's
    discrepancy ratio pi_prox / pi_behav is 1 for every token (fp32); without the sets it is not."""
    model, outs = rollouts
    seen = []
    real = lp_lib.token_logprobs

    def spy(*args, **kwargs):
        seen.append(kwargs.get("support") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr("conveyor.trainer.trainer.token_logprobs", spy)
    # one response of the untruncated, top-p 0.5, top-k 20 and min-p + top-k + top-p settings
    picks = [
        GROUP * SETTINGS.index(s)
        for s in ((1.0, 0, 0.0), (0.5, 0, 0.0), (1.0, 20, 0.0), (0.9, 20, 0.05))
    ]
    trajs = [_traj(i, outs[i], i) for i in picks]
    for method in (
        "recompute",
        "ewma",
    ):  # snapshot / partial_sync score through the same Trainer._logprobs
        seen.clear()
        tr = _trainer(
            model,
            method=method,
            loss={"name": "two_ratio", "kl_coef": 0.05},
            trainer={"separate_proximal_pass": True},
        )
        m = tr.train_step(trajs)
        assert m["loss/discrepancy_mean"] == pytest.approx(1.0, abs=1e-4), method
        assert m["loss/discrepancy_keep_frac"] == 1.0 and m["train/kl_ref"] == pytest.approx(
            0.0, abs=1e-6
        )
        assert len(seen) >= 3 and all(seen), (
            method,
            seen,
        )  # proximal, reference and gradient passes
    stripped = [_traj(i, outs[i], i, mask=False) for i in picks]
    m = _trainer(model, loss={"name": "two_ratio", "kl_coef": 0.0}).train_step(stripped)
    assert (
        m["loss/discrepancy_mean"] < 0.9 and m["loss/discrepancy_keep_frac"] < 0.9
    )  # the old defect


def test_partial_sync_scoring_replays_the_sets(rollouts):
    """score_old_logprobs (partial_sync / dedicated) renormalises the old log-probs over the sets."""
    from conveyor.rollout.engine import PartialRequest
    from conveyor.rollout.old_logprobs import OldLogprobBook
    from conveyor.runtime.publish import scoring_items
    from conveyor.trainer.proximal import score_old_logprobs

    model, outs = rollouts
    tr = _trainer(model, method="partial_sync")
    parts = [
        PartialRequest(i, o.prompt_ids, o.token_ids, o.versions, f"e:{i}", True, o.sampling_mask)
        for i, o in enumerate(outs)
    ]
    patches, n = score_old_logprobs(tr.scoring_spec(), tr.model, scoring_items(parts, []), 0)
    assert n == sum(len(o.token_ids) for o in outs)
    by_key = {p.key: p for p in patches}
    for i, o in enumerate(outs):
        p = by_key[f"e:{i}"]
        assert p.start == 0 and p.version == 0
        assert torch.allclose(torch.tensor(p.values), torch.tensor(o.logprobs), atol=1e-4)
    # buffered trajectories (e.g. restored from a checkpoint) are scored through their request spans
    trajs = [_traj(i, o, i) for i, o in enumerate(outs)]
    for i, t in enumerate(trajs):
        t.metadata["request_spans"] = [[f"b:{i}", 0, len(t.response_ids)]]
    items = scoring_items([], trajs)
    patches, n = score_old_logprobs(tr.scoring_spec(), tr.model, items, 0)
    assert n == len(parts) * 20
    book = OldLogprobBook()
    book.apply(patches)
    book.attach(trajs)
    for t, o in zip(trajs, outs, strict=True):
        old = torch.tensor(t.metadata["old_logprobs"])
        assert torch.allclose(old, torch.tensor(o.logprobs), atol=1e-4)
    # a trajectory whose request the engine still reports is scored once, as that request
    assert len(scoring_items(parts[:1], [_with_key(trajs[0], "e:0")])) == 1


def _with_key(t, key):
    t.metadata["request_spans"] = [[key, 0, len(t.response_ids)]]
    return t


def test_engine_partial_requests_carry_the_sets(tiny):
    """A paused engine's partial requests carry the kept sets of the tokens generated so far."""
    eng = InferenceEngine(
        copy.deepcopy(tiny.model), tiny.tokenizer, seed=0, num_threads=1, track_partials=True
    )
    with eng:
        out = eng.generate_batch(
            [[1, 2, 3]], SamplingParams(max_new_tokens=6, temperature=T, top_k=5, ignore_eos=True)
        )[0]
        eng.pause()
        (p,) = eng.partial_requests()
    assert p.finished and p.sampling_mask == out.sampling_mask and len(p.sampling_mask) == 6
    assert p.sampling_mask.sizes().tolist() == [5] * 6


# ------------------------------------------------------------------ sampler semantics


def test_min_p_then_top_k_then_top_p_like_vllm():
    """vLLM v1 order: temperature, min-p, top-k, top-p on the renormalised remainder. Hand-computed
    on z = [3, 2, 1, 0, -1]: min-p 0.1 keeps z >= 3 + ln 0.1 = 0.70, i.e. {0, 1, 2}; renormalised
    they hold 0.665, 0.245, 0.090, so top-p 0.9 stops after {0, 1} (mass before token 2: 0.910).
    Top-p on the full distribution first would keep {0, 1, 2} (mass before token 2: 0.870)."""
    row = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    cases = [
        (SamplingParams(temperature=1.0, min_p=0.1), [0, 1, 2]),
        (SamplingParams(temperature=1.0, min_p=0.1, top_p=0.9), [0, 1]),
        (SamplingParams(temperature=1.0, min_p=0.1, top_k=2), [0, 1]),  # min-p and top-k commute
        (SamplingParams(temperature=1.0, top_k=4, min_p=0.1), [0, 1, 2]),
        (
            SamplingParams(temperature=0.5, min_p=0.1),
            [0, 1],
        ),  # T = 0.5: z = [6, 4, 2, ...], cut at 3.70
        (SamplingParams(temperature=1.0, min_p=1.0), [0]),
    ]
    for params, kept in cases:
        for u in (1e-9, 0.5, 1.0):
            tok, lp, sup = sample_from_logits(
                row, [params], torch.tensor([u], dtype=torch.float64), with_support=True
            )
            assert sup[0].tolist() == kept, params
            z = row[0] / params.temperature
            assert tok.item() in kept
            assert lp.item() == pytest.approx(
                (z[tok] - torch.logsumexp(z[kept], 0)).item(), abs=1e-6
            )
    _, _, sup = sample_from_logits(
        row.expand(2, 5),
        [SamplingParams(temperature=1.0), SamplingParams(temperature=0)],
        torch.ones(2, dtype=torch.float64),
        with_support=True,
    )
    assert sup == [None, None]  # untruncated and greedy rows record no set
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


def test_min_p_on_a_large_vocabulary_matches_a_full_sort():
    """The candidate search for min-p (alone and with top-p / top-k) finds the exact kept set."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 5000, generator=gen) * torch.tensor(
        [[0.2], [1.0], [3.0], [0.05], [1.0]]
    )
    params = [
        SamplingParams(temperature=1.0, min_p=m, top_p=p, top_k=k)
        for m, p, k in (
            (0.05, 1.0, 0),
            (0.01, 0.9, 0),
            (0.2, 1.0, 0),
            (0.5, 0.95, 0),
            (0.02, 0.8, 300),
        )
    ]
    u = 1.0 - torch.rand(5, generator=gen, dtype=torch.float64)
    tok, lp, sup = sample_from_logits(logits, params, u, with_support=True)
    for i, p in enumerate(params):
        z, order = logits[i].sort(descending=True)
        keep = z >= z[0] + math.log(p.min_p)
        if p.top_k:
            keep[p.top_k :] = False
        probs = torch.softmax(z.double().masked_fill(~keep, -math.inf), -1)
        keep &= (probs.cumsum(-1) - probs) < p.top_p
        assert sup[i].tolist() == order[keep].tolist()
        assert lp[i].item() == pytest.approx(
            (logits[i, tok[i]] - torch.logsumexp(logits[i, order[keep]], 0)).item(), abs=1e-5
        )


# ------------------------------------------------------------------ gradient


def test_masked_logprob_gradient_by_hand():
    """z = [2, 1, 0, -1] (identity projection, T = 1), S = {0, 1}, a = 1: log pi^S(a) = 1 -
    log(e^2 + e) = -1.3133; d/dz = [-0.7311, 0.7311, 0, 0] (indicator minus softmax over S,
    zero outside S). A position without a set keeps the full gradient e_a - softmax(z)."""
    z = torch.tensor([[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0]], requires_grad=True)
    w = torch.eye(4)
    targets = torch.tensor([1, 1])
    ids, valid, full = lp_lib._chunk_support(
        torch.tensor([0, 1]), torch.tensor([0, 2]), torch.tensor([2, 0]), targets
    )
    lp = lp_lib._chunk_logprobs_masked(z, w, targets, 1.0, ids, valid, full)
    assert lp[0].item() == pytest.approx(-1.3133, abs=1e-4)
    assert lp[1].item() == pytest.approx(torch.log_softmax(z[1].detach(), -1)[1].item(), abs=1e-6)
    lp.sum().backward()
    assert torch.allclose(z.grad[0], torch.tensor([-0.7311, 0.7311, 0.0, 0.0]), atol=1e-4)
    p = torch.softmax(z[1].detach(), -1)
    assert torch.allclose(z.grad[1], torch.tensor([0.0, 1.0, 0.0, 0.0]) - p, atol=1e-6)


def test_masked_token_logprobs_gradient_equals_autograd_reference(tiny):
    """Through token_logprobs (body, chunked and checkpointed head), the gradient of the masked
    log-probs w.r.t. every parameter equals autograd on an explicit reference: full logits,
    -inf outside each kept set, log_softmax."""
    model = copy.deepcopy(tiny.model).float()
    gen = torch.Generator().manual_seed(0)
    prompt, resp = [1, 17, 33], [40, 41, 42, 43, 44]
    many = torch.randperm(2000, generator=gen)[:50]
    sets = [
        torch.tensor([40, 7, 9]),
        torch.tensor([], dtype=torch.long),
        torch.cat([torch.tensor([42]), many[many != 42]]),
        torch.tensor([43]),
        torch.tensor([44, 45, 46, 47]),
    ]
    sizes = torch.tensor([len(s) for s in sets])
    sm = SamplingMask(
        torch.cat(sets), torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    )
    t = Trajectory(
        Sample("x", "q", "1", "d"), "g", prompt, resp, [0.0] * 5, [0] * 5, sampling_mask=sm
    )
    mb = pack([t], torch.zeros(1), [[0]])
    model.zero_grad()
    lp, _ = lp_lib.token_logprobs(
        model,
        mb.input_ids,
        mb.position_ids,
        mb.targets,
        temperature=T,
        mask=mb.mask,
        support=mb.support,
        chunk_tokens=2,
    )
    lp[mb.mask > 0].sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(torch.tensor([prompt + resp])).logits[0].float() / T
    ref = []
    for k, a in enumerate(resp):
        row = logits[len(prompt) + k - 1]
        if len(sets[k]):
            row = row.masked_fill(~torch.isin(torch.arange(row.numel()), sets[k]), -math.inf)
        ref.append(torch.log_softmax(row, -1)[a])
    ref = torch.stack(ref)
    assert torch.allclose(lp[mb.mask > 0], ref.detach(), atol=1e-5)
    ref.sum().backward()
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, atol=1e-4, rtol=1e-4), (
            n,
            (got[n] - p.grad).abs().max(),
        )


# ------------------------------------------------------------------ storage and plumbing


def test_support_round_trips_through_tool_episodes_and_checkpoints(tiny, tmp_path):
    """Tool episodes concatenate the segments' sets with empty sets for observations; the mask
    survives pickling (controller snapshot) and torch.save; the JSONL logs never hold it."""
    from conveyor.rollout.tools import generate_with_calculator
    from conveyor.runlog import MetricsLogger

    tok = tiny.tokenizer

    class Segments:
        version = 0

        def __init__(self):
            self.texts = ["She has 12 * 15 =", " apples. Answer: 180"]

        async def generate(self, prompt_ids, params):
            ids = tok.encode(self.texts.pop(0), add_special_tokens=False)
            sets = [
                torch.tensor([t, t + 1, t + 2], dtype=torch.int32)[: 1 + k % 3]
                for k, t in enumerate(ids)
            ]
            sizes = torch.tensor([len(s) for s in sets])
            sm = SamplingMask(
                torch.cat(sets), torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
            )
            return GenerationOutput(
                list(prompt_ids),
                ids,
                [-0.5] * len(ids),
                [0] * len(ids),
                "stop",
                tok.decode(ids),
                0,
                sampling_mask=sm,
            )

    out = asyncio.run(
        generate_with_calculator(
            Segments(), tok, [1, 2, 3], SamplingParams(temperature=1.0, top_k=3)
        )
    )
    sm = out.sampling_mask
    assert out.tool_calls == 1 and len(sm) == len(out.token_ids)
    sizes = sm.sizes()
    act = torch.tensor(out.action_mask, dtype=torch.bool)
    assert (sizes[~act] == 0).all() and (sizes[act] > 0).all()  # observations: full vocabulary
    for k in torch.nonzero(act).flatten().tolist():
        assert out.token_ids[k] == int(sm.support(k)[0])
    traj = Trajectory(
        Sample("s", "q", "1", "d"),
        "g",
        out.prompt_ids,
        out.token_ids,
        out.logprobs,
        out.versions,
        action_mask=out.action_mask,
        sampling_mask=sm,
    )
    mb = pack([traj], torch.zeros(1), [[0]])  # every action token lies in its set
    assert int(mb.support[1][-1]) == sm.token_ids.numel()
    back = pickle.loads(pickle.dumps({"buffer": [[traj]]}))["buffer"][0][0]
    assert back == traj and back.sampling_mask.token_ids.dtype == torch.int32
    buf = io.BytesIO()
    torch.save({"controller": {"buffer": [[traj]]}}, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=False)["controller"]["buffer"][0][0].sampling_mask == sm
    log = MetricsLogger(tmp_path)
    log.trained(1, [traj])
    log.close()
    for name in ("trained.jsonl", "samples.jsonl"):
        text = (tmp_path / name).read_text()
        json.loads(text.splitlines()[0])
        assert "sampling_mask" not in text and "support" not in text
    assert SamplingMask.concat([3, 4]) is None  # nothing truncated: no mask
    with pytest.raises(ValueError, match="offsets"):
        SamplingMask(torch.tensor([1, 2]), torch.tensor([0, 3]))


def test_untruncated_runs_store_no_mask_and_compute_as_before(rollouts):
    """top_p = 1, top_k = 0, min_p = 0: no mask anywhere, the packed batch has no support and the
    log-probs are bit-identical to the no-support computation; positions without a set inside
    chunks that hold sets are bit-identical too."""
    model, outs = rollouts
    plain = [o for o in outs if o.sampling_mask is None]
    assert len(plain) == GROUP
    trajs = [_traj(i, o, 0) for i, o in enumerate(plain)]
    mb = pack(trajs, torch.zeros(len(trajs)), [list(range(len(trajs)))])
    assert mb.support is None
    mixed = [_traj(i, o, i) for i, o in enumerate(outs)]
    mmb = pack(mixed, torch.zeros(len(mixed)), [list(range(len(mixed)))])
    args = (model, mmb.input_ids, mmb.position_ids, mmb.targets)
    with torch.no_grad():
        a, ea = lp_lib.token_logprobs(
            *args,
            temperature=T,
            mask=mmb.mask,
            support=mmb.support,
            chunk_tokens=64,
            with_entropy=True,
        )
        b, eb = lp_lib.token_logprobs(
            *args, temperature=T, mask=mmb.mask, chunk_tokens=64, with_entropy=True
        )
    no_set = (mmb.mask > 0) & (mmb.support[1].diff().reshape(mmb.mask.shape) == 0)
    assert int(no_set.sum()) == GROUP * 20
    assert torch.equal(a[no_set], b[no_set])
    assert torch.equal(ea, eb)  # the entropy metric is of the full distribution


def _reference_truncated_logprob(logits: torch.Tensor, p: SamplingParams, tok: int) -> float:
    """log-prob of ``tok`` under the distribution the sampler draws from, in float64 from the
    definitions: softmax(logits / T) restricted to the top-k set, then to the smallest prefix of
    the descending order whose mass before a token is < top_p, renormalised (greedy: the
    untempered softmax)."""
    x = logits.double()
    if p.temperature == 0:
        return float(torch.log_softmax(x, -1)[tok])
    logp = torch.log_softmax(x / p.temperature, -1)
    vals, order = logp.sort(descending=True)
    keep = torch.ones_like(vals, dtype=torch.bool)
    if p.top_k:
        keep[p.top_k:] = False
    if p.top_p < 1.0:
        q = torch.where(keep, vals, torch.tensor(-math.inf, dtype=vals.dtype)).softmax(-1)
        keep &= (q.cumsum(-1) - q) < p.top_p
    kept = torch.where(keep, vals, torch.tensor(-math.inf, dtype=vals.dtype))
    renorm = torch.log_softmax(kept, -1)
    return float(renorm[(order == tok).nonzero()[0, 0]])


def test_sampler_matches_the_code_before_min_p_and_replay():
    """Tokens from the sampler before this change (commit ba0e833, no min-p, no kept sets) on
    fixed logits are unchanged for greedy, untruncated, top-p, top-k and top-k + top-p rows in
    one mixed batch, and every log-prob equals the float64 log-prob of the truncated,
    renormalised distribution to float32 precision. (The golden float32 bits of ba0e833 held on
    the AVX2 machine they were recorded on, not on an AVX512 one: reduction order differs.)"""
    gen = torch.Generator().manual_seed(123)
    settings = [
        dict(temperature=0), dict(temperature=0.7), dict(temperature=0.6, top_p=0.9),
        dict(temperature=0.6, top_p=0.5), dict(temperature=0.6, top_k=20),
        dict(temperature=1.3, top_k=300, top_p=0.95),
    ]  # fmt: skip
    logits = torch.randn(len(settings) * 2, 5000, generator=gen) * 3.0
    u = 1.0 - torch.rand(len(settings) * 2, generator=gen, dtype=torch.float64)
    params = [SamplingParams(**settings[i // 2]) for i in range(len(settings) * 2)]
    tok, lp, sup = sample_from_logits(logits, params, u, with_support=True)
    assert tok.tolist() == [1931, 4983, 3991, 2138, 2201, 3109, 3483, 410, 2661, 1363, 2376, 4143]
    ref = [_reference_truncated_logprob(logits[i], params[i], int(tok[i])) for i in range(len(params))]
    assert lp.double().tolist() == pytest.approx(ref, abs=2e-6)
    assert [s is None for s in sup] == [True] * 4 + [False] * 8


def test_token_outside_its_set_is_a_clear_error():
    sm = SamplingMask(torch.tensor([5, 6, 7, 8]), torch.tensor([0, 2, 4]))
    ok = Trajectory(
        Sample("ok", "q", "1", "d"), "g", [1, 2], [5, 8], [0.0, 0.0], [0, 0], sampling_mask=sm
    )
    pack([ok], torch.zeros(1), [[0]])
    bad = Trajectory(
        Sample("mawps/7", "q", "1", "d"), "g", [1, 2], [5, 9], [0.0, 0.0], [0, 0], sampling_mask=sm
    )
    with pytest.raises(
        ValueError, match=r"trajectory mawps/7: response token 1 \(id 9\) is not in its recorded"
    ):
        pack([bad], torch.zeros(1), [[0]])
    short = Trajectory(
        Sample("mawps/8", "q", "1", "d"), "g", [1, 2], [5], [0.0], [0], sampling_mask=sm
    )
    with pytest.raises(ValueError, match="mawps/8: sampling_mask"):
        pack([short], torch.zeros(1), [[0]])


def test_truncated_run_end_to_end_with_partial_sync_and_resume(tmp_path):
    """A real run (tiny, eta 1, top-k 20 + min-p, partial_sync, fp32 trainer, KL on): the sets
    reach the trainer through the workflow, the partial-sync scoring of in-flight requests and
    buffered trajectories, and a checkpoint (pickled buffer) + resume; the two-ratio discrepancy
    ratio pi_old / pi_behav is 1 at every step (checked to fail when partial-sync scoring drops
    the engine's sets: stale tokens then get full-vocabulary old log-probs)."""
    from conveyor.config import load_config
    from conveyor.train import load_run_config, run_training

    run = tmp_path / "r"
    base = [
        "model.name=tiny", "trainer.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=10",
        "run.eval_before=false", "run.eval_after=false", "run.progress=false", "run.export=false",
        "reward.workers=1", "rollout.tool=none", "rollout.top_k=20", "rollout.min_p=0.0001",
        "async.eta=1", "loss.name=two_ratio", "proximal.method=partial_sync", "trainer.bf16=false",
        "trainer.lr=1e-3", "run.checkpoint_every=1", "run.keep_checkpoints=2", f"run.dir={run}",
    ]  # fmt: skip
    run_training(load_config(None, base + ["trainer.total_steps=2"]))
    state = torch.load(run / "checkpoints" / "step_2" / "state.pt", weights_only=False)
    for group in state["controller"]["buffer"]:
        for t in group:
            assert len(t.sampling_mask) == len(t.response_ids)
            assert (t.sampling_mask.sizes() == 20).all()
    run_training(load_run_config(run, ["trainer.total_steps=4"]), resume_dir=run)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert max(r["staleness/max"] for r in rows) >= 1  # stale tokens used stored old log-probs
    for r in rows:
        assert r["loss/discrepancy_mean"] == pytest.approx(1.0, abs=1e-3), r["step"]
        assert r["loss/discrepancy_keep_frac"] == 1.0
