"""Crash, resume and the run directory's logs (issue 10, section 2), with real processes:
kill -9 of a running `conveyor train`, a second process refused by the run-directory lock, the
resume that supersedes what the killed process logged after its checkpoint, and the resume of a
finished run that changes nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from conveyor.checkpoint import checkpoint_version, latest_checkpoint
from conveyor.config import load_config
from conveyor.runlog import read_jsonl
from conveyor.train import load_run_config, run_training

FAST = [
    "model.name=tiny",
    "trainer.batch_size=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "run.progress=false",
    "run.export=false",
    "reward.workers=1",
    "rollout.tool=none",
    "trainer.num_threads=1",
    "rollout.engine_threads=1",
    "reward.fn=format",
]
ROOT = Path(__file__).resolve().parents[1]


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    """`conveyor train ARGS` in its own session (so kill -9 can reach its reward workers too)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "conveyor.cli", "train", *args],
        cwd=ROOT,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _wait(
    cond, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None
):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"process exited ({proc.returncode}) while waiting for {what}:\n"
                + (log.read_text()[-3000:] if log else "")
            )
        time.sleep(0.2)
    raise AssertionError(
        f"timed out waiting for {what}" + (f":\n{log.read_text()[-3000:]}" if log else "")
    )


def _steps(path: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(path)]


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)


def test_kill9_lock_and_resume_leave_each_step_once_in_every_log(tmp_path):
    run = tmp_path / "r"
    first_log = tmp_path / "first.log"
    first = _spawn(
        FAST
        + [
            "trainer.total_steps=500",
            "run.checkpoint_every=2",
            f"run.dir={run}",
            "run.eval_before=false",
            "run.eval_after=false",
        ],
        first_log,
    )
    try:
        # 1. a second process on the same run directory is refused while the first is alive
        _wait(lambda: (run / "metrics.jsonl").is_file(), 180, "the first step", first, first_log)
        second_log = tmp_path / "second.log"
        second = _spawn(["--resume", str(run)], second_log)
        assert second.wait(120) == 2, second_log.read_text()
        out = " ".join(second_log.read_text().split())
        assert f"in use by process {first.pid}" in out, out
        assert first.poll() is None  # the refused process did not disturb the first

        # 2. kill -9 after a checkpoint, once rows past it were logged
        def past_checkpoint():
            ck = latest_checkpoint(run)
            steps = _steps(run / "metrics.jsonl")
            return ck is not None and steps and max(steps) > checkpoint_version(ck) + 1 and ck

        _wait(past_checkpoint, 240, "a checkpoint and two steps after it", first, first_log)
    finally:
        _kill_group(first)  # SIGKILL: no handler runs, nothing is flushed or cleaned
    assert first.returncode == -signal.SIGKILL
    v = checkpoint_version(latest_checkpoint(run))
    logged = _steps(run / "metrics.jsonl")
    m = max(logged)
    assert m > v >= 2
    # a write the kill cut short (the kill may really have hit one)
    (run / "checkpoints" / f".tmp_step_{m}_{first.pid}").mkdir(exist_ok=True)
    with (run / "samples.jsonl").open("a") as f:
        f.write('{"step": 99, "sample": "half-writ')  # a line the kill cut short

    # 3. resume: the rows of steps v+1..m are superseded, then trained again exactly once
    res = run_training(load_run_config(run, [f"trainer.total_steps={m + 1}"]), resume_dir=run)
    assert res.steps == m + 1
    assert _steps(run / "metrics.jsonl") == list(range(1, m + 2))
    trained = read_jsonl(run / "trained.jsonl")
    assert [r["step"] for r in trained] == list(range(1, m + 2))
    groups = [g["group"] for r in trained for g in r["groups"]]
    assert len(groups) == len(set(groups))  # no trajectory group trained twice
    per_step = Counter(_steps(run / "samples.jsonl"))
    assert (
        sorted(per_step) == list(range(1, m + 2)) and max(per_step.values()) <= 2
    )  # samples_per_step
    gone = read_jsonl(run / "metrics.superseded.jsonl", include_superseded=True)
    assert sorted(r["step"] for r in gone) == list(range(v + 1, m + 1))
    assert all(r["superseded"]["resume_from_version"] == v for r in gone)
    assert any(
        r.get("unparseable", "").startswith('{"step": 99')
        for r in _raw_rows(run / "samples.superseded.jsonl")
    )
    # events: the crash history is kept, the part after the checkpoint marked superseded
    events = _raw_rows(run / "events.jsonl")
    live_ckpts = [
        e["version"] for e in events if e["event"] == "checkpoint" and not e.get("superseded")
    ]
    assert len(live_ckpts) == len(set(live_ckpts))
    assert all(
        e["version"] <= v for e in events if e.get("superseded") is None and e.get("segment") == 0
    )
    resume = [e for e in events if e["event"] == "resume"]
    assert resume and resume[0]["version"] == v and not resume[0].get("superseded")
    assert resume[0]["superseded_rows"]["metrics.jsonl"] == m - v
    assert any(f".tmp_step_{m}_{first.pid}" in c for c in resume[0]["cleaned"])
    assert not (run / "checkpoints" / f".tmp_step_{m}_{first.pid}").exists()
    # TensorBoard: purge_step drops the killed process's points after v; each step once
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    tb_steps = [e.step for e in acc.Scalars("reward/mean")]
    assert tb_steps == list(range(1, m + 2))
    # summary: the wall-clock of both process segments
    summary = json.loads((run / "summary.json").read_text())
    segs = summary["segments"]
    assert [s["segment"] for s in segs] == [0, 1]
    assert (
        segs[0]["superseded_steps"] == m - v
        and segs[0]["steps"] == v
        and segs[1]["steps"] == m + 1 - v
    )
    assert summary["wall_seconds"] == pytest.approx(sum(s["wall_seconds"] for s in segs))
    assert (
        segs[0]["wall_seconds"] > 0
        and summary["engine_busy"] <= 1.0
        and summary["trainer_busy"] <= 1.0
    )


