"""Self-steering (issue 13 sections 2-3): the adaptive controller moves eta through the callbacks,
monitor alerts become events and actions."""

from __future__ import annotations

from conveyor.rollout.adaptive import AsyncRatioController
from conveyor.runtime.monitor import MonitorSettings, RunMonitor
from conveyor.runtime.steering import RunSteering


def make(monitor=None, controller=None, eta=2):
    log = {"eta": [], "lr": [], "stop": 0, "events": [], "say": []}
    s = RunSteering(monitor, controller, eta, set_eta=log["eta"].append, scale_lr=log["lr"].append,
                    request_stop=lambda: log.__setitem__("stop", log["stop"] + 1),
                    event=lambda name, **kw: log["events"].append((name, kw)), say=log["say"].append, lr_scale=0.5)
    return s, log


def test_adaptive_controller_moves_eta_with_the_reward_variance():
    # eta_max 4, base 0.7 -> eta 2; step 0.1: variances 0.2, 0.2 (above 0.15) -> 0.6, 0.5 (eta 2, 2);
    # then 0.05 x 3 -> 0.6, 0.7, 0.8 -> eta 3 at the third
    s, log = make(controller=AsyncRatioController(eta_max=4))
    high = [0.0, 1.0]  # population variance 0.25
    low = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # 0.09
    for step, rewards in enumerate([high, high, low, low, low], 1):
        s.after_step(step, {}, rewards)
    assert log["eta"] == [3] and s.eta == 3
    (name, ev), = [e for e in log["events"] if e[0] == "eta_change"]
    assert ev["old_eta"] == 2 and ev["new_eta"] == 3 and ev["version"] == 5 and "<= threshold" in ev["reason"]
    # many high-variance batches: down to ratio 0.1 -> eta 0 (synchronous)
    for step in range(6, 20):
        s.after_step(step, {}, high)
    assert s.eta == 0 and log["eta"][-1] == 0


def test_monitor_actions_lower_eta_scale_lr_and_stop():
    settings = MonitorSettings(actions={"staleness_pinned": "lower_eta", "reward_failures": "scale_lr",
                                        "nonfinite": "stop"}, pinned_steps=2)
    s, log = make(monitor=RunMonitor(settings), eta=2)
    s.after_step(1, {"staleness/mean": 2.0}, [])
    s.after_step(2, {"staleness/mean": 2.0}, [])
    assert log["eta"] == [1] and s.eta == 1 and s.monitor.eta == 1
    s.after_step(3, {"rollout/reward_failed_share": 0.9}, [])
    assert log["lr"] == [0.5] and any(e[0] == "lr_scaled" for e in log["events"])
    s.after_step(4, {"train/skipped_nonfinite": 1.0}, [])
    s.after_step(5, {"train/skipped_nonfinite": 1.0}, [])
    assert log["stop"] == 1 and s.stopped_by == "monitor rule nonfinite"
    alerts = [e for e in log["events"] if e[0] == "alert"]
    assert [a[1]["rule"] for a in alerts] == ["staleness_pinned", "reward_failures", "nonfinite"]
    assert all(a[1]["level"] == "action" for a in alerts) and len(log["say"]) >= 3


def test_plateau_after_eval_and_state_round_trip():
    s, log = make(monitor=RunMonitor(), controller=AsyncRatioController(eta_max=4))
    for i, v in enumerate([0.5, 0.6, 0.62, 0.63, 0.64], 1):
        s.after_eval(10 * i, v)
    assert [e[1]["rule"] for e in log["events"] if e[0] == "alert"] == ["plateau"]
    s.after_step(1, {}, [0.0, 1.0])
    state = s.state_dict()
    t, _ = make(monitor=RunMonitor(), controller=AsyncRatioController(eta_max=4))
    t.load_state_dict(state)
    assert t.controller.ratio == s.controller.ratio and t.monitor.evals == s.monitor.evals and t.eta == s.eta


def test_changed_settings_keep_the_configured_eta():
    """A checkpoint's eta and controller are restored only under the settings it was saved with
    (fresh-user finding: a resume with async.eta=1 trained at the checkpoint's eta 3)."""
    s, _ = make(controller=AsyncRatioController(eta_max=4), eta=3)
    s.settings = {"adaptive": True, "eta_max": 4}
    s.controller.update(0.0)
    state = s.state_dict()
    same, _ = make(controller=AsyncRatioController(eta_max=4), eta=2)
    same.settings = {"adaptive": True, "eta_max": 4}
    same.load_state_dict(state)
    assert same.eta == 3 and same.controller.n_updates == 1
    fixed, _ = make(eta=1)
    fixed.settings = {"adaptive": False, "eta": 1}
    assert fixed.changed_settings(state) == ["adaptive", "eta", "eta_max"]
    fixed.load_state_dict(state)
    assert fixed.eta == 1
    old = {k: v for k, v in state.items() if k != "settings"}  # a checkpoint from before: restored as then
    legacy, _ = make(eta=1)
    legacy.load_state_dict(old)
    assert legacy.eta == 3


