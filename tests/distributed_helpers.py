"""Helpers for tests/test_distributed_trainer.py: what one trainer process of a data-parallel
group runs (spawned by ``torch.multiprocessing``, so it lives in an importable module)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

STEP_SEEDS = (0, 1)


def trainer_kwargs(case: dict) -> tuple:
    """(TrainerConfig, LossConfig) of a test case, the same in every process."""
    from conveyor.config import LossConfig, TrainerConfig

    tkw = {"bf16": False, "lr": 1e-3, "warmup_steps": 1, "micro_batch_tokens": 48, "grad_clip": 1.0, **case.get("trainer", {})}
    return TrainerConfig(**tkw), LossConfig(**case.get("loss", {}))


def critic_kwargs(case: dict) -> dict:
    """``critic_cfg`` for the Trainer where the case trains a critic (``case["critic"]``)."""
    from conveyor.config import CriticConfig

    return {"critic_cfg": CriticConfig(**case["critic"])} if "critic" in case else {}


def lora_kwargs(case: dict) -> dict:
    """``lora_cfg`` for the Trainer where the case trains LoRA adapters (``case["lora"]``)."""
    from conveyor.config import LoraConfig

    return {"lora_cfg": LoraConfig(enabled=True, **case["lora"])} if "lora" in case else {}


def batches(version_of, case: dict | None = None) -> list:
    """The fixed batches of the steps (8 trajectories, groups of 4 sharing their prompt); the
    trajectories listed in ``case["filtered"]`` have no loss token (as reward.overlong=filter
    leaves a truncated response), those in ``case["turn_rewards"]`` carry two turns' rewards (an
    agent episode's, for GAE)."""
    from test_trainer import make_trajs

    out = [make_trajs(n=8, group=4, seed=s, version=version_of(s), shared_prompts=True) for s in STEP_SEEDS]
    for batch in out:
        for i in (case or {}).get("filtered", []):
            batch[i].action_mask = [0] * len(batch[i].response_ids)
        for i in (case or {}).get("turn_rewards", []):  # a multi-turn episode's per-turn rewards
            batch[i].turn_rewards = [(0, 0.5), (len(batch[i].response_ids) - 1, float(batch[i].reward))]
    return out


def snapshot(trainer, model) -> dict:
    """Full gradients and parameters (collective under FSDP2), keyed by name; the critic's
    (its last update's gradients) under ``critic.``."""
    from conveyor.trainer.distributed import full_tensor

    named = list(model.named_parameters())
    if trainer.critic is not None:
        named += [(f"critic.{n}", p) for n, p in trainer.critic.named_parameters()]
    grads = {n: full_tensor(p.grad).clone() for n, p in named if p.grad is not None}
    params = {n: full_tensor(p.detach()).clone() for n, p in named}
    return {"grads": grads, "params": params}