def _raw_rows(path: Path) -> list[dict]:
    return (
        [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        if path.is_file()
        else []
    )


def test_resume_of_a_finished_run_changes_nothing_and_heldout_settings_are_fixed(tmp_path):
    run = tmp_path / "r"
    cfg = load_config(
        None,
        FAST
        + [
            "trainer.total_steps=2",
            f"run.dir={run}",
            "data.heldout_limit=2",
            "run.eval_max_new_tokens=4",
        ],
    )
    first = run_training(cfg)
    watched = [
        "eval_after.json",
        "eval_before.json",
        "summary.json",
        "events.jsonl",
        "metrics.jsonl",
        "config.json",
    ]
    before = {n: ((run / n).read_bytes(), (run / n).stat().st_mtime_ns) for n in watched}
    again = run_training(load_run_config(run), resume_dir=run)
    assert again.steps == first.steps == 2 and again.heldout_after == first.heldout_after
    assert {n: ((run / n).read_bytes(), (run / n).stat().st_mtime_ns) for n in watched} == before
    # killed after its last checkpoint, before the evaluation and summary: the resume completes
    # them in a segment that trains nothing (busy fractions stay fractions)
    (run / "summary.json").unlink()
    (run / "eval_after.json").unlink()
    done = run_training(load_run_config(run), resume_dir=run)
    assert done.steps == 2 and (run / "eval_after.json").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert [s["steps"] for s in summary["segments"]] == [2, 0]
    # the first process's segment keeps its versions (it lost them: rebuilt from its rows)
    assert [(s["start_version"], s["end_version"]) for s in summary["segments"]] == [(0, 2), (2, 2)]
    assert 0 <= summary["engine_busy"] <= 1 and 0 <= summary["segments"][1]["engine_busy_seconds"]
    assert summary["segments"][1]["engine_busy_seconds"] <= summary["segments"][1]["wall_seconds"]
    # a different held-out evaluation cannot be compared with eval_before.json
    with pytest.raises(ValueError, match=r"data\.heldout_limit cannot change on resume"):
        run_training(
            load_run_config(run, ["trainer.total_steps=3", "data.heldout_limit=1"]), resume_dir=run
        )
    with pytest.raises(ValueError, match=r"run\.eval_max_new_tokens cannot change"):
        run_training(
            load_run_config(run, ["trainer.total_steps=3", "run.eval_max_new_tokens=5"]),
            resume_dir=run,
        )
    # fresh-user finding: env.name=guess failed validation first ("set rollout.tool=none", itself
    # fixed on resume); the error now names the key that cannot change
    from conveyor.config import ConfigError

    with pytest.raises(ConfigError, match=r"env\.name cannot change on resume"):
        load_run_config(run, ["env.name=guess"])
    # a fixed key given with its saved value is not named (it changes nothing)
    with pytest.raises(ConfigError, match=r"--resume \S+: env\.name cannot change on resume"):
        load_run_config(run, ["model.name=tiny", "env.name=guess"])


def test_resume_to_train_longer_moves_the_old_eval_after_aside_and_refuses_fixed_changes(tmp_path):
    """A finished run resumed with more steps: the first process's eval_after.json (version 2)
    is moved to eval_after.json.superseded (no eval_*.json glob takes it) with its event superseded, so the run holds one valid
    "after" evaluation, the new version's. A finished run asked for a change it cannot take is
    refused even when there is nothing to train (it used to print "nothing changed")."""
    run = tmp_path / "r"
    cfg = load_config(None, FAST + ["trainer.total_steps=2", f"run.dir={run}", "data.heldout_limit=2",
                                    "run.eval_max_new_tokens=4"])
    run_training(cfg)
    first_after = json.loads((run / "eval_after.json").read_text())
    with pytest.raises(ValueError, match=r"model\.name cannot change on resume"):
        run_training(load_run_config(run, ["model.name=smollm2-135m-instruct"]), resume_dir=run)
    res = run_training(load_run_config(run, ["trainer.total_steps=3"]), resume_dir=run)
    assert res.steps == 3
    assert json.loads((run / "eval_after.json.superseded").read_text()) == first_after
    after = [e for e in read_jsonl(run / "events.jsonl", include_superseded=True)
             if e["event"] == "eval" and e["label"] == "after"]
    assert [e.get("version") for e in after if not e.get("superseded")] == [3]
    assert [e["superseded"]["moved_to"] for e in after if e.get("superseded")] == ["eval_after.json.superseded"]
    resume = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "resume"]
    assert resume[-1]["superseded_files"] == ["eval_after.json -> eval_after.json.superseded"]
    # a second one: .2; with another trainer.lr, which the optimizer takes (fresh-user trial 4,
    # finding 1: printed as changed, trained at the old rate); train/lr is each step's own rate
    run_training(load_run_config(run, ["trainer.total_steps=4", "trainer.lr=1e-3"]), resume_dir=run)
    assert (run / "eval_after.json.superseded").is_file() and (run / "eval_after.json.superseded.2").is_file()
    lrs = [r["train/lr"] for r in read_jsonl(run / "metrics.jsonl")]
    assert lrs == pytest.approx([1e-5, 2e-5, 2e-5, 1e-3])  # warm-up 2: half the peak at step 1
    resume = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "resume"]
    assert resume[-1]["optimizer_settings_taken"] == ["policy lr 2e-05 -> 0.001"]


