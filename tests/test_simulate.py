"""The discrete-event simulator on hand-checkable cases (issue 5)."""

import json
from pathlib import Path

import pytest

from conveyor.simulate import (
    Dist,
    RolloutSim,
    SimConfig,
    SyncSim,
    TrainerSim,
    calibrate,
    load_sim_config,
    simulate,
)


def _cfg(eta, steps=4, rollout_s=10.0, train_s=10.0, **kw):
    # one worker serving one request at a time; a 10-token response at 1 s per token = 10 s
    kw.setdefault("mode", "async")
    return SimConfig(
        eta=eta, steps=steps, batch_size=1, group_size=1, max_concurrent=64,
        rollout=RolloutSim(workers=1, max_batch_size=1, decode_base_s=rollout_s / 10, decode_per_seq_s=0.0,
                           prompt_tokens=Dist(kind="constant", value=5, integer=True),
                           response_tokens=Dist(kind="constant", value=10, integer=True)),
        trainer=TrainerSim(step_base_s=train_s, s_per_token=0.0), **kw,
    )


def test_synchronous_has_no_overlap():
    r = simulate(_cfg(0))
    assert r.wall_seconds == pytest.approx(4 * 20.0)  # 10 s rollout then 10 s update, 4 times
    assert r.step_seconds == pytest.approx([20.0] * 4)
    assert r.trainer_busy == pytest.approx(0.5)
    assert r.rollout_busy == pytest.approx(0.5)
    assert r.staleness == {0: 4}


def test_mode_sync_overrides_eta():
    assert simulate(_cfg(4, mode="sync")).wall_seconds == pytest.approx(80.0)
    assert simulate(_cfg(0, mode="one_step")).wall_seconds == pytest.approx(50.0)


def test_one_step_overlap_exact_times():
    # t=0-10 episode A, 10-20 B (capacity 2 at version 0); updates at 10-20 (A), 20-30 (B),
    # 30-40 (C, generated 20-30), 40-50 (D, generated 30-40)
    r = simulate(_cfg(1))
    assert r.wall_seconds == pytest.approx(50.0)
    assert r.step_seconds == pytest.approx([20.0, 10.0, 10.0, 10.0])
    assert r.staleness == {0: 1, 1: 3}
    assert r.trainer_busy == pytest.approx(40 / 50)


def test_staleness_never_exceeds_eta_and_more_eta_is_not_slower():
    walls = []
    for eta in (0, 1, 2, 4):
        cfg = SimConfig(
            eta=eta, steps=12, batch_size=4, group_size=2, max_concurrent=64,
            rollout=RolloutSim(max_batch_size=8, decode_base_s=0.01, decode_per_seq_s=0.001,
                               response_tokens=Dist(kind="lognormal", median=40, sigma=1.0, max=400, integer=True),
                               env_latency_s=Dist(kind="lognormal", median=0.5, sigma=1.0)),
            trainer=TrainerSim(step_base_s=0.5, s_per_token=0.001),
        )
        r = simulate(cfg)
        assert max(r.staleness) <= eta
        assert sum(r.staleness.values()) == 12 * 8
        walls.append(r.wall_seconds)
    assert walls[0] > walls[1] >= walls[-1] * 0.999


def test_batching_and_prefill_cost():
    # two requests decoded together: 10 steps of (1 + 2 * 0.5) s, plus a prefill of 2 x 5 tokens
    # at 0.1 s (each request its own: shared_prefill off), or of 5 tokens once (the group's prompt,
    # as conveyor's engine deduplicates identical prompts admitted together)
    cfg = SimConfig(
        eta=0, steps=1, batch_size=1, group_size=2,
        rollout=RolloutSim(max_batch_size=4, decode_base_s=1.0, decode_per_seq_s=0.5, prefill_s_per_token=0.1,
                           prompt_tokens=Dist(kind="constant", value=5, integer=True),
                           response_tokens=Dist(kind="constant", value=10, integer=True), shared_prefill=False),
        trainer=TrainerSim(step_base_s=1.0, s_per_token=0.01),
    )
    r = simulate(cfg)
    # rollout 1 + 20 = 21 s; update 1 + 0.01 * (2 x 15 tokens) = 1.3 s
    assert r.wall_seconds == pytest.approx(21.0 + 1.3)
    cfg.rollout.shared_prefill = True
    assert simulate(cfg).wall_seconds == pytest.approx(20.5 + 1.3)


