"""FSDP2 data parallelism (issue 15, section 1): two CPU processes on the gloo backend give the
single-process trainer's update on the same batch (loss, every metric, full gradients and
parameters; the critic's too: SAO's recipe with warm-up, K = 2 updates, frozen attention, value
clipping and whitened GAE advantages), publish the full weights, and write a checkpoint that one
process resumes. A LoRA policy (adapters sharded with the frozen base weights; the KL reference
is the base model under peft's disable_adapter) gives the single process's update too, publishes
merged weights gathered from its adapters only, and writes the adapter's files at rank 0."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.multiprocessing as mp
from distributed_helpers import (
    batches,
    critic_kwargs,
    lora_kwargs,
    run_rank,
    run_single,
    trainer_kwargs,
)

from conveyor.config import ConfigError, LoraConfig, LossConfig, ProximalConfig, TrainerConfig
from conveyor.sync import LoraFactors
from conveyor.trainer.distributed import DataParallel, assign_micro_batches, free_port
from conveyor.trainer.trainer import Trainer

CASES = {
    # three micro-batches over two processes: one process also runs a zero-weight padding pass
    "grpo_token_mean": {"trainer": {"micro_batch_tokens": 24}},
    # two micro-batches, one each; sequence-mean aggregation and truncated importance sampling
    "seq_mean_tis": {"loss": {"aggregation": "seq_mean_token_mean", "correction": "tis_token"}},
    # five micro-batches, two of them without a loss token (a group filtered as overlong): 3 + 2
    # real passes plus one padding pass; the single process skips the empty ones
    "filtered_group": {"trainer": {"micro_batch_tokens": 16}, "filtered": [0, 1, 2, 3]},
    # a critic (a copy of the policy, sharded alike): one warm-up step, then K = 2 critic updates
    # per policy update with frozen attention, value clipping and whitened GAE advantages; three
    # micro-batches (a padding pass for the critic too), one group filtered (a micro-batch with no
    # counted token on one process), per-turn rewards on the other group (multi-turn episodes)
    "sao_critic": {"trainer": {"micro_batch_tokens": 24}, "loss": {"advantage": "gae"}, "filtered": [4, 5, 6, 7],
                   "turn_rewards": [0, 1, 2, 3],
                   "critic": {"warmup_steps": 1, "updates_per_step": 2, "freeze_attention": True, "value_clip": 0.5,
                              "whiten_advantages": True, "lr": 1e-3}},
    # LoRA adapters (rank 4, alpha 8: scale 2) on the default targets, with the KL penalty against
    # the base model (adapters disabled); three micro-batches (a padding pass)
    "lora_kl": {"trainer": {"micro_batch_tokens": 24}, "loss": {"kl_coef": 0.05}, "lora": {"rank": 4, "alpha": 8.0}},
    # LoRA whose engine receives the adapters (lora.sync=adapter) and keeps the base weights W0
    # from rank 0's unsharded twin; two micro-batches, one per process
    "lora_adapter_sync": {"lora": {"rank": 2, "alpha": 4.0, "sync": "adapter"}},
}
MICRO_BATCHES = {"grpo_token_mean": 3, "seq_mean_tis": 2, "filtered_group": 5, "sao_critic": 3, "lora_kl": 3,
                 "lora_adapter_sync": 2}
ADAPTER = ("lora_A.default.weight", "lora_B.default.weight", "base_layer.weight")
SKIP = ("time/", "train/tokens_per_s", "proximal/extra_bytes")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def _close_params(a: torch.Tensor, b: torch.Tensor) -> bool:
    # AdamW's m / sqrt(v) turns summation-order noise in a near-zero gradient element into up to
    # a step of lr (1e-3): measured, one element of the embedding moved 1.1e-5 apart at step 2,
    # every other parameter < 1e-6. Gradients (above) are compared tightly; a wrong gradient
    # scale would not show in AdamW's parameters, so that is where scale errors are caught.
    return torch.allclose(a, b, rtol=1e-4, atol=5e-5)


@pytest.fixture(scope="module")
def group_out(tmp_path_factory):
    """Every case run by one group of two processes (rank 0's records, one file per case)."""
    out = tmp_path_factory.mktemp("dp")
    mp.spawn(run_rank, args=(2, free_port(), str(out), CASES), nprocs=2, join=True)
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def runs(request, group_out, tiny):
    case = CASES[request.param]
    dp = torch.load(group_out / f"{request.param}.pt", weights_only=False)
    return request.param, case, dp, run_single(case, tiny.model)


def test_two_processes_give_the_single_process_update(runs):
    name, _, dp, single = runs
    assert dp["version"] == single["version"] == 2
    for step, (d, s) in enumerate(zip(dp["steps"], single["steps"], strict=True)):
        keys = {k for k in s["metrics"] if not k.startswith(SKIP)}
        assert keys == {k for k in d["metrics"] if not k.startswith(SKIP)}
        for k in keys:
            assert d["metrics"][k] == pytest.approx(s["metrics"][k], rel=1e-4, abs=1e-6, nan_ok=True), (name, step, k)
        assert d["metrics"]["train/micro_batches"] == MICRO_BATCHES[name]  # a padding pass is not counted
        assert set(d["grads"]) == set(s["grads"])
        for n in s["grads"]:
            assert _close(d["grads"][n], s["grads"][n]), (name, step, n, (d["grads"][n] - s["grads"][n]).abs().max())
        for n in s["params"]:
            assert _close_params(d["params"][n], s["params"][n]), (name, step, n)
        if CASES[name].get("lora", {}).get("sync") == "adapter":  # factors only; the engine merges
            assert not d["weights"] and d["lora"] and set(d["lora"]) == set(s["lora"])
            base = dp["lora_base"]  # W0 from rank 0's twin: the initial weights, whole
            assert set(base) == set(d["lora"])
            for n, f in d["lora"].items():
                assert torch.equal(base[n], d["params"][f"{n[:-len('.weight')]}.base_layer.weight"]), n
                assert f.scale == s["lora"][n].scale == 2.0
                assert _close_params(f.A, s["lora"][n].A) and _close_params(f.B, s["lora"][n].B), (name, step, n)
                assert _close_params(f.merge(base[n]), s["lora"][n].merge(base[n])), (name, step, n)
            continue
        if "lora" in CASES[name]:  # the merged targeted weights W0 + (alpha / r) B A, and nothing else
            assert d["weights"] and set(d["weights"]) == set(s["weights"]) and not d["lora"]
            for n, t in d["weights"].items():
                a, b, w0 = (d["params"][f"{n[:-len('.weight')]}.{k}"] for k in ADAPTER)
                assert torch.allclose(t, LoraFactors(A=a, B=b, scale=8.0 / 4).merge(w0), rtol=1e-6, atol=1e-7), n
                assert _close_params(t, s["weights"][n]), (name, step, n)
            continue
        # the weights rank 0 publishes are the full, updated parameters (the same tensors gathered)
        for n, t in d["params"].items():
            if not n.startswith("critic."):  # the critic is never published
                assert torch.equal(d["weights"][n], t), (name, step, n)


@pytest.fixture(scope="module")
def critic_runs(group_out, tiny):
    """The SAO case of the group run and its single-process reference."""
    case = CASES["sao_critic"]
    return case, torch.load(group_out / "sao_critic.pt", weights_only=False), run_single(case, tiny.model)


def test_the_critic_warm_up_and_updates_match_the_single_process_ones(critic_runs):
    """The SAO case: the warm-up step (critic only) and every step's critic update give the
    single process's critic metrics, gradients (its last update's) and parameters; frozen
    attention stays bit-identical to the initial weights while the rest of the critic moves."""
    case, dp, single = critic_runs
    steps = [("warmup", dp["warmup"], single["warmup"])] + [
        (i, d, s) for i, (d, s) in enumerate(zip(dp["steps"], single["steps"], strict=True))]
    for step, d, s in steps:
        assert d["metrics"]["critic/updates"] == s["metrics"]["critic/updates"] == 2.0, step
        for k in [k for k in s["metrics"] if k.startswith("critic/")]:
            assert d["metrics"][k] == pytest.approx(s["metrics"][k], rel=1e-4, abs=1e-6), (step, k)
        crit = [n for n in s["grads"] if n.startswith("critic.")]
        assert crit and set(crit) == {n for n in d["grads"] if n.startswith("critic.")}
        for n in crit:
            assert _close(d["grads"][n], s["grads"][n]), (step, n, (d["grads"][n] - s["grads"][n]).abs().max())
        for n in [n for n in s["params"] if n.startswith("critic.")]:
            assert _close_params(d["params"][n], s["params"][n]), (step, n)
    assert dp["warmup"]["metrics"]["critic/grad_norm_attention"] == 0.0
    assert dp["warmup"]["metrics"]["critic/grad_norm_mlp"] > 0
    first, last = dp["warmup"]["params"], dp["steps"][-1]["params"]
    attn = [n for n in first if n.startswith("critic.") and ".self_attn." in n]
    mlp = [n for n in first if n.startswith("critic.") and ".mlp." in n]
    assert attn and mlp
    assert all(torch.equal(first[n], last[n]) for n in attn)
    assert all(not torch.equal(first[n], last[n]) for n in mlp)


def test_a_padding_copy_of_a_micro_batch_leaves_its_trajectories_advantages_alone(tiny):
    """A process may run a zero-weight copy of one of its own micro-batches (the smallest):
    the copy has no action token, and must not overwrite the real micro-batch's per-trajectory
    advantages with 0 (``train/advantage_abs_mean``), nor fail the check that a multi-turn
    episode's turn rewards sit on action tokens (an agent episode's ``turn_rewards``). Checked in
    one process on a hand-made batch: micro-batch 0 and its padding copy."""
    import dataclasses

    from test_trainer import make_trajs

    from conveyor.config import CriticConfig
    from conveyor.trainer.distributed import padding_batch

    tr = Trainer(copy.deepcopy(tiny.model), TrainerConfig(bf16=False, micro_batch_tokens=24), LossConfig(advantage="gae"),
                 critic_cfg=CriticConfig())
    trajs = make_trajs(n=4, group=4, shared_prompts=True)
    for i, t in enumerate(trajs):
        t.reward = float(i % 2)
        t.turn_rewards = [(0, 0.25), (len(t.response_ids) - 1, t.reward)]  # two turns' rewards
    batch = tr.pack(trajs)
    real = batch.micro_batches[0]
    batch = dataclasses.replace(batch, micro_batches=batch.micro_batches + [padding_batch(real)],
                                token_weights=batch.token_weights + [torch.zeros_like(batch.token_weights[0])],
                                denominators=batch.denominators + [0.0],
                                padded=[False] * len(batch.micro_batches) + [True])
    scores = tr.score(batch)
    tr.assign_advantages(batch, scores)
    assert all(float(batch.sequence_advantages[i]) != 0.0 for i in real.indices)


def test_an_inference_policy_is_a_copy_that_later_gathers_leave_alone(runs):
    """inference_policy() at version 1 (an engine's or an evaluation's model) still holds version
    1's weights after version 2 was gathered for the engine."""
    name, _, dp, _ = runs

    def plain(step: dict) -> dict:  # the policy's weights under the plain model's names (LoRA: merged)
        if "lora" not in CASES[name]:
            return step["params"]
        if step["lora"]:  # lora.sync=adapter: merged from the factors and the engine's W0
            return {**step["params"], **{n: f.merge(dp["lora_base"][n]) for n, f in step["lora"].items()}}
        return {**step["params"], **step["weights"]}

    first, second = plain(dp["steps"][0]), plain(dp["steps"][1])
    for n, t in dp["policy_after_step_1"].items():
        assert torch.equal(t, first[n]), n
    assert any(not torch.equal(t, second[n]) for n, t in dp["policy_after_step_1"].items())


def test_the_update_moved_the_parameters(runs, tiny):
    """Guards the comparison above against a trainer that did nothing on both sides."""
    name, _, dp, _ = runs
    p0 = dict(tiny.model.named_parameters())
    params = dp["steps"][0]["params"]
    if "lora" in CASES[name]:  # every B moved off its zero init; the frozen weights stayed
        lora_b = [t for n, t in params.items() if ".lora_B." in n]
        assert lora_b and all(float(t.abs().sum()) > 0 for t in lora_b)
        assert all(torch.equal(t, p0[n.replace(".base_layer.", ".")].detach()) for n, t in params.items() if ".lora_" not in n)
        return
    moved = [n for n, t in params.items() if n in p0 and not torch.equal(t, p0[n].detach())]
    assert len(moved) > len(p0) // 2


def test_a_data_parallel_checkpoint_resumes_in_one_process(runs, tiny):
    name, case, dp, single = runs
    ckpt = dp["checkpoint"]
    assert ckpt["optimizer_format"] == "by_name" and ckpt["version"] == 1
    model = copy.deepcopy(tiny.model)
    tc, lc = trainer_kwargs(case)
    tr = Trainer(model, tc, lc, temperature=0.9, proximal_cfg=ProximalConfig(), **critic_kwargs(case), **lora_kwargs(case))
    tr.load_state_dict(ckpt)
    m = tr.train_step(batches(lambda s: s, case)[1])
    assert m["loss/loss"] == pytest.approx(single["steps"][1]["metrics"]["loss/loss"], rel=1e-4, abs=1e-6)
    for n, p in model.named_parameters():
        assert _close_params(p.detach(), single["steps"][1]["params"][n]), (name, n)
    if "critic" in case:  # the critic, its optimizer and its warm-up count came back too
        assert ckpt["critic"]["optimizer_format"] == "by_name" and tr.critic_warmup_done == 1
        assert m["critic/value_loss"] == pytest.approx(single["steps"][1]["metrics"]["critic/value_loss"], rel=1e-4)
        for n, p in tr.critic.named_parameters():
            assert _close_params(p.detach(), single["steps"][1]["params"][f"critic.{n}"]), (name, n)
    if "lora" in case:  # the adapters only, gathered from the shards, and their AdamW state by name
        want = {k: case["lora"][k] for k in ("rank", "alpha")}
        assert ckpt["lora"] == {**want, "target_modules": list(LoraConfig().target_modules)}
        assert ckpt["model"] and all(".lora_" in k for k in ckpt["model"])
        assert set(ckpt["optimizer"]["state"]) == set(ckpt["model"])


def test_rank_0_writes_the_lora_adapter_files_with_the_gathered_adapters(group_out, tiny):
    """save_adapter under data parallelism: rank 0's peft files hold the full adapters of
    version 1 (loadable by peft onto the base model), rank 1 wrote nothing."""
    peft = pytest.importorskip("peft")
    dp = torch.load(group_out / "lora_kl.pt", weights_only=False)
    assert not (group_out / "lora_kl_adapter_r1").exists()
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(tiny.model), str(group_out / "lora_kl_adapter_r0"))
    got = {n: p for n, p in loaded.get_base_model().named_parameters() if ".lora_" in n}
    assert got and set(got) == {n for n in dp["steps"][0]["params"] if ".lora_" in n}
    for n, p in got.items():
        assert torch.equal(p.detach(), dp["steps"][0]["params"][n]), n