def test_a_finished_run_without_a_checkpoint_is_not_silently_trained_again(tmp_path):
    """run.final_checkpoint=none and no periodic checkpoint: a finished run has nothing to
    continue from; --resume to train longer is refused with the reason, its logs untouched (it
    used to start again from version 0, warning that the process had stopped early)."""
    run = tmp_path / "r"
    run_training(load_config(None, FAST + ["trainer.total_steps=1", f"run.dir={run}", "data.heldout=",
                                           "run.final_checkpoint=none"]))
    logs = {n: (run / n).read_bytes() for n in ("metrics.jsonl", "events.jsonl", "summary.json")}
    with pytest.raises(FileNotFoundError, match=r"the run finished at version 1 without keeping a checkpoint "
                                                r"\(run\.final_checkpoint=none, run\.checkpoint_every=\d+\)"):
        run_training(load_run_config(run, ["trainer.total_steps=2"]), resume_dir=run)
    assert {n: (run / n).read_bytes() for n in logs} == logs


def test_restart_without_a_checkpoint_reuses_eval_before_or_supersedes_its_event(tmp_path):
    """`--resume` of a run with no checkpoint deleted eval_before.json and evaluated again, while
    the first process's eval event stayed valid in events.jsonl: now the same initial policy's
    evaluation is reused, and when it cannot be (model.seed changed) the old event is superseded,
    so the log holds one valid "before" evaluation either way."""
    run = tmp_path / "r"
    cfg = load_config(None, FAST + ["trainer.total_steps=1", f"run.dir={run}", "data.heldout_limit=2",
                                    "run.eval_max_new_tokens=4", "run.eval_after=false",
                                    "run.final_checkpoint=none"])
    run_training(cfg)
    assert latest_checkpoint(run) is None
    (run / "summary.json").unlink()  # as if killed after its first step, before any checkpoint
    ev = run / "eval_before.json"
    first = (ev.read_bytes(), ev.stat().st_mtime_ns)

    def before_events(include_superseded=False):
        return [e for e in read_jsonl(run / "events.jsonl", include_superseded=include_superseded)
                if e["event"] == "eval" and e["label"] == "before"]

    res = run_training(load_run_config(run), resume_dir=run)
    assert (ev.read_bytes(), ev.stat().st_mtime_ns) == first  # reused, not measured again
    assert res.heldout_before == json.loads(first[0])["pass_at_1"]
    assert len(before_events()) == 1
    restart = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "restart"]
    assert [e["eval_before"] for e in restart] == ["reused"]
    # another initial policy: measured again, the old event superseded (kept as history)
    (run / "summary.json").unlink()
    run_training(load_run_config(run, ["model.seed=1"]), resume_dir=run)
    assert ev.stat().st_mtime_ns != first[1]
    assert len(before_events()) == 1 and len(before_events(include_superseded=True)) == 2
    old = [e for e in before_events(include_superseded=True) if e.get("superseded")]
    assert "model.seed changed (0 -> 1)" in old[0]["superseded"]["reason"]
    restart = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "restart"]
    assert restart[-1]["eval_before"].startswith("removed: model.seed changed")