def test_a_shared_prompt_is_cached_until_the_next_weight_update():
    """One request at a time (max_batch_size 1), groups of 2, prompt 5 tokens at 0.1 s a token,
    decode steps of 1.5 s, 10 tokens per response, eta 1. Episode A: A1 prefills 5 tokens
    (0.5 s) and decodes (15 s) -> 15.5; A2 finds the prompt cached: no prefill (it joins the
    batch, whose decode step runs its last prompt token) + 15 s -> 30.5; update 1 (1.3 s) runs
    30.5 -> 31.8. Episode B: B1 prefills 5 tokens (-> 31.0) and decodes 8 tokens (-> 43.0),
    crossing the update: re-encoded (5 + 8 tokens, 1.3 s -> 44.3), 2 more tokens (-> 47.3); B2's
    prompt was cached with version 0's weights, emptied by the update: 5 tokens again (-> 47.8)
    + 15 s -> 62.8; update 2 -> 64.1."""
    cfg = SimConfig(
        eta=1, steps=2, batch_size=1, group_size=2,
        rollout=RolloutSim(max_batch_size=1, decode_base_s=1.0, decode_per_seq_s=0.5, prefill_s_per_token=0.1,
                           prompt_tokens=Dist(kind="constant", value=5, integer=True),
                           response_tokens=Dist(kind="constant", value=10, integer=True)),
        trainer=TrainerSim(step_base_s=1.0, s_per_token=0.01),
    )
    r = simulate(cfg)
    assert r.wall_seconds == pytest.approx(64.1)
    assert r.step_seconds == pytest.approx([30.5 + 1.3, 64.1 - 31.8])


def test_a_reencode_runs_a_prompt_its_rows_share_once():
    """As above with max_batch_size 2: a group's two responses decode together and a weight update
    interrupts both; the re-encode runs their shared 5-token prompt once (0.5 s) and each row's
    response so far, as the engine does with its prefix cache. Re-encoding each row whole (the
    simulator before 2026-12-06) took 0.5 s more: 44.9 s."""
    cfg = SimConfig(
        eta=1, steps=2, batch_size=1, group_size=2,
        rollout=RolloutSim(max_batch_size=2, decode_base_s=1.0, decode_per_seq_s=0.5, prefill_s_per_token=0.1,
                           prompt_tokens=Dist(kind="constant", value=5, integer=True),
                           response_tokens=Dist(kind="constant", value=10, integer=True)),
        trainer=TrainerSim(step_base_s=1.0, s_per_token=0.01),
    )
    r = simulate(cfg)
    assert r.wall_seconds == pytest.approx(44.4)
    assert r.step_seconds == pytest.approx([21.8, 44.4 - 21.8])


def test_env_latency_and_weight_sync():
    cfg = _cfg(0, steps=2)
    cfg.rollout.env_latency_s = Dist(kind="constant", value=3.0)
    cfg.sync = SyncSim(seconds=2.0)
    r = simulate(cfg)
    assert r.wall_seconds == pytest.approx(2 * (10 + 3 + 10 + 2))


def test_dedicated_proximal_pool_vs_recompute_in_trainer():
    base = _cfg(0, steps=2)
    base.proximal.s_per_token = 0.2  # 15 tokens -> 3 s
    inline = simulate(base).wall_seconds
    assert inline == pytest.approx(2 * (10 + 10 + 3))
    base.proximal.devices = 1
    r = simulate(base)
    assert r.wall_seconds == pytest.approx(2 * (10 + 3 + 10))
    assert r.proximal_busy == pytest.approx(6 / r.wall_seconds)


def test_sync_mode_speedup_applies_only_at_eta_zero():
    c = _cfg(0)
    c.trainer.sync_mode_speedup = 2.0
    assert simulate(c).wall_seconds == pytest.approx(4 * 15.0)
    c1 = _cfg(1)
    c1.trainer.sync_mode_speedup = 2.0
    assert simulate(c1).wall_seconds == pytest.approx(50.0)