@pytest.mark.parametrize("case", ["lora_kl", "lora_adapter_sync"])
def test_a_lora_checkpoint_rank_0_cannot_load_is_refused_by_every_process(group_out, case):
    """Rank 0 checks the adapters (a wrong shape; no model at all) and every process raises
    ValueError together; the replay of step 2 afterwards shows that they stayed in step."""
    dp = torch.load(group_out / f"{case}.pt", weights_only=False)
    follower = (group_out / f"{case}_refused_r1.txt").read_text().splitlines()
    assert [m.split(":")[0] for m in dp["refused"]] == ["shape", "missing"]
    assert "shape" in dp["refused"][0] and "cannot be read (KeyError" in dp["refused"][1]
    assert follower == [f"{s}: the checkpoint's LoRA adapter does not fit this policy (rank 0's error says why)"
                        for s in ("shape", "missing")]
    assert dp["replay"]["metrics"]["loss/loss"] == pytest.approx(dp["steps"][1]["metrics"]["loss/loss"], rel=1e-4)


def test_a_data_parallel_checkpoint_resumes_in_the_same_processes(runs):
    """Step 1's checkpoint loaded back into the two processes (each takes its shards of rank 0's
    full state: the model, or with LoRA the adapters only, and the AdamW state by name), then
    step 2 again: the single process's second update."""
    name, case, dp, single = runs
    replay, want = dp["replay"], single["steps"][1]
    assert replay["metrics"]["loss/loss"] == pytest.approx(want["metrics"]["loss/loss"], rel=1e-4, abs=1e-6)
    for n in want["params"]:
        assert _close_params(replay["params"][n], want["params"][n]), (name, n)


