"""The trainer as a recipe of phases (issue 11, section 1): the restructured ``train_step`` gives
the losses, gradient norms and parameters the single-function trainer gave on fixed batches.

``tests/data/trainer_before_phases.json`` was written by :func:`fingerprint` running the trainer
of commit d90b11c (before the phases, the objective registry and the updaters); the restructured
trainer gave bit-identical metrics and parameters on the machine that recorded it, and must stay
within float32 rounding of them anywhere (kernels differ across CPUs).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from test_trainer import make_trajs

from conveyor.config import LossConfig, ProximalConfig, TrainerConfig
from conveyor.trainer.objectives import OBJECTIVES, ObjectiveInputs, get_objective
from conveyor.trainer.trainer import Trainer
from conveyor.trainer.updater import Updater, warmup_schedule

GOLDEN = Path(__file__).parent / "data" / "trainer_before_phases.json"

CASES = {
    "decoupled": ({}, {}),
    "ppo": ({"name": "ppo"}, {}),
    "two_ratio_kl": ({"name": "two_ratio", "kl_coef": 0.1}, {}),
    "dis": ({"name": "dis", "kl_coef": 0.0}, {}),
    "decoupled_tis_reject_seqmean": ({"correction": "tis_token", "kl_reject": "k3", "aggregation": "seq_mean_token_mean"}, {}),
    "mini2_shared": ({"kl_coef": 0.05}, {"minibatches": 2, "micro_batch_tokens": 64}),
    "separate_pass": ({}, {"separate_proximal_pass": True}),
    "noshare_dr": ({"advantage": "dr_grpo", "aggregation": "constant", "aggregation_constant": 20}, {"share_prompts": False}),
    "reinforce_seqsum": ({"advantage": "reinforce", "aggregation": "seq_mean_token_sum"}, {}),
}


def fingerprint(model0: torch.nn.Module, loss_kw: dict, trainer_kw: dict) -> list[dict]:
    """Two fp32 train steps on fixed batches: the metrics (no timings) and the parameters' L2
    norm and sum after each."""
    torch.manual_seed(0)
    model = copy.deepcopy(model0)
    tkw = {"bf16": False, "lr": 1e-3, "warmup_steps": 1, **trainer_kw}
    tr = Trainer(model, TrainerConfig(**tkw), LossConfig(**loss_kw), temperature=0.9, proximal_cfg=ProximalConfig())
    res = []
    for step in range(2):
        m = tr.train_step(make_trajs(n=8, group=4, seed=step, version=tr.version, shared_prompts=True))
        flat = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
        res.append({
            "metrics": {k: v for k, v in sorted(m.items()) if not k.startswith("time/") and k != "train/tokens_per_s"},
            "param_norm": float(flat.norm()), "param_sum": float(flat.sum()), "version": tr.version,
        })
    return res


# train/optimizer_steps: optimiser steps taken in the update (0 when no token carries loss)
ADDED_METRICS = {"train/optimizer_steps"}
# advantage/*: where the advantages went by length and position (conveyor.trainer.credit), reporting only;
# reference/*: the share of the KL reference's log-probs scored before the update (conveyor.trainer.reference)
ADDED_PREFIXES = ("advantage/", "reference/")


@pytest.mark.parametrize("case", sorted(CASES))
def test_restructured_trainer_equals_the_single_function_trainer(tiny, case):
    golden = json.loads(GOLDEN.read_text())[case]
    got = fingerprint(tiny.model, *CASES[case])
    for g, w in zip(got, golden, strict=True):
        assert g["version"] == w["version"]
        # metrics added after the golden file was written (reporting only; the update is unchanged)
        added = {k for k in g["metrics"] if k in ADDED_METRICS or k.startswith(ADDED_PREFIXES)}
        assert set(g["metrics"]) - added == set(w["metrics"])
        assert "advantage/length_corr" in g["metrics"], case
        assert ADDED_METRICS <= set(g["metrics"])
        for k, v in w["metrics"].items():
            if k == "train/lr":  # the golden file logged the schedule's next rate (see below)
                continue
            assert g["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-6, nan_ok=True), (case, k)
        assert g["param_norm"] == pytest.approx(w["param_norm"], rel=1e-6)
        assert g["param_sum"] == pytest.approx(w["param_sum"], rel=1e-5, abs=1e-3)
    # train/lr is the rate the update stepped with (fresh-user trial 4, finding 7): warm-up of 1
    # update, peak 1e-3; mini2_shared's warm-up is 2 optimiser steps and its first update took
    # one (the batch made one minibatch), at half the peak
    want = [5e-4, 1e-3] if case == "mini2_shared" else [1e-3, 1e-3]
    assert [g["metrics"]["train/lr"] for g in got] == pytest.approx(want), case


def test_every_loss_name_of_the_config_has_an_objective():
    names = LossConfig.model_fields["name"].annotation.__args__
    assert set(names) == set(OBJECTIVES)
    assert [n for n in names if get_objective(n).needs_proximal] == ["decoupled_ppo", "two_ratio"]
    with pytest.raises(ValueError, match="unknown objective 'nope'.*registered: decoupled_ppo, dis"):
        get_objective("nope")


def test_objective_without_its_proximal_input_is_a_clear_error():
    x = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="loss.name=two_ratio needs proximal log-probs"):
        get_objective("two_ratio").loss(ObjectiveInputs(x, x, x, torch.ones(1, 3)), LossConfig(), (0.3, 5.0))


def test_updater_steps_only_its_filtered_parameters_and_round_trips():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    up = Updater.adamw("critic", model, lr=0.1, grad_clip=1.0, param_filter=lambda n, p: n.startswith("1."))
    before = copy.deepcopy(model.state_dict())
    model(torch.ones(2, 3)).sum().backward()
    assert float(up.clip_grad_norm()) > 0
    up.step()
    after = model.state_dict()
    assert torch.equal(after["0.weight"], before["0.weight"])  # not in the filter: untouched
    assert not torch.equal(after["1.weight"], before["1.weight"])
    assert up.steps == 1
    clone = Updater.adamw("critic", copy.deepcopy(model), lr=0.1, param_filter=lambda n, p: n.startswith("1."))
    clone.load_state_dict(up.state_dict())
    assert clone.steps == 1 and clone.optimizer.state_dict()["state"].keys() == up.optimizer.state_dict()["state"].keys()
    with pytest.raises(ValueError, match="critic: no trainable parameters"):
        Updater.adamw("critic", model, lr=0.1, param_filter=lambda n, p: False)


def test_warmup_schedule_hand_values():
    f = warmup_schedule(total_steps=6, warmup_steps=2, kind="cosine")
    assert [round(f(s), 6) for s in range(7)] == [0.5, 1.0, 1.0, 0.853553, 0.5, 0.146447, 0.0]
    assert [warmup_schedule(4, 0, "constant")(s) for s in range(3)] == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="unknown kind 'linear'"):
        warmup_schedule(4, 0, "linear")


def test_a_resumed_updater_takes_its_new_settings_and_reports_the_rate_it_stepped_with():
    """Fresh-user trial 4, findings 1 and 7: a resume with another lr printed the change but
    trained at the checkpoint's (the loaded optimizer / schedule state held it), and the logged
    rate was the schedule's next value, not the one the step used. Hand values: warm-up 2 of a
    6-step cosine at peak 0.1: steps take 0.05, 0.1; resumed at peak 1.0 (x10) the third step
    takes 1.0 (lambda(2) = 1.0) and the fourth 0.853553."""
    def make(lr, betas=(0.9, 0.999), wd=0.0):
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        return Updater.adamw("policy", model, lr=lr, betas=betas, weight_decay=wd, total_steps=6, warmup_steps=2,
                             schedule="cosine")

    def step(up):
        up.model(torch.ones(1, 2)).sum().backward()
        up.step()
        up.zero_grad()
        return round(up.applied_lr, 6)

    up = make(0.1)
    assert up.applied_lr is None
    assert [step(up), step(up)] == [0.05, 0.1]
    state = up.state_dict()
    assert state["optimizer_settings"] == {"lr": 0.1, "betas": [0.9, 0.999], "weight_decay": 0.0}
    same = make(0.1)
    same.load_state_dict(state)
    assert same.apply_settings(state["optimizer_settings"]) == [] and step(same) == 0.1  # nothing changed
    new = make(1.0, betas=(0.5, 0.9), wd=0.01)
    new.load_state_dict(state)
    assert new.apply_settings(state["optimizer_settings"]) == [
        "lr 0.1 -> 1", "betas [0.9, 0.999] -> [0.5, 0.9]", "weight_decay 0.0 -> 0.01"]
    g = new.optimizer.param_groups[0]
    assert g["betas"] == (0.5, 0.9) and g["weight_decay"] == 0.01 and round(new.lr, 6) == 1.0
    assert [step(new), step(new)] == [1.0, 0.853553]
    # a monitor's scale_lr before the checkpoint stays applied under the new peak
    scaled = make(0.1)
    step(scaled)
    scaled.scale_lr(0.5)
    st = scaled.state_dict()
    again = make(0.2)
    again.load_state_dict(st)
    again.apply_settings(st["optimizer_settings"])
    assert round(again.lr, 6) == 0.1  # peak 0.2 x 0.5, lambda(1) = 1.0
    # a checkpoint from before the settings were saved: unchanged, as before
    old = make(1.0)
    old.load_state_dict({k: v for k, v in state.items() if k != "optimizer_settings"})
    assert old.apply_settings(None) == [] and round(old.lr, 6) == 0.1
