"""Bad input gets a clear error and leaves nothing behind (issue 10, section 5): data files,
prompts longer than the context, run.dir, the run-directory lock, Ctrl-C, full disks,
checkpoint damage, and the command line."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conveyor.checkpoint import (
    CheckpointError,
    clean_stale_checkpoint_dirs,
    export_policy,
    find_resume_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from conveyor.config import load_config
from conveyor.data import DatasetError
from conveyor.runlog import ConsoleFilter, ConsoleFormatter, FailureCounter, supersede_after
from conveyor.runtime_files import (
    DiskFullError,
    RunDirInUseError,
    RunFileError,
    RunLock,
    atomic_write_text,
)
from conveyor.shutdown import Interrupts, StopNow
from conveyor.train import run_training

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
    "run.eval_before=false",
    "run.eval_after=false",
]
ROOT = Path(__file__).resolve().parents[1]


def _rows(n: int, long_at: tuple[int, ...] = ()) -> str:
    """JSONL of ``n`` small problems; rows in ``long_at`` get a ~13,000-token question."""
    out = []
    for i in range(n):
        q = ("word " * 13000) if i in long_at else f"What is {i} plus {i}?"
        out.append(json.dumps({"question": q, "answer": str(2 * i)}))
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------- data and run.dir
def test_empty_data_file_is_named_and_leaves_no_run_dir(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = load_config(
        None, FAST + [f"data.train=file:{empty}", f"run.dir={tmp_path / 'r'}", "data.heldout="]
    )
    with pytest.raises(DatasetError, match=f"data file {empty}: it has no rows \\(empty file\\)"):
        run_training(cfg)
    assert not (tmp_path / "r").exists()


def test_run_dir_under_a_regular_file_is_a_clear_error(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    t0 = time.perf_counter()
    with pytest.raises(RunFileError, match="regular file"):
        run_training(load_config(None, FAST + [f"run.dir={f / 'run'}"]))
    with pytest.raises(RunFileError, match="is a file"):
        run_training(load_config(None, FAST + [f"run.dir={f}"]))
    assert time.perf_counter() - t0 < 30  # refused before the model and data are loaded


def test_all_prompts_too_long_is_refused_before_the_run_dir(tmp_path):
    data = tmp_path / "long.jsonl"
    data.write_text(_rows(2, long_at=(0, 1)))
    cfg = load_config(
        None, FAST + [f"data.train=file:{data}", "data.heldout=", f"run.dir={tmp_path / 'r'}"]
    )
    with pytest.raises(DatasetError, match="longer than the model's context of 2048 tokens"):
        run_training(cfg)
    assert not (tmp_path / "r").exists()


def test_an_overlong_prompt_is_skipped_counted_and_never_retried(tmp_path):
    data = tmp_path / "mixed.jsonl"
    data.write_text(_rows(7, long_at=(3,)))
    run = tmp_path / "r"
    cfg = load_config(
        None,
        FAST
        + [f"data.train=file:{data}", "data.heldout=", f"run.dir={run}", "trainer.total_steps=3",
           "rollout.engine_dtype=bfloat16", "rollout.priority=oldest_first"],  # (wired through, too)
    )
    res = run_training(cfg)
    assert res.steps == 3
    assert json.loads((run / "engine_stats.json").read_text())["dtype"] == "bfloat16"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollout/prompts_too_long"] == 1 for r in rows)
    assert all(r["rollout/episodes_failed"] == 0 for r in rows)  # nothing retried or failed
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    warn = [
        e
        for e in events
        if e["event"] == "warning" and "longer than the model's context" in e["message"]
    ]
    assert len(warn) == 1 and "mixed.jsonl" in warn[0]["message"] and "/3 (" in warn[0]["message"]
    assert "longer than the model's context" in (run / "train.log").read_text()
    trained = [
        g["sample"]
        for r in map(json.loads, (run / "trained.jsonl").read_text().splitlines())
        for g in r["groups"]
    ]
    assert trained and not any(s.endswith("/3") for s in trained)


def test_engine_and_controller_drop_a_prompt_that_fills_the_context_for_good(tiny):
    """The depth below the start-up check: a prompt the engine cannot extend raises
    PromptTooLongError, and the controller skips its sample for good (counted, never retried)."""
    import asyncio
    import threading

    from conveyor.rollout.buffer import TrajectoryBuffer
    from conveyor.rollout.controller import DataStream, RolloutController, wait_for_batch
    from conveyor.rollout.engine import InferenceEngine, PromptTooLongError, SamplingParams
    from conveyor.rollout.staleness import StalenessManager
    from conveyor.types import Sample, Trajectory

    ctx = tiny.model.config.max_position_embeddings
    with InferenceEngine(tiny.model, tiny.tokenizer, max_batch_size=2) as eng:
        with pytest.raises(PromptTooLongError, match=f"max_position_embeddings is {ctx}"):
            eng.generate_batch([[5] * ctx], SamplingParams(max_new_tokens=2))

    calls: dict[str, int] = {}
    skipped = []

    class Workflow:
        async def run_episode(self, engine, sample):
            calls[sample.id] = calls.get(sample.id, 0) + 1
            await asyncio.sleep(0)
            if sample.id == "long":
                raise PromptTooLongError(
                    "prompt has 13000 tokens; the model's max_position_embeddings is 2048"
                )
            return [
                Trajectory(
                    sample=sample,
                    group_id=f"{sample.id}#{calls[sample.id]}#{i}",
                    prompt_ids=[1],
                    response_ids=[2],
                    behaviour_logprobs=[0.0],
                    versions=[0],
                )
                for i in range(2)
            ]

    samples = [Sample(n, "q", "1", "t") for n in ("a", "long", "b", "c")]
    data = DataStream(samples, seed=0)
    staleness = StalenessManager(batch_size=2, eta=None, max_concurrent=4)
    buf = TrajectoryBuffer(None, on_drop=staleness.on_drop)
    c = RolloutController(
        None,
        Workflow(),
        data,
        staleness,
        buf,
        group_size=2,
        on_skip=lambda s, why: skipped.append((s.id, why)),
    )
    c.start()
    try:
        for _ in range(8):  # two epochs' worth of batches
            assert wait_for_batch(buf, 2, lambda: 0, stop=threading.Event()) is not None
    finally:
        c.stop()
    assert calls["long"] == 1 and c.stats.prompts_too_long == 1 and c.stats.episodes_failed == 0
    assert [s for s, _ in skipped] == ["long"] and "13000 tokens" in skipped[0][1]
    assert data.state_dict()["skip"] == [1]
    only_long = DataStream([samples[1]])
    only_long.skip.add(0)
    with pytest.raises(DatasetError, match="all 1 training samples were skipped"):
        only_long.next()


def test_max_new_tokens_beyond_the_context_is_reported_with_numbers(tiny):
    from conveyor.preflight import check_prompt_lengths
    from conveyor.prompts import build_prompt_ids
    from conveyor.rundir import preflight_samples

    samples = __import__("conveyor.data", fromlist=["load_dataset"]).load_dataset(
        "mawps:singleop:train"
    )[:20]
    instr = "Give the final answer as a number after 'Answer:'."
    exact = [len(build_prompt_ids(tiny.tokenizer, s, instr)) for s in samples]
    kept, rep = check_prompt_lengths(samples, tiny.tokenizer, instr, 2048, 3000)
    assert (
        len(kept) == 20
        and rep.cut == 20
        and rep.min_room == 2048 - max(exact)
        and rep.tokenized == 20
    )
    kept, rep = check_prompt_lengths(samples, tiny.tokenizer, instr, 2048, 96)
    assert (
        rep.cut == 0 and rep.tokenized == 0
    )  # the byte bound proves short prompts fit: no tokenizing
    cfg = load_config(None, FAST + ["rollout.max_new_tokens=3000", "data.heldout="])
    _, _, dropped, warnings = preflight_samples(cfg, samples, [], tiny.tokenizer, tiny.model)
    assert dropped == 0 and len(warnings) == 1
    assert "rollout.max_new_tokens=3000" in warnings[0] and "context of 2048 tokens" in warnings[0]
    assert f"as few as {2048 - max(exact)}" in warnings[0]


def test_changed_train_set_with_default_heldout_warns():
    from conveyor.preflight import config_warnings

    assert config_warnings(load_config(None, [])) == []
    w = config_warnings(load_config(None, ["data.train=gsm8k:train"]))
    assert len(w) == 1 and "data.heldout is still the default mawps:singleop:heldout" in w[0]
    assert (
        config_warnings(load_config(None, ["data.train=gsm8k:train", "data.heldout=gsm8k:test"]))
        == []
    )
    # an environment's own default held-out set (guess) with another training set
    w = config_warnings(load_config(None, ["env.name=guess", "data.train=mawps:singleop:train"]))
    assert len(w) == 1 and "data.heldout is still env.name=guess's default guess:heldout" in w[0]
    assert config_warnings(load_config(None, ["env.name=guess", "env.options.high=10"])) == []
    assert config_warnings(load_config(None, ["env.name=guess", "data.train=guess:train?high=10",
                                              "env.options.high=10"])) == []


# ---------------------------------------------------------------------- lock, signals
def test_run_lock_refuses_a_second_holder_and_names_the_pid(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(RunDirInUseError, match=f"in use by process {os.getpid()}") as e:
            RunLock(tmp_path).acquire()
    # the message alone on the console, not "[Errno 16] ..." (fresh-user trial 4, finding 11)
    assert str(e.value).startswith(f"run directory {tmp_path} is in use") and e.value.errno == errno.EBUSY
    with RunLock(tmp_path) as lock:  # released: can be taken again
        assert lock.held


def test_interrupts_policy():
    said = []
    it = Interrupts(say=said.append)
    with pytest.raises(StopNow):
        it._handle(signal.SIGINT, None)  # outside the training loop: stop at once
    it = Interrupts(say=said.append)
    stop = it.begin_graceful()
    it._handle(signal.SIGINT, None)  # first in the loop: finish the step
    assert stop.is_set() and it.requested and it.first_signum == signal.SIGINT
    with pytest.raises(StopNow) as e:
        it._handle(signal.SIGTERM, None)  # second: now
    assert e.value.signum == signal.SIGTERM and it.first_signum == signal.SIGINT


def test_second_signal_stops_now_without_a_traceback(tmp_path):
    """A real process: SIGINT (finish the step), then SIGTERM (now): exit 143 (128 + SIGTERM,
    the signal that stopped it now; fresh-user trial 4: every stop exited 130), one report line
    saying what was saved, no traceback; the lock is released (a resume can start)."""
    run = tmp_path / "r"
    log = tmp_path / "out.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "conveyor.cli",
            "train",
            *FAST,
            "trainer.total_steps=500",
            "run.checkpoint_every=1",
            f"run.dir={run}",
        ],
        cwd=ROOT,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints" / "step_1" / "DONE").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGINT)
        os.kill(proc.pid, signal.SIGTERM)  # handled right after SIGINT (a different signal)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    out = log.read_text()
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    flat = " ".join(out.split())
    assert "stopped now (during" in flat and f"conveyor train --resume {run}" in flat
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "stopped_now"
    with RunLock(run):  # the process is gone and so is its lock
        pass


# ---------------------------------------------------------------------- checkpoints, disk
class _Trainer:
    def __init__(self, version: int):
        self.version = version

    def state_dict(self):
        return {"model": {"w": torch.arange(4096.0) + self.version}, "version": self.version}


class _Controller:
    def snapshot(self):
        return {"data": {"epoch": 0, "pos": 0, "requeue": []}, "buffer": []}


def test_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    for v in (2, 4):
        save_checkpoint(tmp_path, _Trainer(v), _Controller(), keep=2)
    newest = tmp_path / "checkpoints" / "step_4"
    assert (
        verify_checkpoint(newest) is None
        and json.loads((newest / "manifest.json").read_text())["version"] == 4
    )
    data = (newest / "trainer.pt").read_bytes()
    (newest / "trainer.pt").write_bytes(data[: len(data) // 2])  # truncated
    warned = []
    assert find_resume_checkpoint(tmp_path, warn=warned.append).name == "step_2"
    assert (
        len(warned) == 1
        and "step_4 is damaged: trainer.pt has" in warned[0]
        and "step_2" in warned[0]
    )
    assert (
        tmp_path / "checkpoints" / "damaged_step_4"
    ).is_dir() and not newest.exists()  # rewritten on resume
    # same size, different bytes: the hash catches it
    ck2 = tmp_path / "checkpoints" / "step_2" / "trainer.pt"
    raw = bytearray(ck2.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    ck2.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="step_2 is damaged: trainer.pt: SHA-256"):
        find_resume_checkpoint(tmp_path)


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    import conveyor.checkpoint as ck

    save_checkpoint(tmp_path, _Trainer(2), _Controller())
    real_save = torch.save

    def full_disk(obj, path, *a, **k):
        real_save(obj, path, *a, **k)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(ck.torch, "save", full_disk)
    with pytest.raises(
        DiskFullError,
        match="no space left on the device while writing checkpoint step_4.*step_2 is intact",
    ):
        save_checkpoint(tmp_path, _Trainer(4), _Controller())
    monkeypatch.setattr(ck.torch, "save", real_save)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_2"
    ]  # no .tmp left
    assert verify_checkpoint(tmp_path / "checkpoints" / "step_2") is None
    # atomic JSON / text writes: a failed write leaves the old content, never an empty file
    target = tmp_path / "summary.json"
    target.write_text('{"old": 1}')

    def full(tmp):
        tmp.write_text('{"ne')
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFullError, match="summary.json"):
        __import__("conveyor.runtime_files", fromlist=["atomic_write"]).atomic_write(target, full)
    assert (
        target.read_text() == '{"old": 1}'
        and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    )
    atomic_write_text(target, "new")
    assert target.read_text() == "new"


def test_resume_cleans_only_dead_processes_unfinished_writes(tmp_path):
    root = tmp_path / "checkpoints"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (root / f".tmp_step_5_{dead.pid}").mkdir(parents=True)
    (root / f".tmp_step_6_{os.getppid()}").mkdir()  # a live process: left alone
    (root / "step_7").mkdir()  # renamed but never committed (no DONE)
    removed = clean_stale_checkpoint_dirs(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == [f".tmp_step_6_{os.getppid()}"]
    assert len(removed) == 2 and any(str(dead.pid) in r for r in removed)


def test_export_bfloat16_halves_the_bytes_and_keeps_tied_weights(tiny, tmp_path):
    from conveyor.models import load_model

    export_policy(tiny.model, tiny.tokenizer, tmp_path / "fp32")
    export_policy(tiny.model, tiny.tokenizer, tmp_path / "bf16", dtype="bfloat16")
    b32 = (tmp_path / "fp32" / "model.safetensors").stat().st_size
    b16 = (tmp_path / "bf16" / "model.safetensors").stat().st_size
    assert b16 < 0.55 * b32
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    back = load_model(str(tmp_path / "bf16")).model
    for name, t in tiny.model.state_dict().items():
        assert torch.equal(back.state_dict()[name], t.to(torch.bfloat16).float()), name
    assert next(tiny.model.parameters()).dtype == torch.float32  # the trained policy is untouched


# ---------------------------------------------------------------------- logs and console
def test_supersede_after_moves_rows_past_the_checkpoint_and_half_written_lines(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "x"'
    )
    (tmp_path / "events.jsonl").write_text(
        json.dumps({"event": "checkpoint", "version": 2})
        + "\n"
        + json.dumps({"event": "error", "version": 4})
        + "\n"
    )
    counts = supersede_after(tmp_path, 2)
    assert counts == {"metrics.jsonl": 3, "events.jsonl": 1}
    assert [
        json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ] == [1, 2]
    moved = [
        json.loads(x) for x in (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()
    ]
    assert [r.get("step") for r in moved] == [3, 4, None] and moved[2][
        "unparseable"
    ] == '{"step": 5, "x"'
    ev = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert "superseded" not in ev[0] and ev[1]["superseded"]["resume_from_version"] == 2
    assert supersede_after(tmp_path, 2) == {"metrics.jsonl": 0, "events.jsonl": 0}  # idempotent


def test_console_gets_one_line_per_warning_and_counts_reward_failures():
    try:
        raise ValueError("boom")
    except ValueError:
        rec = logging.LogRecord(
            "conveyor.rollout.controller",
            logging.ERROR,
            "f",
            1,
            "episode failed\nmore",
            None,
            sys.exc_info(),
        )
    assert (
        ConsoleFormatter().format(rec)
        == "ERROR conveyor.rollout.controller: episode failed (details in train.log)"
    )
    f = ConsoleFilter()
    reward = logging.LogRecord(
        "conveyor.rewards.service", logging.WARNING, "f", 1, "reward timeouts", None, None
    )
    quiet = logging.LogRecord(
        "conveyor.rollout.controller", logging.WARNING, "f", 1, "x", None, None
    )
    quiet.console = False
    assert not f.filter(reward) and not f.filter(quiet) and f.filter(rec)
    now = [0.0]
    c = FailureCounter(interval_s=10, clock=lambda: now[0])
    assert c.update({"reward failures": 0}) is None
    assert (
        c.update({"reward failures": 3})
        == "+3 reward failures (3 reward failures in total; details in train.log)"
    )
    now[0] = 5.0
    assert c.update({"reward failures": 9}) is None  # too soon
    now[0] = 11.0
    assert c.update({"reward failures": 9}).startswith("+6 reward failures (9 ")
    # a resumed process starts from the counts its checkpoint restored: only growth is new
    # (fresh-user finding: it printed the process before's 12 failures as "+12")
    c = FailureCounter(interval_s=10, clock=lambda: now[0], baseline={"reward failures": 12})
    assert c.update({"reward failures": 12}) is None
    assert c.update({"reward failures": 15}) == "+3 reward failures (15 reward failures in total; details in train.log)"


def test_cli_report_and_datasets():
    from typer.testing import CliRunner

    from conveyor.cli import app

    r = CliRunner().invoke(app, ["report", "/nonexistent/run"])
    assert r.exit_code == 2 and "no such run directory" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["datasets"])
    assert r.exit_code == 0 and "rg:basic_arithmetic" in r.output and "mawps:singleop" in r.output
    assert "guess:heldout?size=N&high=H&seed=S" in r.output  # the guess games (env.name=guess) too


def test_stop_report_before_the_first_checkpoint_says_resume(tmp_path):
    """A second Ctrl-C before any checkpoint: the advice is --resume RUN_DIR (the same command
    would be refused: the directory already holds a run)."""
    from rich.console import Console

    from conveyor.rundir import RunContext

    ctx = RunContext(Console())
    ctx.run_dir, ctx.phase = tmp_path, "training"
    try:
        msg = ctx.stop_report()
    finally:
        ctx.close()
    assert "no checkpoint was written" in msg and f"conveyor train --resume {tmp_path}" in msg
    assert "during training" in msg


def test_signal_during_the_clean_up_names_itself_and_counts_right(monkeypatch, capsys):
    """The message of a signal that arrives while the process is already stopping said "third
    signal" also when it was the second: e.g. a SIGTERM during an evaluation (first signal,
    outside the training loop), then another one."""
    import conveyor.shutdown as shutdown

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(shutdown.os, "_exit", exit_now)
    said, now = [], [0.0]
    it = Interrupts(say=said.append, clock=lambda: now[0])
    with pytest.raises(StopNow):
        it._handle(signal.SIGTERM, None)  # outside the training loop: now
    assert "SIGTERM (first signal, outside the training loop)" in said[-1]
    now[0] = 5.0
    with pytest.raises(SystemExit):
        it._handle(signal.SIGTERM, None)
    err = capsys.readouterr().err
    assert "SIGTERM (second signal)" in err and "third" not in err
    # in the training loop: finish the step, then stop now, then at once: the third signal
    it = Interrupts(say=said.append, clock=lambda: now[0])
    it.begin_graceful()
    it._handle(signal.SIGINT, None)
    assert said[-1].startswith("[yellow]SIGINT: stopping after the current step")
    with pytest.raises(StopNow):
        it._handle(signal.SIGTERM, None)
    assert "SIGTERM (second signal, again)" in said[-1]
    with pytest.raises(SystemExit):
        it._handle(signal.SIGINT, None)
    assert "SIGINT (third signal)" in capsys.readouterr().err


def test_one_sigterm_delivered_twice_is_one_request(monkeypatch):
    """GNU `timeout` sends SIGTERM to the process and then to its process group (the process is
    in it): the handler often ran twice for one expiry, so a graceful stop became "stop now"
    (no checkpoint) and, outside the training loop, the clean-up was cut by an exit reported as
    a "third signal". A SIGTERM repeated within DUPLICATE_SIGTERM_S counts once."""
    import conveyor.shutdown as shutdown

    monkeypatch.setattr(shutdown.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    said, now = [], [100.0]
    it = Interrupts(say=said.append, clock=lambda: now[0])
    stop = it.begin_graceful()
    it._handle(signal.SIGTERM, None)
    now[0] += 0.001
    it._handle(signal.SIGTERM, None)  # the group copy: ignored, the step still finishes
    assert stop.is_set() and len(said) == 1 and it.received == 1
    now[0] += 1.0
    with pytest.raises(StopNow):  # a real second request, a second later
        it._handle(signal.SIGTERM, None)
    it = Interrupts(say=said.append, clock=lambda: now[0])
    with pytest.raises(StopNow):  # outside the loop
        it._handle(signal.SIGTERM, None)
    now[0] += 0.001
    it._handle(signal.SIGTERM, None)  # no exit: the clean-up and its report go on
    assert it.received == 1
    with pytest.raises(SystemExit):  # a different signal is never a duplicate
        it._handle(signal.SIGINT, None)


def test_a_taken_run_dir_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """run.dir holding a run (or in use by a running process) was refused only after the model
    had loaded (a minute for SmolLM2): now before, with nothing written."""
    import conveyor.train as train_mod

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the run.dir conflict was found")

    monkeypatch.setattr(train_mod, "load_model", no_load)
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    cfg = load_config(None, FAST + [f"run.dir={run}"])
    with pytest.raises(FileExistsError, match=f"conveyor train --resume {run}"):
        run_training(cfg)
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]
    busy = tmp_path / "busy"
    busy.mkdir()
    with RunLock(busy):  # a process on it, still in its start-up (no metrics yet)
        with pytest.raises(RunDirInUseError, match=f"in use by process {os.getpid()}"):
            run_training(load_config(None, FAST + [f"run.dir={busy}"]))
    assert sorted(p.name for p in busy.iterdir()) == ["run.lock"]


def test_a_run_dir_holding_other_files_is_refused(tmp_path, monkeypatch):
    """run.dir was an existing directory of other files (not empty, no run in it): training wrote
    its files among them without a word. Now refused before the model loads, nothing written; an
    empty directory, or one a process left before its logs (run.lock, config.json), is used."""
    import conveyor.train as train_mod
    from conveyor.rundir import check_new_run_dir

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the run.dir conflict was found")

    monkeypatch.setattr(train_mod, "load_model", no_load)
    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "chapter1.tex").write_text("x")
    (mine / "figures").mkdir()
    with pytest.raises(FileExistsError, match=rf"run.dir={mine} is not empty and is not a conveyor run "
                                              r"directory \(it holds chapter1.tex, figures; "):
        run_training(load_config(None, FAST + [f"run.dir={mine}"]))
    assert sorted(p.name for p in mine.iterdir()) == ["chapter1.tex", "figures"]
    empty = tmp_path / "empty"
    empty.mkdir()
    check_new_run_dir(empty)
    (empty / "run.lock").write_text("{}")
    (empty / "config.json").write_text("{}")
    check_new_run_dir(empty)  # a process that stopped before its logs: used again
    check_new_run_dir(tmp_path / "new")  # not there yet


# ---------------------------------------------------------------------- reward functions
def test_reward_fn_with_a_wrong_signature_is_refused_before_the_run_dir(tmp_path, monkeypatch):
    """A one-argument reward function would fail every reward of the run: refused at start,
    naming reward.fn and the signature; no run directory."""
    (tmp_path / "myrewards_sig.py").write_text("def one_arg(response):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, FAST + ["reward.fn=myrewards_sig:one_arg", f"run.dir={tmp_path / 'r'}", "data.heldout="])
    with pytest.raises(ValueError, match=r"reward.fn='myrewards_sig:one_arg': one_arg\(response\) cannot be called "
                                         r"as fn\(response: str, sample"):
        run_training(cfg)
    assert not (tmp_path / "r").exists()


def test_check_reward_signature_cases():
    from conveyor.rewards import check_reward_signature

    def two(response, sample):
        return 0.0

    def extra_default(response, sample, scale=1.0):
        return 0.0

    def star(*args):
        return 0.0

    for ok in (two, extra_default, star, lambda r, s: 0.0):
        check_reward_signature(ok, "x")
    for bad in (lambda r: 0.0, lambda r, s, needed: 0.0, lambda *, r, s: 0.0):
        with pytest.raises(ValueError, match="reward.fn='x'"):
            check_reward_signature(bad, "x")


def test_a_module_level_lambda_and_closure_train_as_reward_functions(tmp_path):
    """The reward workers import reward.fn by its path, so a module-level lambda or a factory's
    closure (unpicklable) works; it used to be refused after the run directory was made."""
    mod = tmp_path / "rewmods"
    mod.mkdir()
    (mod / "myrewards_closure.py").write_text(
        "lam = lambda response, sample: float(len(response) % 2)\n"
        "def factory():\n"
        "    def inner(response, sample):\n"
        "        return 1.0\n"
        "    return inner\n"
        "inner_fn = factory()\n")
    env = {**os.environ, "PYTHONPATH": f"{mod}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for name in ("lam", "inner_fn"):
        run = tmp_path / name
        out = subprocess.run(
            [sys.executable, "-m", "conveyor.cli", "train", *FAST, "trainer.total_steps=1", "data.heldout=",
             f"reward.fn=myrewards_closure:{name}", f"run.dir={run}"],
            capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 1 and rows[0]["rollout/reward_failures"] == 0, rows
        if name == "inner_fn":
            assert rows[0]["reward/mean"] == 1.0