def test_a_single_process_optimizer_state_converts_to_the_by_name_format(tiny):
    """What a data-parallel trainer does with a checkpoint written by one process: its
    position-keyed AdamW state, renamed, loads back into a fresh trainer as the same state."""
    from test_trainer import make_trajs

    from conveyor.trainer.distributed import load_full_optimizer_state, optimizer_state_by_name

    tr = Trainer(copy.deepcopy(tiny.model), *trainer_kwargs({}))
    tr.train_step(make_trajs(n=8, group=4, shared_prompts=True))
    names = [n for n, p in tr.model.named_parameters() if p.requires_grad]
    by_name = optimizer_state_by_name(copy.deepcopy(tr.optimizer.state_dict()), names)
    assert set(by_name["state"]) == set(names) and by_name["param_groups"][0]["params"] == names
    fresh = Trainer(copy.deepcopy(tiny.model), *trainer_kwargs({}))
    load_full_optimizer_state(fresh.model, fresh.optimizer, by_name)
    for (n, p), (_, q) in zip(tr.model.named_parameters(), fresh.model.named_parameters(), strict=True):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(tr.optimizer.state[p][k], fresh.optimizer.state[q][k]), (n, k)
    with pytest.raises(ValueError, match="another model"):
        optimizer_state_by_name(tr.optimizer.state_dict(), names[:3])