def test_simulate_calibration_reads_each_step_once(tmp_path):
    """`conveyor simulate RUN` on a run directory whose logs hold a step twice (written before
    resumes superseded rows) and a half-written last line (kill -9): each step counts once."""
    from conveyor.simulate import calibrate

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "async": {"eta": 2},
                "trainer": {"batch_size": 1},
                "rollout": {"group_size": 2, "max_concurrent": 8, "max_batch_size": 8},
                "run": {"seed": 0},
            }
        )
    )
    (tmp_path / "engine_stats.json").write_text(
        json.dumps(
            {
                "decode_profile": {"1": [10, 0.3], "2": [10, 0.5]},
                "prefill_seconds": 1.0,
                "prefill_tokens": 100,
            }
        )
    )
    trained = [
        {"step": s, "groups": [{"group": f"g{s}", "lengths": [[10, 20 + s], [10, 30]]}]}
        for s in (1, 2, 3, 3)
    ]
    metrics = [{"step": s, "train/tokens": 50, "time/train_step_s": 1.0 + s} for s in (1, 2, 3, 3)]
    for name, rows in (("trained.jsonl", trained), ("metrics.jsonl", metrics)):
        (tmp_path / name).write_text(
            "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "gro'
        )
    c = calibrate(tmp_path)
    assert c.steps == 3
    assert sorted(c.rollout.response_tokens.values) == [21, 22, 23, 30, 30, 30]


def test_segment_summary_gives_every_segment_its_versions(tmp_path):
    """summary.json's segment 0 lost start_version / end_version after a resume: only the
    current process's segment had them. Earlier segments get them from their rows (superseded
    ones included: the killed process did reach those versions)."""
    from conveyor.runlog import segment_summary

    def rows(seg, steps, **extra):
        return "".join(json.dumps({"step": s, "segment": seg, "time/elapsed_s": 10.0 * s,
                                   "busy/trainer": 0.5, "busy/engine": 0.5, **extra}) + "\n" for s in steps)

    (tmp_path / "metrics.jsonl").write_text(rows(0, [1, 2]) + rows(1, [3, 4, 5]))
    (tmp_path / "metrics.superseded.jsonl").write_text(rows(0, [3, 4], superseded={"resume_from_version": 2}))
    (tmp_path / "critic_warmup.jsonl").write_text(rows(0, [-1, 0]))
    cur = {"segment": 1, "wall_seconds": 30.0, "trainer_busy_seconds": 15.0, "engine_busy_seconds": 15.0,
           "cpu_busy_seconds": 24.0, "start_version": 2, "end_version": 5}
    summ = segment_summary(tmp_path, cur)
    segs = summ["segments"]
    assert [(s["segment"], s["start_version"], s["end_version"]) for s in segs] == [(0, 0, 4), (1, 2, 5)]
    assert set(segs[0]) == set(segs[1])
    assert (segs[0]["steps"], segs[0]["superseded_steps"], segs[0]["wall_seconds"]) == (4, 2, 40.0)
    assert summ["cpu_busy"] is None  # segment 0's rows predate busy/cpu: no share of the cores claimed
    (tmp_path / "metrics.superseded.jsonl").write_text(rows(0, [3, 4], superseded={"resume_from_version": 2},
                                                            **{"busy/cpu": 0.75}))
    # 0.75 x 40 s (segment 0's last row) + 24 s (this process) over 70 s
    assert segment_summary(tmp_path, cur)["cpu_busy"] == pytest.approx(54.0 / 70.0)