def test_dist_validation_and_draws():
    import random

    rng = random.Random(0)
    assert Dist(kind="constant", value=3.4, integer=True).draw(rng) == 3.0
    assert Dist(kind="lognormal", median=100, sigma=2, max=50).draw(rng) <= 50
    assert Dist(kind="empirical", values=[7]).draw(rng) == 7
    assert Dist(kind="lognormal", median=2.0, sigma=0.0).mean() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="values"):
        Dist(kind="empirical")
    with pytest.raises(ValueError):
        SimConfig(eta=-1)


def _fake_run(tmp_path, base=0.02, per_seq=0.003, t0=1.5, per_tok=0.004):
    conf = {"async": {"eta": 2}, "trainer": {"batch_size": 2}, "rollout": {"group_size": 2, "max_concurrent": 16, "max_batch_size": 8},
            "run": {"seed": 0}}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    prof = {str(b): [10 * b, 10 * b * (base + per_seq * b)] for b in (1, 2, 4, 8)}
    (tmp_path / "engine_stats.json").write_text(json.dumps({"decode_profile": prof, "prefill_seconds": 2.0, "prefill_tokens": 1000}))
    lines, metrics = [], []
    for step in range(1, 6):
        groups = [{"group": f"g{step}{i}", "lengths": [[20, 30 + step], [20, 40]], "env_seconds": [0.0, 0.0]} for i in range(2)]
        lines.append(json.dumps({"step": step, "groups": groups}))
        resp = sum(30 + step + 40 for _ in range(2))
        tokens = resp + 4 * 20
        metrics.append(json.dumps({"step": step, "train/tokens": resp, "time/train_step_s": t0 + per_tok * tokens, "time/weight_sync_s": 0.1}))
    (tmp_path / "trained.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "metrics.jsonl").write_text("\n".join(metrics) + "\n")


def test_calibrate_recovers_the_trace(tmp_path):
    _fake_run(tmp_path)
    c = calibrate(tmp_path)
    assert c.rollout.decode_base_s == pytest.approx(0.02)
    assert c.rollout.decode_per_seq_s == pytest.approx(0.003)
    assert c.rollout.prefill_s_per_token == pytest.approx(0.002)
    assert c.trainer.step_base_s == pytest.approx(1.5)
    assert c.trainer.s_per_token == pytest.approx(0.004)
    assert c.sync.seconds == pytest.approx(0.1)
    assert c.eta == 2 and c.steps == 5 and c.batch_size == 2 and c.group_size == 2
    assert sorted(set(c.rollout.response_tokens.values)) == [31, 32, 33, 34, 35, 40]
    assert simulate(c).wall_seconds > 0


def test_calibrate_takes_the_bound_the_run_trained_under(tmp_path):
    """Fresh-user finding: an adaptive run that trained at eta 4 (config.json's async.eta 2) was
    simulated at eta 2. The rows' staleness/eta (the bound in force) decide: the value in force for
    the most updates (ties: the later), NaN = unbounded; the CLI says when it differs."""
    from typer.testing import CliRunner

    from conveyor.cli import app
    from conveyor.simulate import trace_eta

    assert trace_eta([{"staleness/eta": 2.0}] * 3, 2) == (2, None)
    assert trace_eta([{}], 3) == (3, None)  # a run from before the metric
    eta, note = trace_eta([{"staleness/eta": v} for v in (2.0, 3.0, 4.0, 4.0, 4.0)], 2)
    assert eta == 4 and note == ("the run trained at eta 2 for 1, 3 for 1, 4 for 3 of its 5 updates (config.json's "
                                 "async.eta: 2); simulating eta 4, the bound in force longest")
    assert trace_eta([{"staleness/eta": v} for v in (2.0, 2.0, 1.0, 1.0)], 2)[0] == 1  # a tie: the later
    assert trace_eta([{"staleness/eta": float("nan")}], None) == (None, None)
    _fake_run(tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r, eta in zip(rows, (2, 3, 4, 4, 4), strict=True):
        r["staleness/eta"] = float(eta)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert calibrate(tmp_path).eta == 4
    r = CliRunner().invoke(app, ["simulate", str(tmp_path), "--modes", "async"])
    assert r.exit_code == 0 and "simulating eta 4, the bound in force longest" in " ".join(r.output.split()), r.output


def test_calibrate_names_the_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        calibrate(tmp_path)


def test_load_sim_config_with_overrides(tmp_path):
    p = tmp_path / "sim.yaml"
    p.write_text("eta: 1\nrollout:\n  workers: 2\n")
    c = load_sim_config(p, ["eta=4", "rollout.workers=64", "trainer.devices=32"])
    assert (c.eta, c.rollout.workers, c.trainer.devices) == (4, 64, 32)
    p.write_text("eta: 1\nrollout:\n  wrokers: 2\n")
    with pytest.raises(ValueError, match="wrokers"):
        load_sim_config(p)


def test_cli_simulate_modes_sweep_and_calibration(tmp_path):
    from typer.testing import CliRunner

    from conveyor.cli import app

    p = tmp_path / "sim.yaml"
    SimConfigDump = _cfg(2).model_dump()
    import yaml

    p.write_text(yaml.safe_dump(SimConfigDump))
    out = tmp_path / "pred.json"
    r = CliRunner().invoke(app, ["simulate", str(p), "steps=4", "--sweep", "trainer.step_base_s=10,20", "--output", str(out)])
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())
    assert [(x["variant"], x["mode"]) for x in rows] == [
        ("trainer.step_base_s=10", "sync"), ("trainer.step_base_s=10", "one_step"), ("trainer.step_base_s=10", "async"),
        ("trainer.step_base_s=20", "sync"), ("trainer.step_base_s=20", "one_step"), ("trainer.step_base_s=20", "async"),
    ]
    assert rows[0]["wall_seconds"] == pytest.approx(80.0) and rows[3]["wall_seconds"] == pytest.approx(120.0)
    run = tmp_path / "run"
    run.mkdir()
    _fake_run(run)
    w = tmp_path / "cal.yaml"
    r = CliRunner().invoke(app, ["simulate", str(run), "eta=4", "--modes", "async", "--write-config", str(w)])
    assert r.exit_code == 0, r.output
    assert load_sim_config(w).eta == 4
    r = CliRunner().invoke(app, ["simulate", str(p), "--sweep", "nosuch=1,2"])
    assert r.exit_code == 2 and "nosuch" in r.output


def test_work_in_flight_at_the_end_counts_only_up_to_the_end():
    """A new-user trial printed "R idle -0.02": a decode step was added to the worker's busy time
    in full when it started, also when the run ended (last publication) in the middle of it.
    Here the worker is busy from 0 to the end (21 s); episode C's first 8-token step (20-28 s)
    is cut at 21 s, so the worker is busy exactly 100%, not 28 / 21."""
    r = simulate(_cfg(4, steps=2, rollout_s=10.0, train_s=1.0))
    assert r.wall_seconds == pytest.approx(21.0)
    assert r.rollout_busy == 1.0 and r.summary()["rollout_idle"] == 0.0
    assert r.trainer_busy == pytest.approx(2 / 21)


def test_busy_fractions_are_fractions_on_random_pipelines():
    import random

    for seed in range(12):
        rng = random.Random(seed)
        cfg = SimConfig(
            eta=rng.choice([0, 1, 2, 4, None]), steps=rng.randint(1, 5), batch_size=rng.randint(1, 4),
            group_size=rng.randint(1, 4), seed=seed,
            rollout=RolloutSim(workers=rng.randint(1, 3), max_batch_size=8, decode_base_s=0.01, decode_per_seq_s=0.001,
                               max_jump_steps=rng.choice([1, 8, 64]), prefill_s_per_token=rng.choice([0.0, 1e-4]),
                               response_tokens=Dist(kind="lognormal", median=40, sigma=1.0, max=400, integer=True),
                               env_latency_s=Dist(kind="lognormal", median=0.05, sigma=1.0)),
            trainer=TrainerSim(step_base_s=0.05, s_per_token=1e-4), sync=SyncSim(seconds=rng.choice([0.0, 0.1])),
        )
        cfg.proximal.devices, cfg.proximal.s_per_token = rng.choice([0, 1, 3]), rng.choice([0.0, 1e-3])
        s = simulate(cfg).summary()
        for k in ("trainer_busy", "trainer_idle", "rollout_busy", "rollout_idle", "proximal_busy"):
            assert 0.0 <= s[k] <= 1.0, (seed, k, s[k])


def test_cli_simulate_table_is_not_squeezed_when_piped(tmp_path, monkeypatch):
    """Piped (not a terminal), rich wrapped the table at 80 columns: "one_…", "traj…"."""
    import yaml
    from typer.testing import CliRunner

    from conveyor.cli import app

    monkeypatch.delenv("COLUMNS", raising=False)
    p = tmp_path / "sim.yaml"
    p.write_text(yaml.safe_dump(_cfg(2).model_dump()))
    r = CliRunner().invoke(app, ["simulate", str(p), "--sweep", "trainer.step_base_s=10,20"])
    assert r.exit_code == 0, r.output
    assert "…" not in r.output
    rows = [line for line in r.output.splitlines() if "one_step" in line]
    assert len(rows) == 2 and all("trainer.step_base_s=" in line and "traj" not in line for line in rows)
    assert "traj/s" in r.output and "speed-up over the sync row of the same variant" in r.output


def test_group_mates_follow_their_prompt_to_one_worker():
    """Two workers, one group of 4 sharing a 10-token prompt at 0.1 s a token, decode steps of
    1 s (per-sequence cost 0). With ``shared_prefill`` (and its routing affinity) all 4 go to one
    worker, which prefills the prompt once: 1 s + 5 s, 6 worker-seconds busy (routed by load
    alone the group would split 2 + 2 and each worker would prefill it: 12 worker-seconds, the
    same wall-clock; only the busy time tells). Without: 2 + 2 requests, each paying its own
    prefill, 2 s + 5 s per worker."""
    def cfg(shared):
        return SimConfig(
            eta=0, steps=1, batch_size=1, group_size=4,
            rollout=RolloutSim(workers=2, max_batch_size=8, decode_base_s=1.0, decode_per_seq_s=0.0,
                               prefill_s_per_token=0.1, shared_prefill=shared,
                               prompt_tokens=Dist(kind="constant", value=10, integer=True),
                               response_tokens=Dist(kind="constant", value=5, integer=True)),
            trainer=TrainerSim(step_base_s=1.0, s_per_token=0.0),
        )
    together, split = simulate(cfg(True)), simulate(cfg(False))
    # affinity: one worker, 1 s prefill + 5 s decode, the other idle; no affinity, no sharing:
    # each worker 2 requests, 2 prompts of 10 tokens = 2 s prefill + 5 s decode
    assert together.wall_seconds == pytest.approx(1 + 5 + 1)
    assert split.wall_seconds == pytest.approx(2 + 5 + 1)
    assert together.rollout_busy * together.wall_seconds * 2 == pytest.approx(6.0)


def test_cli_simulate_config_errors_are_formatted_like_train(tmp_path):
    """A fresh-user trial: `conveyor simulate RUN foo.bar=3`, `--sweep eta=a,b` and `eta=-1` printed
    pydantic's raw "1 validation error for SimConfig ... https://errors.pydantic.dev/...". They are
    formatted by conveyor.config.format_validation_error, as `conveyor train`'s config errors."""
    import yaml
    from typer.testing import CliRunner

    from conveyor.cli import app

    p = tmp_path / "sim.yaml"
    p.write_text(yaml.safe_dump(_cfg(2).model_dump()))
    run = tmp_path / "run"
    run.mkdir()
    _fake_run(run)

    def fails(*args: str) -> str:
        r = CliRunner().invoke(app, ["simulate", *args])
        assert r.exit_code == 2, r.output
        assert "validation error for" not in r.output and "errors.pydantic.dev" not in r.output, r.output
        assert "Traceback" not in r.output
        return " ".join(r.output.split())  # rich wraps the lines

    out = fails(str(run), "foo.bar=3")
    assert f"invalid simulator config (calibrated from {run} + foo.bar=3): foo: unknown key (got {{'bar': 3}})" in out
    out = fails(str(p), "eta=-1")
    assert f"invalid simulator config ({p} + eta=-1): eta: Input should be greater than or equal to 0 (got -1)" in out
    out = fails(str(p), "--sweep", "eta=a,b")
    assert "invalid simulator config (--sweep eta=a): eta: Input should be a valid integer" in out and "(got 'a')" in out
    assert "has an empty key" in fails(str(p), "=3")
    assert "the config file must come before the overrides (conveyor simulate other.yaml eta=4)" in fails(
        str(p), "eta=4", "other.yaml")
    # fresh-user trial 5: a training config gave a list of "unknown key" lines
    out = fails(str(Path(__file__).resolve().parents[1] / "configs" / "sao.yaml"))
    assert "is a `conveyor train` config (sections critic, loss), not a simulator config" in out
    assert "configs/simulate/" in out and "unknown key" not in out


def test_a_critic_warm_up_is_simulated_before_the_updates_and_calibrated(tmp_path):
    """Fresh-user trial 4, finding 6: `conveyor simulate` of an SAO run left its critic warm-up
    out (predicted 1.5 s for a run of 11 s, 40 warm-up steps). Warm-up steps now take a batch of
    the initial policy's rollouts and their own step time each, publish nothing (no staleness),
    and count as versions for admission; calibrate fits them from critic_warmup.jsonl."""
    base = SimConfig(steps=3, batch_size=2, group_size=2, trainer=TrainerSim(step_base_s=1.0, s_per_token=0.0))
    warm = base.model_copy(update={"critic_warmup_steps": 4, "trainer": TrainerSim(
        step_base_s=1.0, s_per_token=0.0, warmup_step_base_s=10.0)})
    a, b = simulate(base), simulate(warm)
    assert b.extra["warmup_seconds"] >= 40.0 and "warmup_seconds" not in a.extra
    assert b.wall_seconds == pytest.approx(b.extra["warmup_seconds"] + sum(b.step_seconds))
    assert b.wall_seconds > a.wall_seconds + 35.0
    assert sum(b.staleness.values()) == 3 * 4 and b.dropped_stale == 0  # only policy updates are trained
    assert len(b.step_seconds) == 3 and max(b.step_seconds) < 10.0  # the rollouts ran during the warm-up
    # calibration: warm-up rows of 2.0 + 0.01 s per token (tokens: response + prompts, as the updates')
    _fake_run(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf.update(loss={"advantage": "gae"}, critic={"warmup_steps": 3})
    (tmp_path / "config.json").write_text(json.dumps(conf))
    rows = [{"step": -2 + i, "train/tokens": r, "time/critic_warmup_step_s": 2.0 + 0.01 * (r + 4 * 20)}
            for i, r in enumerate((100, 140, 180))]
    (tmp_path / "critic_warmup.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = calibrate(tmp_path)
    assert c.critic_warmup_steps == 3
    assert c.trainer.warmup_step_base_s == pytest.approx(2.0) and c.trainer.warmup_s_per_token == pytest.approx(0.01)
    assert simulate(c).extra["warmup_seconds"] > 6.0
    (tmp_path / "critic_warmup.jsonl").unlink()  # no timed row: said, at no cost
    notes: list[str] = []
    assert calibrate(tmp_path, notes).trainer.warmup_step_base_s == 0.0
    assert any("critic.warmup_steps=3 but" in n and "simulated at no cost" in n for n in notes)


def test_calibrate_says_why_engine_stats_are_missing(tmp_path):
    """Fresh-user trial 4, finding 8: a killed or still-running run was called "not a run
    directory written by conveyor train"; now the message says which, and what to do."""
    from conveyor.runtime_files import RunLock

    _fake_run(tmp_path)
    (tmp_path / "engine_stats.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"ended without writing it \(killed, e\.g\. by SIGKILL"):
        calibrate(tmp_path)
    with RunLock(tmp_path), pytest.raises(FileNotFoundError, match=r"the run is being trained now by process \d+"):
        calibrate(tmp_path)


def test_cli_simulate_says_the_wall_includes_the_warm_up(tmp_path):
    from typer.testing import CliRunner

    from conveyor.cli import app

    p = tmp_path / "sim.yaml"
    p.write_text("steps: 2\nbatch_size: 1\ngroup_size: 2\ncritic_warmup_steps: 3\ntrainer:\n  warmup_step_base_s: 5\n")
    r = CliRunner().invoke(app, ["simulate", str(p), "--modes", "sync,async", "--output", str(tmp_path / "o.json")])
    assert r.exit_code == 0, r.output
    assert "wall s includes the critic warm-up (3 critic-only steps first" in " ".join(r.output.split())
    rows = json.loads((tmp_path / "o.json").read_text())
    assert all(row["warmup_seconds"] >= 15.0 and row["critic_warmup_steps"] == 3 for row in rows)