@pytest.mark.parametrize("loss_kw, trainer_kw, proximal, lora, critic, needle", [
    ({"advantage": "gae"}, {}, "recompute", False, {"num_critics": 2}, "critic.num_critics=2"),
    ({"advantage": "gae"}, {}, "recompute", False, {"backbone": "head"}, "critic.backbone=head"),
    ({}, {"minibatches": 2}, "recompute", False, {}, "trainer.minibatches=2"),
    ({}, {}, "snapshot", False, {}, "proximal.method=snapshot"),
    ({"advantage": "gae"}, {}, "recompute", True, {"backbone": "head"}, "critic.backbone=head"),
])
def test_unsupported_options_are_refused_naming_the_key(tiny, loss_kw, trainer_kw, proximal, lora, critic, needle):
    from conveyor.config import CriticConfig

    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        Trainer(copy.deepcopy(tiny.model), TrainerConfig(bf16=False, **trainer_kw), LossConfig(**loss_kw),
                proximal_cfg=ProximalConfig(method=proximal), lora_cfg=LoraConfig(enabled=lora),
                critic_cfg=CriticConfig(**critic), data_parallel=DataParallel(0, 2))


def test_micro_batches_are_assigned_largest_first_to_the_least_loaded_process():
    # tokens 50, 40, 30, 20, 10 over 2: 50 -> p0, 40 -> p1, 30 -> p1 (40 < 50), 20 -> p0, 10 -> p0 (cap 3)
    assert assign_micro_batches([50, 40, 30, 20, 10], 2) == [[0, 3, 4], [1, 2]]
    # ties go to the lower index and the lower rank; at most ceil(n / W) each
    assert assign_micro_batches([5, 5, 5], 2) == [[0, 2], [1]]
    assert assign_micro_batches([1, 100, 1, 1], 2) == [[1, 3], [0, 2]]
    assert assign_micro_batches([7], 3) == [[0], [], []]


