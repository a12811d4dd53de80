"""Trainer: packing, chunked log-probs, exact loss normalisation across micro-batches, steps."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from engine_helpers import until_decoding

from conveyor.config import LossConfig, TrainerConfig
from conveyor.trainer.batch import pack, plan_micro_batches
from conveyor.trainer.logprobs import token_logprobs
from conveyor.trainer.trainer import (
    NonFiniteLossError,
    Trainer,
    compute_advantages,
    staleness_metrics,
)
from conveyor.types import Sample, Trajectory


def make_trajs(n=8, group=4, seed=0, version=0, vocab=1000, shared_prompts=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(3, vocab, (4 + i % 3,), generator=g).tolist()
        if shared_prompts and i % group:
            p = list(out[i - i % group].prompt_ids)  # GRPO: a group's responses share its prompt
        r = torch.randint(3, vocab, (3 + (i * 5) % 7,), generator=g).tolist()
        out.append(Trajectory(
            sample=Sample(f"s{i // group}", "q", "1", "t"), group_id=f"g{i // group}", prompt_ids=p,
            response_ids=r, behaviour_logprobs=[-5.0] * len(r), versions=[version] * len(r),
            reward=float((i * 7) % 3 == 0),
        ))
    return out


def reference_logprobs(model, traj, temperature=1.0):
    ids = torch.tensor([traj.prompt_ids + traj.response_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
    P = len(traj.prompt_ids)
    return torch.tensor([lp[P + k - 1, t].item() for k, t in enumerate(traj.response_ids)])


def reference_entropy(model, traj, temperature=1.0):
    ids = torch.tensor([traj.prompt_ids + traj.response_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
    P = len(traj.prompt_ids)
    return -(lp.exp() * lp).sum(-1)[P - 1 : P - 1 + len(traj.response_ids)]


def test_plan_micro_batches_covers_each_index_once_within_budget():
    lengths = [5, 9, 3, 7, 2, 8, 12]
    plan = plan_micro_batches(lengths, 24, row_tokens=12)
    flat = sorted(i for mb in plan for row in mb for i in row)
    assert flat == list(range(len(lengths)))
    for mb in plan:
        row_lens = [sum(lengths[i] for i in row) for row in mb]
        assert all(x <= 12 for x in row_lens)
        assert max(row_lens) * len(mb) <= 24 or len(mb) == 1
    # without row_tokens: one row per micro-batch, within the budget
    for mb in plan_micro_batches(lengths, 12):
        assert len(mb) == 1 and (sum(lengths[i] for i in mb[0]) <= 12 or len(mb[0]) == 1)
    assert plan_micro_batches([20], 10) == [[[0]]]  # longer than the budget: alone
    with pytest.raises(ValueError, match="token_budget"):
        plan_micro_batches([1], 0)


def test_pack_aligns_targets_mask_and_versions():
    t = Trajectory(Sample("a", "q", "1", "d"), "g", [10, 11, 12], [20, 21], [-1.0, -2.0], [3, 4])
    pb = pack([t], torch.tensor([0.5]), [0])
    assert pb.input_ids.tolist() == [[10, 11, 12, 20, 21]]
    assert pb.position_ids.tolist() == [[0, 1, 2, 3, 4]]
    # position 2 predicts 20, position 3 predicts 21
    assert pb.targets.tolist() == [[11, 12, 20, 21, 0]]
    assert pb.mask.tolist() == [[0, 0, 1, 1, 0]]
    assert pb.behaviour_logprobs.tolist() == [[0, 0, -1.0, -2.0, 0]]
    assert pb.versions.tolist() == [[-1, -1, 3, 4, -1]]
    assert pb.advantages.tolist() == [[0, 0, 0.5, 0.5, 0]]
    bad = Trajectory(Sample("b", "q", "1", "d"), "g", [1], [2, 3], [-1.0], [0, 0])
    with pytest.raises(ValueError, match="differ in length"):
        pack([bad], torch.tensor([0.0]), [0])


def test_pack_rows_pad_with_a_separate_segment():
    a = Trajectory(Sample("a", "q", "1", "d"), "g", [10, 11], [20, 21, 22], [-1.0] * 3, [0] * 3)
    b = Trajectory(Sample("b", "q", "1", "d"), "g", [12], [23], [-2.0], [1])
    pb = pack([a, b], torch.tensor([1.0, -1.0]), [[0], [1]])
    assert pb.input_ids.shape == (2, 5)
    assert pb.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]]  # padding restarts at 0
    assert pb.mask.tolist() == [[0, 1, 1, 1, 0], [1, 0, 0, 0, 0]]
    assert pb.seq_index.tolist() == [[0, 0, 0, 0, 0], [1, 1, -1, -1, -1]]
    assert pb.advantages.tolist() == [[0, 1, 1, 1, 0], [-1, 0, 0, 0, 0]]
    assert pb.indices == [0, 1]


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_chunked_logprobs_match_unpacked_full_softmax(tiny, temperature, grad):
    trajs = make_trajs(5)
    pb = pack(trajs, torch.zeros(5), [[0, 1], [2, 3, 4]])  # two packed rows, the first padded
    with torch.set_grad_enabled(grad):  # with grad: the checkpointed chunk path
        lp, ent = token_logprobs(tiny.model, pb.input_ids, pb.position_ids, pb.targets,
                                 temperature=temperature, chunk_tokens=3, with_entropy=True, mask=pb.mask)
    assert lp.requires_grad == grad and not ent.requires_grad
    got = lp[pb.mask > 0].detach()
    ref = torch.cat([reference_logprobs(tiny.model, t, temperature) for t in trajs])
    assert torch.allclose(got, ref, atol=1e-5)
    assert (lp[pb.mask == 0] == 0).all()
    # the entropy (nats) of softmax(logits / T), from the same projection as the log-probs
    e = ent[pb.mask > 0]
    ref_e = torch.cat([reference_entropy(tiny.model, t, temperature) for t in trajs])
    assert torch.allclose(e, ref_e, atol=1e-4)
    assert (e > 0).all() and (e <= math.log(tiny.model.config.vocab_size) + 1e-4).all()
    if grad:  # gradients still flow through the log-probs of the entropy-returning chunks
        lp[pb.mask > 0].sum().backward()
        assert tiny.model.get_output_embeddings().weight.grad.abs().sum() > 0
        tiny.model.zero_grad(set_to_none=True)


def test_advantages_and_staleness_metrics():
    trajs = make_trajs(8, group=4)
    adv = compute_advantages(trajs, "grpo")
    for g in range(2):
        assert abs(float(adv[g * 4:(g + 1) * 4].sum())) < 1e-5
    assert torch.allclose(compute_advantages(trajs, "reinforce").sum(), torch.tensor(0.0), atol=1e-5)
    with pytest.raises(ValueError, match="loss.advantage"):
        compute_advantages(trajs, "nope")
    trajs[0].versions = [1, 1, 3]
    trajs[0].response_ids = trajs[0].response_ids[:3]
    m = staleness_metrics(trajs[:2], version=3)  # lags from the oldest token: 2 and 3
    assert m["staleness/max"] == 3 and m["staleness/mean"] == 2.5
    assert m["staleness/multi_version_share"] == 0.5


@pytest.mark.parametrize("loss", ["decoupled_ppo", "ppo"])
def test_gradient_identical_with_one_and_four_micro_batches(tiny, loss):
    """Global token-mean: the accumulated gradient does not depend on the micro-batch split."""
    trajs = make_trajs(8)
    g = torch.Generator().manual_seed(1)
    for t in trajs:  # behaviour log-probs near the model's own, so ratios are moderate
        ref = reference_logprobs(tiny.model, t)
        t.behaviour_logprobs = (ref + 0.1 * torch.randn(ref.shape, generator=g)).tolist()
    grads = []
    for budget in (10_000, 0):
        model = copy.deepcopy(tiny.model)
        tc = TrainerConfig(lr=1e-3, bf16=False, grad_clip=None, warmup_steps=0,
                           micro_batch_tokens=10_000 if budget else 24, pack_row_tokens=24 if not budget else 64)
        tr = Trainer(model, tc, LossConfig(name=loss, behaviour_weight_cap=None))
        captured = {}
        orig_step = tr.optimizer.step

        def step(*a, _orig=orig_step, _m=model, captured=captured, **k):
            captured["g"] = torch.cat([p.grad.flatten() for p in _m.parameters() if p.grad is not None]).clone()
            return _orig(*a, **k)

        tr.optimizer.step = step
        metrics = tr.train_step(trajs)
        grads.append((captured["g"], metrics))
    (g1, m1), (g4, m4) = grads
    assert m1["train/micro_batches"] == 1 and m4["train/micro_batches"] >= 4
    assert torch.allclose(g1, g4, atol=1e-6, rtol=1e-4)
    assert math.isclose(m1["loss/loss"], m4["loss/loss"], rel_tol=1e-5, abs_tol=1e-7)


def test_train_step_increments_version_changes_weights_and_reports(tiny):
    model = copy.deepcopy(tiny.model)
    before = [p.detach().clone() for p in model.parameters()]
    tr = Trainer(model, TrainerConfig(lr=1e-3, warmup_steps=0), LossConfig())
    m = tr.train_step(make_trajs(8))
    assert tr.version == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for key in ("loss/loss", "loss/clip_low_frac", "loss/behaviour_weight_mean", "train/grad_norm",
                "train/entropy", "staleness/max", "reward/mean", "train/tokens_per_s"):
        assert key in m and math.isfinite(m[key]), key
    upd = tr.weight_update()
    assert upd.version == 1
    name, t = next(iter(upd.tensors.items()))
    assert t.data_ptr() != model.state_dict()[name].data_ptr()  # a copy, never shared


def test_nonfinite_steps_skipped_then_stop(tiny):
    model = copy.deepcopy(tiny.model)
    tr = Trainer(model, TrainerConfig(lr=1e-3, warmup_steps=0, max_nonfinite_in_a_row=2, bf16=False),
                 LossConfig(name="ppo"))
    trajs = make_trajs(4)
    for t in trajs:
        t.reward = float("nan")
    with pytest.raises(ValueError):  # NaN rewards are rejected by the advantage estimator
        tr.train_step(trajs)
    trajs = make_trajs(4)
    for t in trajs:
        t.behaviour_logprobs = [float("-inf")] * len(t.response_ids)
    before = [p.detach().clone() for p in model.parameters()]
    orig = tr._logprobs

    def poisoned(model_, mb, with_entropy=False):
        lp, ent = orig(model_, mb, with_entropy)
        return lp * float("nan"), ent

    tr._logprobs = poisoned
    m = tr.train_step(make_trajs(4))
    assert m["train/skipped_nonfinite"] == 1.0 and tr.version == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(NonFiniteLossError, match="max_nonfinite_in_a_row"):
        tr.train_step(make_trajs(4))


def test_checkpoint_state_round_trip(tiny):
    m1 = copy.deepcopy(tiny.model)
    tr = Trainer(m1, TrainerConfig(lr=1e-3, warmup_steps=1), LossConfig())
    tr.train_step(make_trajs(8))
    state = copy.deepcopy(tr.state_dict())
    tr2 = Trainer(copy.deepcopy(tiny.model), TrainerConfig(lr=1e-3, warmup_steps=1), LossConfig())
    tr2.load_state_dict(state)
    assert tr2.version == 1
    tr.train_step(make_trajs(8, seed=1))
    tr2.train_step(make_trajs(8, seed=1))
    for a, b in zip(tr.model.parameters(), tr2.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_reused_proximal_forward_equals_separate_pass(tiny):
    """With one optimizer step per batch, pi_prox from the gradient pass (detached) equals a
    separate no-grad forward pass with the same parameters (AReaL's recompute)."""
    trajs = make_trajs(8)
    results = []
    for separate in (False, True):
        model = copy.deepcopy(tiny.model)
        tc = TrainerConfig(lr=1e-3, bf16=False, warmup_steps=0, separate_proximal_pass=separate)
        tr = Trainer(model, tc, LossConfig(name="decoupled_ppo", behaviour_weight_cap=None))
        passes = {"no_grad": 0}
        orig = tr._logprobs

        def counting(m_, *a, _orig=orig, _passes=passes, _policy=model, **k):
            _passes["no_grad"] += m_ is _policy and not torch.is_grad_enabled()  # not the KL reference's pass
            return _orig(m_, *a, **k)

        tr._logprobs = counting
        m = tr.train_step(trajs)
        m["no_grad_passes"] = passes["no_grad"]
        results.append((m, [p.detach().clone() for p in model.parameters()]))
    (m1, p1), (m2, p2) = results
    assert m1["no_grad_passes"] == 0 and m2["no_grad_passes"] == m2["train/micro_batches"]  # the separate pass did run
    assert m1["loss/behaviour_weight_mean"] == pytest.approx(m2["loss/behaviour_weight_mean"], rel=1e-5)
    for a, b in zip(p1, p2):
        assert torch.allclose(a, b, atol=1e-6)


def test_engine_logprobs_match_trainer_recompute_across_an_update(tiny):
    """Engine behaviour log-probs (T=0.7, top_p=1, top_k=0) equal the trainer's packed, chunked
    recomputation with the weights of the version that sampled each token: within 1e-4 in fp32;
    under the trainer's bf16 autocast the mean absolute gap stays below 0.05 nats (stated
    tolerance for the default training path)."""
    import asyncio

    from conveyor.rollout.engine import InferenceEngine, SamplingParams
    from conveyor.sync import WeightUpdate

    def redrawn(seed):
        m = copy.deepcopy(tiny.model)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in sorted(m.named_parameters()):
                if p.ndim == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
        return m

    old, new = redrawn(1), redrawn(2)
    eng = InferenceEngine(copy.deepcopy(old), tiny.tokenizer, seed=0, num_threads=1)
    prompts = [[1, 500 + i, 600 + i, 700 + i] for i in range(3)]
    params = SamplingParams(max_new_tokens=40, temperature=0.7)

    async def run():
        longs = [asyncio.ensure_future(eng.generate(p, params)) for p in prompts]
        await until_decoding(eng, len(prompts))  # (else the awaited short request is submitted first)
        await eng.generate([1, 42], SamplingParams(max_new_tokens=4, temperature=0.7))
        await asyncio.to_thread(eng.update_weights, WeightUpdate.from_model(new, version=1))
        return await asyncio.gather(*longs)

    with eng:
        outs = asyncio.run(run())
    trajs = [Trajectory(Sample(str(i), "q", "1", "d"), "g", o.prompt_ids, o.token_ids, o.logprobs, o.versions)
             for i, o in enumerate(outs)]
    assert all(0 in t.versions and 1 in t.versions for t in trajs)  # every trajectory spans 2 versions
    pb = pack(trajs, torch.zeros(3), [[0, 1, 2]])
    m = pb.mask > 0
    for bf16 in (False, True):
        lps = {}
        for v, model in ((0, old), (1, new)):
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                lps[v], _ = token_logprobs(model, pb.input_ids, pb.position_ids, pb.targets, temperature=0.7, mask=pb.mask)
        recomputed = torch.where(pb.versions == 0, lps[0], lps[1])[m]
        gap = (recomputed - pb.behaviour_logprobs[m]).abs()
        if bf16:
            assert gap.mean() < 0.05
        else:
            assert gap.max() < 1e-4
        # with the wrong version's weights the gap is large: the versions are recorded correctly
        wrong = torch.where(pb.versions == 0, lps[1], lps[0])[m]
        assert (wrong - pb.behaviour_logprobs[m]).abs().mean() > 0.1


def test_optimizer_paths_give_the_same_update_and_memory_options_resolve(tiny):
    """Fused (default), for-loop and foreach AdamW take the same step; checkpointing turns the
    autocast weight cache off unless asked; contradictory settings are refused."""
    from conveyor.config import ConfigError, load_config

    trajs = make_trajs(8)
    params = []
    for kw in ({}, {"optimizer_foreach": False, "optimizer_fused": False}, {"optimizer_foreach": True}):
        model = copy.deepcopy(tiny.model)
        tr = Trainer(model, TrainerConfig(lr=1e-3, warmup_steps=0, bf16=False, **kw), LossConfig())
        assert bool(tr.optimizer.defaults["fused"]) == (kw == {})
        for _ in range(2):
            tr.train_step(trajs)
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert not torch.equal(params[0], torch.cat([p.detach().flatten() for p in tiny.model.parameters()]))
    assert torch.allclose(params[0], params[1], atol=1e-6) and torch.allclose(params[0], params[2], atol=1e-6)

    assert TrainerConfig().use_autocast_weight_cache and TrainerConfig().use_fused_optimizer
    assert not TrainerConfig(activation_checkpointing=True).use_autocast_weight_cache
    assert TrainerConfig(activation_checkpointing=True, autocast_weight_cache=True).use_autocast_weight_cache
    with pytest.raises(ConfigError, match="optimizer_fused"):
        load_config(None, ["trainer.optimizer_fused=true", "trainer.optimizer_foreach=true"])


def test_bf16_autocast_logprobs_close_and_grads_reach_fp32_weights(tiny):
    """Under bf16 autocast the projection is cast once per call; log-probs stay within bf16
    tolerance of the fp32 reference and the gradient lands, in fp32, on the tied fp32 weight."""
    model = copy.deepcopy(tiny.model)
    trajs = make_trajs(4)
    pb = pack(trajs, torch.zeros(4), [[0, 1], [2, 3]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = token_logprobs(model, pb.input_ids, pb.position_ids, pb.targets, chunk_tokens=5, mask=pb.mask)
    ref = torch.cat([reference_logprobs(model, t) for t in trajs])
    assert (lp[pb.mask > 0].detach() - ref).abs().max() < 0.3  # bf16 rounding of ~11-nat log-probs
    lp[pb.mask > 0].sum().backward()
    w = model.get_output_embeddings().weight
    assert w.grad is not None and w.grad.dtype == torch.float32 and w.grad.abs().sum() > 0
    # the same gradient as an fp32 pass, up to bf16 rounding
    model2 = copy.deepcopy(tiny.model)
    lp2, _ = token_logprobs(model2, pb.input_ids, pb.position_ids, pb.targets, chunk_tokens=5, mask=pb.mask)
    lp2[pb.mask > 0].sum().backward()
    g1, g2 = w.grad.flatten(), model2.get_output_embeddings().weight.grad.flatten()
    assert torch.nn.functional.cosine_similarity(g1, g2, dim=0) > 0.99


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prompt_units_score_like_separate_sequences(tiny, temperature):
    """A group's responses behind one copy of the prompt (explicit 4-D mask) get the log-probs of
    the unshared layout, and nothing leaks between responses or across rows."""
    from conveyor.trainer.batch import group_shared_prompts, unit_length

    trajs = make_trajs(7, group=3, shared_prompts=True)
    units = group_shared_prompts(trajs, 10_000)
    assert units == [(0, 1, 2), (3, 4, 5), 6]
    assert unit_length([trajs[i] for i in units[0]]) == len(trajs[0].prompt_ids) - 1 + sum(
        1 + len(trajs[i].response_ids) for i in units[0])
    pb = pack(trajs, torch.arange(7, dtype=torch.float32), [[units[0], 6], [units[1]]])
    assert pb.attention_mask is not None and pb.attention_mask.shape[:2] == (2, 1)
    assert pb.indices == [0, 1, 2, 6, 3, 4, 5]
    shared_len = unit_length([trajs[i] for i in units[0]]) + unit_length([trajs[6]])
    assert pb.input_ids.shape[1] == shared_len < sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs[:3]) + \
        len(trajs[6].prompt_ids) + len(trajs[6].response_ids)
    lp, _ = token_logprobs(tiny.model, pb.input_ids, pb.position_ids, pb.targets, temperature=temperature,
                           mask=pb.mask, attention_mask=pb.attention_mask, chunk_tokens=4)
    for s, i in enumerate(pb.indices):
        got = lp[(pb.seq_index == s) & (pb.mask > 0)]
        assert torch.allclose(got, reference_logprobs(tiny.model, trajs[i], temperature), atol=1e-5), i
        # advantages and behaviour log-probs follow their own trajectory
        assert (pb.advantages[(pb.seq_index == s) & (pb.mask > 0)] == float(i)).all()
    assert int(pb.mask.sum()) == sum(len(t.response_ids) for t in trajs)
    # a unit split when it exceeds the row budget; different prompts in one unit are refused
    split = group_shared_prompts(trajs, unit_length([trajs[0], trajs[1]]))
    assert split[:2] == [(0, 1), 2]
    with pytest.raises(ValueError, match="another prompt"):
        pack(trajs, torch.zeros(7), [[(0, 6)]])


@pytest.mark.parametrize("loss", ["decoupled_ppo", "ppo"])
def test_shared_prompts_train_step_equals_unshared(tiny, loss):
    trajs = make_trajs(8, group=4, shared_prompts=True)
    grads, metrics = [], []
    for share in (True, False):
        model = copy.deepcopy(tiny.model)
        tr = Trainer(model, TrainerConfig(lr=1e-3, bf16=False, grad_clip=None, warmup_steps=0, share_prompts=share),
                     LossConfig(name=loss, behaviour_weight_cap=None))
        captured = {}
        orig = tr.optimizer.step

        def step(*a, _orig=orig, _m=model, captured=captured, **k):
            captured["g"] = torch.cat([p.grad.flatten() for p in _m.parameters() if p.grad is not None]).clone()
            return _orig(*a, **k)

        tr.optimizer.step = step
        metrics.append(tr.train_step(trajs))
        grads.append(captured["g"])
    assert metrics[0]["train/tokens"] == metrics[1]["train/tokens"]
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)
    assert math.isclose(metrics[0]["loss/loss"], metrics[1]["loss/loss"], rel_tol=1e-5, abs_tol=1e-7)