def test_a_console_reader_that_goes_away_does_not_stop_the_run(tmp_path):
    """Fresh-user trial 4, finding 2: `conveyor train ... | head` (the pipe's reader gone) died
    with SystemExit(1) from inside a console print, mid-run, without its checkpoint; now the
    console goes quiet and the run finishes (exit 0, every step logged, train.log says why)."""
    run = tmp_path / "r"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "train", *FAST, "trainer.total_steps=6",
                             "data.heldout=", f"run.dir={run}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    first = proc.stdout.readline()  # the reader takes one line, then goes away
    proc.stdout.close()
    assert proc.wait(timeout=300) == 0, first
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, 7))
    assert json.loads((run / "summary.json").read_text())["interrupted"] is False
    assert "the console's reader went away (broken pipe)" in (run / "train.log").read_text()


def test_training_a_finished_run_longer_from_an_older_checkpoint_keeps_its_export(tmp_path):
    """Fresh-user trial 4, finding 3: run.final_checkpoint=none with a periodic checkpoint at
    version 2 of 3: the suggested `--resume ... trainer.total_steps=N` trained version 3 again
    without a word and replaced the finished export. Now the hint and the resume say so, and the
    export of version 3 is moved to export.superseded (nothing computed is lost)."""
    from rich.console import Console

    run = tmp_path / "r"
    run_training(load_config(None, [*[x for x in FAST if x != "run.export=false"], "trainer.total_steps=3",
                                    "data.heldout=", "run.checkpoint_every=2", "run.final_checkpoint=none",
                                    f"run.dir={run}"]))
    assert json.loads((run / "export" / "conveyor.json").read_text())["policy_version"] == 3
    console = Console(record=True, width=300)
    run_training(load_run_config(run, []), resume_dir=run, console=console)  # finished: the hint
    hint = console.export_text()
    assert ("note: the run finished at version 3 but kept no checkpoint of it (run.final_checkpoint=none): a resume "
            "continues from step_2, so version 3 is trained again, on new rollouts; its export (policy version "
            "3) is moved to export.superseded") in hint
    console = Console(record=True, width=300)
    res = run_training(load_run_config(run, ["trainer.total_steps=4"]), resume_dir=run, console=console)
    assert res.steps == 4 and "version 3 is trained again" in console.export_text()
    assert json.loads((run / "export.superseded" / "conveyor.json").read_text())["policy_version"] == 3
    assert json.loads((run / "export" / "conveyor.json").read_text())["policy_version"] == 4
    resume = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "resume"]
    assert "export (policy version 3) -> export.superseded" in resume[-1]["superseded_files"]


@pytest.mark.parametrize("total, needle", [
    (4, "finished at version 4 (trainer.total_steps=4): nothing to do"),
    (3, "finished at version 4 (trainer.total_steps=3 is not beyond it): nothing to do"),
])
def test_a_finished_runs_resume_says_whose_total_steps_it_names(tmp_path, total, needle):
    """Fresh-user trial 5: `--resume RUN trainer.total_steps=3` on a run finished at 4 printed
    "(trainer.total_steps=3)" as if it were the run's setting. A higher total is no finished run."""
    from rich.console import Console

    from conveyor.config import load_config
    from conveyor.rundir import finished_result

    (tmp_path / "summary.json").write_text(json.dumps({"steps": 4, "interrupted": False, "wall_seconds": 1.0}))
    console = Console(record=True, width=400)
    res = finished_result(tmp_path, load_config(None, [f"trainer.total_steps={total}"]), console)
    assert res is not None and res.steps == 4 and needle in console.export_text()
    assert finished_result(tmp_path, load_config(None, ["trainer.total_steps=5"]), console) is None