E2E = [
    "model.name=tiny", "trainer.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=10",
    "data.heldout_limit=3", "run.eval_max_new_tokens=6", "run.progress=false", "run.export=false",
    "reward.workers=1", "trainer.lr=1e-3", "rollout.tool=none", "run.eval_before=false", "run.checkpoint_every=2",
    "trainer.collective_timeout_s=60",  # a collective out of step fails the test in a minute, not ten
]


def test_conveyor_train_with_two_trainer_processes_runs_resumes_and_cleans_up(tmp_path):
    """The inline runtime with trainer.world_size=2: rank 0 is this process, rank 1 a spawned
    follower; the run trains, checkpoints, evaluates with the gathered weights, stops its
    follower; its checkpoint resumes with ONE process (the optimizer state is keyed by name), and
    that process's checkpoint with two again (rank 0 renames its position-keyed state). The run
    trains a critic too (a warm-up step, K = 2), whose state travels the same way (announced to
    the follower without its tensors, broadcast by rank 0); one run covers both (the policy-only
    path of every step is the same code, checked by the group cases above; ~60 s each on 2 slow
    cores)."""
    import json
    import multiprocessing

    from conveyor.config import load_config
    from conveyor.train import load_run_config, run_training

    run = tmp_path / "r"
    extra = ["loss.advantage=gae", "critic.warmup_steps=1", "critic.updates_per_step=2"]
    res = run_training(load_config(None, E2E + extra + ["trainer.total_steps=2", "trainer.world_size=2", f"run.dir={run}"]))
    assert res.steps == 2
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("conveyor-trainer")]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["train/tokens"] > 0 for r in rows)
    ckpt = torch.load(run / "checkpoints" / "step_2" / "trainer.pt", weights_only=False)
    assert ckpt["optimizer_format"] == "by_name"
    assert all(r["critic/updates"] == 2.0 for r in rows)
    assert ckpt["critic"]["optimizer_format"] == "by_name" and ckpt["critic_warmup_done"] == 1
    assert (run / "critic_warmup.jsonl").read_text().count("\n") == 1
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["version"] for e in events if e["event"] == "eval"] == [2]  # the after-evaluation ran
    # resumed by one process, then by two from the checkpoint one process wrote (rank 0 reads
    # it, renames its optimizer state and broadcasts it)
    res = run_training(load_run_config(run, ["trainer.total_steps=3", "trainer.world_size=1"]), resume_dir=run)
    assert res.steps == 3
    ckpt = torch.load(run / "checkpoints" / "step_3" / "trainer.pt", weights_only=False)
    assert "optimizer_format" not in ckpt and "optimizer_format" not in ckpt["critic"]
    res = run_training(load_run_config(run, ["trainer.total_steps=4", "trainer.world_size=2"]), resume_dir=run)
    assert res.steps == 4 and (run / "checkpoints" / "step_4").is_dir()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # the critic kept training from its restored state in every segment
    assert all(r["critic/updates"] == 2.0 for r in rows)
    assert torch.load(run / "checkpoints" / "step_4" / "trainer.pt", weights_only=False)["critic"]["steps"] == 2 * (1 + 4)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("conveyor-trainer")]