def run_rank(rank: int, world: int, port: int, out_dir: str, cases: dict[str, dict]) -> None:
    """One process of the group, for each case in turn (one process group for all: the start-up
    is paid once): two train steps with a fresh trainer, a checkpoint after the first; rank 0
    saves what it saw (metrics, full gradients and parameters, the weight update, the
    checkpoint, and the second step replayed after loading the first step's checkpoint) to
    ``out_dir/<case>.pt``."""
    torch.set_num_threads(1)
    from conveyor.trainer.distributed import init_process_group

    dp = init_process_group(rank, world, port=port, timeout_s=300)
    try:
        for name, case in cases.items():
            _run_case(rank, dp, Path(out_dir) / f"{name}.pt", case)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def _run_case(rank: int, dp, out: Path, case: dict) -> None:
    """One case of :func:`run_rank` in this process."""
    from conveyor.config import ProximalConfig
    from conveyor.models import load_model
    from conveyor.trainer.trainer import Trainer

    model = load_model("tiny", seed=0).model
    tc, lc = trainer_kwargs(case)
    tr = Trainer(model, tc, lc, temperature=0.9, proximal_cfg=ProximalConfig(), data_parallel=dp, **critic_kwargs(case),
                 **lora_kwargs(case))
    seen = []
    ckpt = policy = None
    warmup = None
    if case.get("critic", {}).get("warmup_steps"):  # a critic-only step first (its batch: step 1's)
        warmup = {"metrics": tr.critic_warmup_step(batches(lambda s: 0, case)[1]), **snapshot(tr, model)}
    for step, batch in enumerate(batches(lambda s: s, case)):
        m = tr.train_step(batch)
        snap = snapshot(tr, model)
        wu = tr.weight_update()
        seen.append({"metrics": m, **snap, "weights": wu.tensors if wu is not None else None,
                     "lora": dict(wu.lora) if wu is not None else None})
        if step == 0:
            ckpt = copy.deepcopy(tr.state_dict())  # like a checkpoint written at once (it references live tensors)
            policy = tr.inference_policy()  # e.g. the engine's model: must not change with later gathers
            if "lora" in case:  # the adapter's files, gathered and written by rank 0 only
                adapter = tr.save_adapter(out.parent / f"{out.stem}_adapter_r{rank}")
                assert (adapter is None) == (rank != 0)
    refused = _refuse_bad_adapters(tr, ckpt, rank) if "lora" in case else []
    # the checkpoint of step 1 back into these processes (rank 0's full state is sent; a follower's
    # own, without tensors, is only read for its plain fields), then step 2 again (after the
    # refusals above: the processes are still in step)
    tr.load_state_dict(copy.deepcopy(ckpt))  # (loading converts the dict's tensors in place)
    replay = {"metrics": tr.train_step(batches(lambda s: s, case)[1]), **snapshot(tr, model)}
    if rank == 0:
        kept = {n: t.detach().clone() for n, t in policy.named_parameters()}
        torch.save({"steps": seen, "checkpoint": ckpt, "version": tr.version, "policy_after_step_1": kept,
                    "warmup": warmup, "replay": replay, "lora_base": tr.engine_lora_base(), "refused": refused}, out)
    else:
        (out.parent / f"{out.stem}_refused_r{rank}.txt").write_text("\n".join(refused))


def _refuse_bad_adapters(tr, ckpt: dict, rank: int) -> list[str]:
    """Two checkpoints whose adapters rank 0 cannot load (one of the wrong shape, one without its
    model), while the follower's copy is fine: every process must raise ValueError (rank 0 checks
    and tells the others; none waits for the other in a collective). The messages, in order."""
    out = []
    for spoil in ("shape", "missing"):
        bad = copy.deepcopy(ckpt)
        if rank == 0 and spoil == "shape":
            first = sorted(bad["model"])[0]
            bad["model"][first] = torch.zeros(1)
        elif rank == 0:
            del bad["model"]
        try:
            tr.load_state_dict(bad)
        except ValueError as e:
            out.append(f"{spoil}: {e}")
        else:
            out.append(f"{spoil}: loaded")
    return out


def run_single(case: dict, model0) -> dict:
    """The same two steps in one process (the reference)."""
    from conveyor.config import ProximalConfig
    from conveyor.trainer.trainer import Trainer

    model = copy.deepcopy(model0)
    tc, lc = trainer_kwargs(case)
    tr = Trainer(model, tc, lc, temperature=0.9, proximal_cfg=ProximalConfig(), **critic_kwargs(case), **lora_kwargs(case))
    warmup = None
    if case.get("critic", {}).get("warmup_steps"):
        warmup = {"metrics": tr.critic_warmup_step(batches(lambda s: 0, case)[1]), **snapshot(tr, model)}
    seen = []
    for batch in batches(lambda s: s, case):
        m = tr.train_step(batch)
        wu = tr.weight_update()
        seen.append({"metrics": m, **snapshot(tr, model), "weights": wu.tensors, "lora": dict(wu.lora)})
    return {"steps": seen, "version": tr.version, "warmup": warmup}