def test_adaptive_eta_in_a_run_and_across_a_resume(tmp_path):
    """A tiny run with async.adaptive: the start eta floor(0.7 x 4) = 2 replaces async.eta = 0,
    every change is an event with its reason, and the controller's state and eta survive a
    resume (the tiny model's rewards are all 0: variance 0 <= threshold, the ratio rises 0.1 a
    step: 0.8 -> eta 3, 0.9 -> 3, then after the resume 1.0 -> 4)."""
    import json

    import torch

    from conveyor.config import load_config
    from conveyor.train import load_run_config, run_training

    run = tmp_path / "r"
    base = ["model.name=tiny", "trainer.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
            "run.progress=false", "run.export=false", "reward.workers=1", "rollout.tool=none", "data.heldout=",
            "async.eta=0", "async.adaptive=true", "async.eta_max=4", f"run.dir={run}", "run.checkpoint_every=1"]
    assert run_training(load_config(None, [*base, "trainer.total_steps=2"])).steps == 2

    def eta_changes():
        events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
        return [(e["old_eta"], e["new_eta"], e["reason"]) for e in events if e["event"] == "eta_change"]

    ch = eta_changes()
    assert [(o, n) for o, n, _ in ch] == [(0, 2), (2, 3)]
    assert "adaptive" in ch[0][2] and "<= threshold" in ch[1][2]

    def steering():
        ckpt = max((run / "checkpoints").iterdir(), key=lambda p: p.name)
        return torch.load(ckpt / "state.pt", weights_only=False)["controller"]["runtime"]["steering"]

    st = steering()
    assert st["eta"] == 3 and st["controller"]["n_updates"] == 2
    summary = json.loads((run / "summary.json").read_text())  # the bound in force, not async.eta
    assert (summary["eta"], summary["eta_configured"], summary["eta_adaptive"]) == (3, 0, True)
    assert run_training(load_run_config(run, ["trainer.total_steps=3"]), resume_dir=run).steps == 3
    ch = eta_changes()
    assert (0, 3, "resumed") in ch and ch[-1][:2] == (3, 4)  # continued from the checkpoint, not restarted
    assert steering()["controller"]["n_updates"] == 3
    # a resume that asks for a fixed bound gets it: the checkpoint's eta 4 and controller are not restored
    assert run_training(load_run_config(run, ["trainer.total_steps=4", "async.adaptive=false", "async.eta=1"]),
                        resume_dir=run).steps == 4
    st = steering()
    assert st["eta"] == 1 and st["controller"] is None and st["settings"] == {"adaptive": False, "eta": 1}
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    reset, = [e for e in events if e["event"] == "steering_reset"]
    # the resume event keeps what the versions before ran with (config.json now has the new values)
    changed = [e for e in events if e["event"] == "resume"][-1]["changed"]
    assert changed["async.adaptive"] == {"old": True, "new": False} and changed["async.eta"] == {"old": 0, "new": 1}
    assert changed["trainer.total_steps"] == {"old": 3, "new": 4} and "model.name" not in changed
    assert reset["checkpoint_eta"] == 4 and reset["new_eta"] == 1 and "async.adaptive" in reset["changed"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eta"] == 1
    # the report draws the eta steps and alert markers (plot_report raises here, unlike at the run's end)
    from conveyor.runlog import plot_report

    with (run / "events.jsonl").open("a") as f:  # an alert as the runtime writes it
        f.write(json.dumps({"event": "alert", "version": 2, "rule": "plateau", "level": "warning",
                            "action": "none", "message": "m"}) + "\n")
    assert plot_report(run).stat().st_size > 10_000


def test_a_monitor_stop_ends_the_run_like_a_first_ctrl_c(tmp_path):
    """Fresh-user finding: after a rule's stop action the run still evaluated and exported as a
    finished run, summary.json said interrupted false and the console gave no resume hint. It now
    ends as a first Ctrl-C does (checkpoint, no after-evaluation), with the reason recorded."""
    import json

    from typer.testing import CliRunner

    from conveyor.cli import app

    run = tmp_path / "r"
    r = CliRunner().invoke(app, [
        "train", "model.name=tiny", "trainer.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
        "run.progress=false", "reward.workers=1", "rollout.tool=none", "data.heldout_limit=2",
        "trainer.total_steps=4", "reward.fn=conveyor.rewards.faults:chaos_reward", "reward.timeout_s=1",
        "reward.check_at_start=false",  # it fails on purpose, from the first call
        "monitor.actions.reward_failures=stop", f"run.dir={run}"])
    assert r.exit_code == 3, r.output  # not 0 (it did not finish), not 130 (no SIGINT)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["stop_reason"] == "monitor rule reward_failures"
    assert summary["steps"] < 4 and summary["heldout_after"] is None and not (run / "eval_after.json").exists()
    assert (f"stopped early by monitor rule reward_failures's stop action; continue with: conveyor train --resume {run}"
            in " ".join(r.output.split()))
    assert any((run / "checkpoints").iterdir())  # it can be resumed
    export = json.loads((run / "export" / "conveyor.json").read_text()) if (run / "export").exists() else None
    assert export is None or export["interrupted"] is True
