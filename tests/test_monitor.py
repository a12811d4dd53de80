"""The run monitor's rules (issue 13 section 3): hand-checked sequences, one alert per episode,
actions and settings errors."""

from __future__ import annotations

import pytest

from conveyor.runtime.monitor import MonitorSettings, RunMonitor, plateau


def test_plateau_rule_the_issues_examples():
    assert plateau([0.50, 0.60, 0.62, 0.63, 0.64])
    assert not plateau([0.50, 0.60, 0.62, 0.63])  # only two small steps so far
    assert not plateau([0.50, 0.52, 0.60, 0.61, 0.62])
    m = RunMonitor()
    fired = [bool(m.on_eval(10 * i, v)) for i, v in enumerate([0.50, 0.60, 0.62, 0.63, 0.64], 1)]
    assert fired == [False, False, False, False, True]
    assert m.alerts[0].rule == "plateau" and m.alerts[0].step == 50 and "0.640" in m.alerts[0].message
    m = RunMonitor()
    assert not any(m.on_eval(i, v) for i, v in enumerate([0.50, 0.52, 0.60, 0.61, 0.62]))
    # exactly 5% counts as improving; a rise from 0 too; a fall from 0 does not
    assert not plateau([1.0, 1.05, 1.1025, 1.157625])
    assert not plateau([0.0, 0.1, 0.1, 0.1]) and plateau([0.0, 0.0, 0.0, 0.0])


def test_step_rules_fire_once_per_episode_with_their_action():
    m = RunMonitor(MonitorSettings(actions={"nonfinite": "stop", "staleness_pinned": "lower_eta"}), eta=2)
    rows = [{"train/skipped_nonfinite": 1.0}, {"train/skipped_nonfinite": 1.0}, {"train/skipped_nonfinite": 1.0},
            {"train/skipped_nonfinite": 0.0}, {"train/skipped_nonfinite": 1.0}, {"train/skipped_nonfinite": 1.0}]
    fired = [[a.rule for a in m.on_step(i, r)] for i, r in enumerate(rows, 1)]
    assert fired == [[], ["nonfinite"], [], [], [], ["nonfinite"]]  # re-armed by the finite step
    assert m.alerts[0].action == "stop" and m.alerts[0].level == "action"
    # staleness pinned: mean >= 0.9 x 2 = 1.8 for 5 steps
    m = RunMonitor(MonitorSettings(actions={"staleness_pinned": "lower_eta"}), eta=2)
    out = [m.on_step(i, {"staleness/mean": 1.9}) for i in range(1, 6)]
    assert [len(x) for x in out] == [0, 0, 0, 0, 1] and out[-1][0].action == "lower_eta"
    m = RunMonitor(eta=0)  # synchronous: never pinned
    assert not any(m.on_step(i, {"staleness/mean": 0.0}) for i in range(10))


def test_keep_rate_and_reward_failure_rules():
    m = RunMonitor(MonitorSettings(keep_rate_min=0.9))
    assert m.on_step(1, {"loss/discrepancy_keep_frac": 0.95}) == []
    (a,) = m.on_step(2, {"loss/discrepancy_keep_frac": 0.85})
    assert a.rule == "keep_rate" and a.level == "warning" and a.values["keep_rate"] == 0.85
    assert m.on_step(3, {"proximal/ewma_keep_rate": 0.1}) == []  # still the same episode
    (a,) = m.on_step(4, {"rollout/reward_failed_share": 0.5})
    assert a.rule == "reward_failures" and "50%" in a.message
    assert m.on_step(5, {"rollout/reward_failed_share": 0.2}) == []  # not above the share


def test_settings_errors_name_the_key():
    with pytest.raises(ValueError, match="unknown rule 'plato'"):
        MonitorSettings(actions={"plato": "stop"})
    with pytest.raises(ValueError, match="monitor.actions.plateau: unknown action 'panic'"):
        MonitorSettings(actions={"plateau": "panic"})
    with pytest.raises(ValueError, match="monitor.lr_scale"):
        MonitorSettings(lr_scale=2.0)


@pytest.mark.parametrize("overrides, message", [
    (["monitor.actions.plateau=stop"], "monitor.actions.plateau=stop can never fire: the plateau rule reads the "
                                       "periodic held-out evaluations and run.eval_every is not set"),
    (["monitor.actions.plateau=stop", "run.eval_every=5", "data.heldout="], "and data.heldout is empty"),
    (["monitor.actions.keep_rate=lower_eta"], "monitor.actions.keep_rate=lower_eta can never fire: the discrepancy "
                                              "keep-rate is measured by loss.name=two_ratio or proximal.method=ewma"),
    (["monitor.actions.nonfinite=stop", "monitor.enabled=false"], "with monitor.enabled=false: no rule is evaluated"),
    (["async.adaptive=true", "async.eta_max=0"], "async.adaptive=true with async.eta_max=0"),
])
def test_actions_that_cannot_fire_are_refused(overrides, message):
    """Fresh-user finding: these were accepted and the run went on as if they were armed."""
    from conveyor.config import ConfigError, load_config

    with pytest.raises((ValueError, ConfigError)) as e:
        load_config(None, overrides)
    assert message in " ".join(str(e.value).split())


def test_actions_that_can_fire_are_accepted():
    from conveyor.config import load_config

    for overrides in (["monitor.actions.plateau=stop", "run.eval_every=5"], ["monitor.actions.keep_rate=stop",
                      "loss.name=two_ratio"], ["monitor.actions.keep_rate=scale_lr", "proximal.method=ewma"],
                      ["monitor.actions.plateau=none"], ["async.adaptive=true", "async.eta_max=1"]):
        load_config(None, overrides)