def test_a_lora_run_with_two_trainer_processes_publishes_adapters_exports_and_resumes(tmp_path):
    """``lora.enabled=true lora.sync=adapter`` with trainer.world_size=2: the engine gets its base
    weights from rank 0's unsharded twin and each version's adapters gathered from the shards; the
    export holds the merged model and the adapter (rank 0 writes them); one process resumes the
    adapter checkpoint two processes wrote."""
    import json

    from conveyor.config import load_config
    from conveyor.train import load_run_config, run_training

    pytest.importorskip("peft")
    run = tmp_path / "r"
    # a reward that varies within a group (the response length): non-zero advantages, so the adapters move
    lora = ["lora.enabled=true", "lora.sync=adapter", "lora.rank=4", "trainer.lr=1e-2", "rollout.temperature=1.0",
            "reward.fn=conveyor.rewards.faults:response_length_reward"]
    res = run_training(load_config(None, E2E + lora + ["trainer.total_steps=2", "trainer.world_size=2",
                                                       "run.export=true", f"run.dir={run}"]))
    assert res.steps == 2
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["sync"] for e in events if e["event"] == "lora"] == ["adapter"]
    assert (run / "export" / "adapter" / "adapter_model.safetensors").is_file()
    assert (run / "export" / "config.json").is_file()
    ckpt = torch.load(run / "checkpoints" / "step_2" / "trainer.pt", weights_only=False)
    assert ckpt["optimizer_format"] == "by_name" and ckpt["model"] and all(".lora_" in k for k in ckpt["model"])
    assert any(float(t.abs().sum()) > 0 for k, t in ckpt["model"].items() if ".lora_B." in k)  # trained
    # the export (rank 0, from its twin) is the base model with version 2's gathered adapters merged
    from conveyor.models import load_model

    base, merged = load_model("tiny", seed=0).model.state_dict(), load_model(str(run / "export")).model.state_dict()
    name = "model.layers.0.self_attn.q_proj"
    a, b = ckpt["model"][f"{name}.lora_A.default.weight"], ckpt["model"][f"{name}.lora_B.default.weight"]
    assert torch.allclose(merged[f"{name}.weight"], LoraFactors(A=a, B=b, scale=16.0 / 4).merge(base[f"{name}.weight"]),
                          atol=1e-6)
    assert not torch.equal(merged[f"{name}.weight"], base[f"{name}.weight"])
    res = run_training(load_run_config(run, ["trainer.total_steps=3", "trainer.world_size=1", "run.export=false"]),
                       resume_dir=run)
    assert res.steps == 3
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_world_size_with_the_ray_runtime_is_a_config_error_and_with_lora_is_not():
    from conveyor.config import load_config

    with pytest.raises(ConfigError, match="trainer.world_size=2 needs runtime.name=inline"):
        load_config(None, ["trainer.world_size=2", "runtime.name=ray"])
    with pytest.raises(ConfigError, match=r"does not support: trainer\.minibatches=2"):  # at load, before any process starts
        load_config(None, ["trainer.world_size=2", "trainer.minibatches=2"])
    assert load_config(None, ["trainer.world_size=2", "lora.enabled=true"]).lora.enabled


def test_a_failed_collective_call_at_rank_0_refuses_every_later_one():
    """Once a collective call raised at rank 0 the followers may sit in a collective: later calls
    (e.g. the final checkpoint) are refused at once instead of pairing mismatched collectives."""
    from conveyor.trainer.distributed import OutOfStepError, collective
    from conveyor.trainer.trainer import NonFiniteLossError

    class Fake:
        def __init__(self):
            self.announced = []
            self.dp = DataParallel(0, 2, announce=self.announced.append)

        @collective()
        def step(self, exc=None):
            if exc is not None:
                raise exc
            return "ran"

    f = Fake()
    assert f.step() == "ran"
    with pytest.raises(NonFiniteLossError):  # every process raises it, in agreement: still in step
        f.step(NonFiniteLossError("nan"))
    assert f.step() == "ran"
    with pytest.raises(ValueError):
        f.step(ValueError("bad support ids"))
    with pytest.raises(OutOfStepError, match="out of step since step failed at rank 0"):
        f.step()
    assert [c[0] for c in f.announced] == ["step"] * 4  # the refused call was not announced


LEADER = """
import sys, time
from conveyor.config import load_config
from conveyor.runtime.trainer_group import TrainerGroup
cfg = load_config(None, ["model.name=tiny", "trainer.world_size=2", "trainer.collective_timeout_s=60"])
group = TrainerGroup.start(cfg, bf16=False, threads=1)
print(group.processes[0].pid, flush=True)
time.sleep(600)
"""


def test_a_follower_exits_when_rank_0_is_killed(tmp_path):
    """``kill -9`` of the conveyor train process must not leave its trainer followers behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    leader = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True)
    try:
        follower = int(leader.stdout.readline())
        os.kill(follower, 0)  # running
        time.sleep(3)
        leader.send_signal(signal.SIGKILL)
        leader.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(follower, 0)
            except ProcessLookupError:
                break
            with open(f"/proc/{follower}/stat") as f:  # an exited, not yet reaped child is gone too
                if f.read().split()[2] == "Z":
                    break
            time.sleep(0.5)
        else:
            os.kill(follower, signal.SIGKILL)
            pytest.fail(f"follower {follower} still running 30 s after rank 0 was killed")
    finally:
        if leader.poll() is None:
            leader.kill()


def test_a_trainer_actor_needs_the_ray_runtime_and_refuses_the_dedicated_worker():
    from conveyor.config import load_config

    with pytest.raises(ConfigError, match="runtime.trainer=actor needs runtime.name=ray"):
        load_config(None, ["runtime.trainer=actor"])
    with pytest.raises(ConfigError, match="proximal.method=dedicated"):
        load_config(None, ["runtime.trainer=actor", "runtime.name=ray", "proximal.method=dedicated"])
    assert load_config(None, ["runtime.trainer=actor", "runtime.name=ray"]).runtime.trainer_num_cpus == 1.0
