"""The chaos suite: recovery proven by fault injection, not argued (issue 10, section 6).

Runs on the ``tiny`` model and prints one table (also written as JSON with ``--json``):

1. **kill -9 at random points, each followed by ``--resume``.** One run is killed ``--kills``
   times (SIGKILL from inside, at a seeded random hit of a named fault point: during
   generation, a train step, a checkpoint write, a weight sync, between steps, the held-out
   evaluation before and after training; :mod:`conveyor.faults`), each time resumed with
   ``conveyor train --resume``, then resumed a last time without faults. Checked from the run's
   own logs after every resume and at the end: every step appears once in ``metrics.jsonl`` /
   ``trained.jsonl`` / ``samples.jsonl``; no trajectory group (and no sample of this epoch) is
   trained twice; the staleness bound holds on every step (``staleness/max <= eta``); **no
   sample is lost**: every sample the data stream handed out (reconstructed from the seeded
   permutation and the final checkpoint's cursor) is trained, listed as not trained
   (``trained.jsonl`` ``not_trained``: dropped stale, filtered, ...) or still pending in the
   final checkpoint (buffer, re-queue); the final version equals ``trainer.total_steps``.
2. **Interrupted checkpoint write, truncated newest checkpoint**: a kill half-way through a
   checkpoint write leaves the previous checkpoint usable; a truncated file in the newest
   checkpoint makes the resume fall back to the previous one with a warning.
3. **Disk full while a checkpoint is written** (an injected ``ENOSPC`` in the checkpoint
   writer): a clear error, the previous checkpoint intact, and the resume works afterwards.
4. **Reward faults** (``--reward-faults``): exceptions, timeouts, hangs, None, NaN, +-inf, huge
   values, wrong types, through the reward service: 0 crashes, every one counted; a training
   run whose every reward fails stops after ``reward.max_failed_steps`` steps with a checkpoint
   and exit code 1.
5. **Non-finite gradients** injected on chosen steps: each skipped and counted; after
   ``trainer.max_nonfinite_in_a_row`` in a row the run stops with a checkpoint and a clear error.

Usage::

    python benchmarks/chaos.py              # the full suite (20 kills, 1000 reward faults)
    python benchmarks/chaos.py --quick      # 3 kills, 100 reward faults (run by the tests)

Each row says PASS or FAIL with its numbers; the exit code is 1 when any row fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONVEYOR = [sys.executable, "-m", "conveyor.cli"]

# a small, fast run on the tiny model (calculator tool on, so episodes span several requests)
COMMON = [
    "model.name=tiny", "trainer.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=16",
    "data.heldout_limit=4", "run.eval_max_new_tokens=8", "run.export=false", "trainer.lr=1e-4",
    "run.checkpoint_every=1", "run.keep_checkpoints=2", "async.eta=1", "run.progress=false",
    "reward.workers=1",
    # dynamic filtering of all-equal groups (the tiny model's rewards are all 0), capped at one in
    # a row: every other group is filtered, so the audit also accounts for samples never trained
    "rollout.filter_all_equal=true", "rollout.max_filtered_in_a_row=1",
]
MID_POINTS = ("generate", "train_step", "weight_sync", "checkpoint_write", "step_end")
HITS = {"generate": (1, 60), "train_step": (1, 2), "weight_sync": (1, 2),
        "checkpoint_write": (1, 2), "step_end": (1, 2), "eval": (1, 4)}


def _run(args: list[str], faults: str = "", timeout: float = 600.0) -> tuple[int, str]:
    env = dict(os.environ)
    env["CONVEYOR_FAULTS"] = faults
    env.setdefault("OMP_NUM_THREADS", "1")
    p = subprocess.run(CONVEYOR + args, cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------ the audit
def audit(run_dir: Path, *, final: bool) -> list[str]:
    """Check a run directory's logs; returns the problems found (empty: all good)."""
    from conveyor.config import load_config

    problems: list[str] = []
    cfg = load_config(run_dir / "config.json")
    metrics = _jsonl(run_dir / "metrics.jsonl")
    trained = _jsonl(run_dir / "trained.jsonl")
    samples = _jsonl(run_dir / "samples.jsonl")
    for name, rows in (("metrics.jsonl", metrics), ("trained.jsonl", trained)):
        steps = [r["step"] for r in rows]
        if steps != list(range(1, len(steps) + 1)):
            problems.append(f"{name}: steps {steps} are not 1..{len(steps)} once each")
    dup_steps = [s for s, n in Counter(r["step"] for r in samples).items()
                 if n > 2]  # samples_per_step rows per step
    if dup_steps:
        problems.append(f"samples.jsonl: steps {dup_steps} logged more than once")
    groups = [g["group"] for r in trained for g in r["groups"]]
    if len(groups) != len(set(groups)):
        problems.append(f"trained.jsonl: {len(groups) - len(set(groups))} trajectory groups trained twice")
    eta = cfg.asynchronous.eta
    over = [(r["step"], r.get("staleness/max")) for r in metrics
            if eta is not None and (r.get("staleness/max") or 0) > eta]
    if over:
        problems.append(f"staleness bound eta={eta} broken at (step, max staleness) {over}")
    if not final:
        return problems
    # every sample the data stream handed out is accounted for
    import torch

    from conveyor.checkpoint import latest_checkpoint
    from conveyor.data import load_dataset
    from conveyor.rollout.controller import DataStream

    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return problems + ["no final checkpoint"]
    state = torch.load(ckpt / "state.pt", weights_only=False)
    version = int(state["version"])
    if version != cfg.trainer.total_steps:
        problems.append(f"final version {version} != trainer.total_steps {cfg.trainer.total_steps}")
    data_state = state["controller"]["data"]
    train = load_dataset(cfg.data.train, split_seed=cfg.data.split_seed)
    from conveyor.preflight import check_prompt_lengths  # noqa: F401 (same samples as the run)

    stream = DataStream(train, seed=cfg.data.shuffle_seed)
    handed: list[str] = []
    while (stream.epoch, stream.pos) < (data_state["epoch"], data_state["pos"]):
        _, s = stream.next()
        handed.append(s.id)
    outcomes: Counter = Counter()
    for r in trained:
        for g in r["groups"]:
            outcomes[g["sample"]] += 1
        for nt in r.get("not_trained", []):
            outcomes[nt["sample"]] += 1
    for g in state["controller"]["buffer"]:
        outcomes[g[0].sample.id] += 1
    for nt in state["controller"].get("not_trained", []):
        outcomes[nt["sample"]] += 1
    for i in data_state.get("requeue", []):
        outcomes[train[i].id] += 1
    handed_c = Counter(handed)
    lost = handed_c - outcomes
    extra = outcomes - handed_c
    if lost:
        problems.append(f"{sum(lost.values())} samples handed out but never trained or accounted "
                        f"for: {sorted(lost)[:5]}")
    if extra:
        problems.append(f"{sum(extra.values())} outcomes for samples never handed out (trained "
                        f"twice?): {sorted(extra)[:5]}")
    return problems


# ------------------------------------------------------------------------------ the trials
def kill_resume(workdir: Path, kills: int, total_steps: int, seed: int) -> dict:
    """Section 1: ``kills`` kill -9 at random points of one run, each followed by a resume."""
    rng = random.Random(seed)
    run_dir = workdir / "killed"
    args = COMMON + [f"trainer.total_steps={total_steps}", f"run.dir={run_dir}"]
    # the evaluation before training (first process), random points mid-run, and the evaluation
    # after training (the process that reaches total_steps, then the resume that completes it)
    mids = [rng.choice(MID_POINTS) for _ in range(max(1, kills - 3))]
    schedule = (["eval"] + mids + ["eval", "eval"])[: max(kills, 0)] if kills >= 4 else \
        (["eval", rng.choice(MID_POINTS), "eval"])[:kills]
    log, problems = [], []
    first = True
    t0 = time.perf_counter()
    for point in schedule:
        lo, hi = HITS[point]
        fault = f"kill@{point}#{rng.randint(lo, hi)}"
        cmd = args if first else ["--resume", str(run_dir)]
        rc, out = _run(["train", *cmd], fault)
        first = False
        ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) if run_dir.exists() else []
        log.append({"fault": fault, "rc": rc, "checkpoints": ckpts})
        if rc not in (-signal.SIGKILL, 0):
            problems.append(f"{fault}: exit code {rc}: {out[-400:]}")
            break
        if run_dir.exists() and (run_dir / "config.json").exists():
            problems += [f"after {fault}: {p}" for p in audit(run_dir, final=False)]
    kills_done = sum(e["rc"] == -signal.SIGKILL for e in log)
    rc, out = _run(["train", "--resume", str(run_dir)])
    log.append({"fault": "", "rc": rc})
    if rc != 0:
        problems.append(f"final resume: exit code {rc}: {out[-800:]}")
    else:
        problems += audit(run_dir, final=True)
    trained = _jsonl(run_dir / "trained.jsonl")
    nt = Counter(x["outcome"] for r in trained for x in r.get("not_trained", []))
    return {
        "name": f"kill -9 x {kills_done} at random points + --resume",
        "ok": not problems and kills_done == len(schedule),
        "detail": (f"{kills_done}/{len(schedule)} kills fired ({Counter(e['fault'].split('#')[0] for e in log if e['rc'] == -signal.SIGKILL)}); "
                   f"{sum(len(r['groups']) for r in trained)} groups trained once each, not trained: {dict(nt)}; "
                   f"final version {total_steps}; {time.perf_counter() - t0:.0f} s"),
        "problems": problems, "log": log,
    }


def checkpoint_damage(workdir: Path) -> dict:
    """Section 2: a kill half-way through a checkpoint write, then a truncated newest file."""
    run_dir = workdir / "damaged"
    problems = []
    args = COMMON + ["trainer.total_steps=4", f"run.dir={run_dir}", "run.eval_before=false",
                     "run.eval_after=false"]
    # the 3rd checkpoint write (step_3) is killed half-way: step_2 stays
    rc, out = _run(["train", *args], "kill@checkpoint_write#3")
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    if rc != -signal.SIGKILL or "step_2" not in ckpts or "step_3" in ckpts:
        problems.append(f"kill during the step_3 write: rc {rc}, checkpoints {ckpts}")
    # truncate a file of the newest complete checkpoint: the resume must fall back with a warning
    newest = sorted((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))[-1]
    f = newest / "trainer.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    rc, out = _run(["train", "--resume", str(run_dir)])
    if rc != 0 or "damaged" not in out:
        problems.append(f"resume after truncating {newest.name}/trainer.pt: rc {rc}, no fallback warning: {out[-600:]}")
    problems += audit(run_dir, final=rc == 0)
    return {"name": "checkpoint write killed half-way; truncated newest checkpoint",
            "ok": not problems,
            "detail": f"killed in the step_3 write (left {ckpts}); truncated {newest.name}/trainer.pt -> "
                      f"resumed from the older one with a warning, finished at 4",
            "problems": problems}


def disk_full(workdir: Path) -> dict:
    """Section 3: ENOSPC while the step_2 checkpoint is written."""
    run_dir = workdir / "diskfull"
    problems = []
    args = COMMON + ["trainer.total_steps=3", f"run.dir={run_dir}", "run.eval_before=false",
                     "run.eval_after=false"]
    # the disk stays full: the step_2 write and the final checkpoint's retry both fail
    rc, out = _run(["train", *args], "enospc@checkpoint_write#2,enospc@checkpoint_write#3")
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    clear = "no space left" in out.lower() and "Traceback" not in out
    if rc == 0 or not clear:
        problems.append(f"disk full: rc {rc}, clear error {clear}: {out[-600:]}")
    if ckpts != ["step_1"]:
        problems.append(f"after the failed write the checkpoints are {ckpts}, expected ['step_1']")
    rc, out = _run(["train", "--resume", str(run_dir)])
    if rc != 0:
        problems.append(f"resume after freeing space: rc {rc}: {out[-600:]}")
    problems += audit(run_dir, final=rc == 0)
    return {"name": "disk full during a checkpoint write", "ok": not problems,
            "detail": "clear error (no traceback), step_1 intact, no partial step_2; the resume "
                      "after space is freed finished at 3",
            "problems": problems}


def reward_faults(n: int, workers: int = 4) -> dict:
    """Section 4: ``n`` injected reward faults through the reward service."""
    from conveyor.rewards import RewardService
    from conveyor.rewards.faults import CHAOS_KINDS, chaos_sample
    from conveyor.types import Sample

    t0 = time.perf_counter()
    sample = Sample("chaos/0", "1+1?", "2", "chaos")
    kinds = [CHAOS_KINDS[i % len(CHAOS_KINDS)] for i in range(n)]
    problems = []
    with RewardService("conveyor.rewards.faults:chaos_reward", timeout_s=0.5, max_workers=workers,
                       failure_score=-1.0) as svc:
        results = svc.score_many([(chaos_sample(k, i), sample) for i, k in enumerate(kinds)])
        stats = svc.stats
    not_failed = [k for k, r in zip(kinds, results, strict=True) if not r.failed]
    if not_failed:
        problems.append(f"{len(not_failed)} faults scored as valid rewards: {Counter(not_failed)}")
    if stats["failures"] != n:
        problems.append(f"service counted {stats['failures']} failures of {n}")
    if any(r.score != -1.0 for r in results if r.failed):
        problems.append("a failed reward was not scored reward.failure_score")
    return {"name": f"{n} injected reward faults", "ok": not problems,
            "detail": f"0 crashes; {stats['failures']} counted (timeouts {stats['timeouts']}, "
                      f"exceptions {stats['exceptions']}, invalid {stats['invalid']}); "
                      f"{stats['worker_restarts']} worker restarts; {time.perf_counter() - t0:.0f} s",
            "problems": problems}


def reward_faults_in_training(workdir: Path, steps: int, max_failed_steps: int = 3) -> dict:
    """Section 4 end to end: a training run whose every reward call is a fault (the start-up
    probe off: reward.check_at_start=false). Every failure is counted; after
    ``reward.max_failed_steps`` steps in a row with every reward failed the run stops with a
    checkpoint and exit code 1 (issue 44, section 2)."""
    run_dir = workdir / "reward_faults"
    args = COMMON + [f"trainer.total_steps={steps}", f"run.dir={run_dir}", "run.eval_before=false",
                     "run.eval_after=false", "reward.fn=conveyor.rewards.faults:chaos_reward",
                     "reward.timeout_s=0.5", "reward.workers=2", "reward.check_at_start=false",
                     f"reward.max_failed_steps={max_failed_steps}"]
    rc, out = _run(["train", *args])
    rows = _jsonl(run_dir / "metrics.jsonl")
    problems = []
    stops = steps > max_failed_steps
    if stops and (rc != 1 or "reward.max_failed_steps" not in out or "Traceback" in out):
        problems.append(f"expected a clear reward.max_failed_steps error and exit code 1: rc {rc}: {out[-600:]}")
    if not stops and rc != 0:
        problems.append(f"exit code {rc}: {out[-600:]}")
    if stops and len(rows) != max_failed_steps:
        problems.append(f"{len(rows)} steps logged, expected the run to stop after {max_failed_steps}")
    if stops and not any((run_dir / "checkpoints").glob("step_*")):
        problems.append("no checkpoint written before stopping")
    total = sum(len(g["lengths"]) for r in _jsonl(run_dir / "trained.jsonl") for g in r["groups"])
    failed_share = [r.get("rollout/reward_failed_share") for r in rows]
    if rows and any(s != 1.0 for s in failed_share):
        problems.append(f"reward_failed_share per step {failed_share}, expected 1.0 (every call a fault)")
    return {"name": f"training with every reward call a fault ({steps} steps)", "ok": not problems,
            "detail": f"exit {rc} after {len(rows)} steps; {total} trained trajectories, all counted failed "
                      f"(rollout/reward_failures {rows[-1].get('rollout/reward_failures') if rows else None})",
            "problems": problems}


def nonfinite(workdir: Path) -> dict:
    """Section 5: non-finite losses injected on steps 2, then 4-6 (max 3 in a row)."""
    run_dir = workdir / "nonfinite"
    args = COMMON + ["trainer.total_steps=10", f"run.dir={run_dir}", "run.eval_before=false",
                     "run.eval_after=false", "trainer.max_nonfinite_in_a_row=3"]
    rc, out = _run(["train", *args], "nonfinite@loss#2,nonfinite@loss#4,nonfinite@loss#5,nonfinite@loss#6")
    problems = []
    events = _jsonl(run_dir / "events.jsonl")
    skipped = [e["version"] for e in events if e["event"] == "skipped_nonfinite"]
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    if rc == 0 or "non-finite" not in out or "Traceback" in out:
        problems.append(f"expected a clear non-finite error and a non-zero exit: rc {rc}: {out[-500:]}")
    if skipped != [2, 4, 5, 6]:
        problems.append(f"skipped-step events at versions {skipped}, expected [2, 4, 5, 6]")
    problems += audit(run_dir, final=False)  # the stopping step is logged like any other
    if not ckpts:
        problems.append("no checkpoint written before stopping")
    rows = _jsonl(run_dir / "metrics.jsonl")
    counted = sum(bool(r.get("train/skipped_nonfinite")) for r in rows)
    return {"name": "non-finite losses injected (1 alone, then 3 in a row)", "ok": not problems,
            "detail": f"{counted} steps skipped and counted; stopped with a clear error after 3 in a row; "
                      f"checkpoint {ckpts[-1] if ckpts else None}",
            "problems": problems}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 kills, 100 reward faults")
    ap.add_argument("--kills", type=int, default=None)
    ap.add_argument("--reward-faults", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the table as JSON here")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    ap.add_argument("--only", default=None, help="comma-separated: kills,damage,disk,rewards,nonfinite")
    a = ap.parse_args(argv)
    kills = a.kills if a.kills is not None else (3 if a.quick else 20)
    nfaults = a.reward_faults if a.reward_faults is not None else (100 if a.quick else 1000)
    only = set(a.only.split(",")) if a.only else {"kills", "damage", "disk", "rewards", "nonfinite"}
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-chaos-")) if a.keep is None else a.keep
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.perf_counter()
    try:
        if "kills" in only:
            rows.append(kill_resume(workdir, kills, total_steps=6 if a.quick else 12, seed=a.seed))
        if "damage" in only:
            rows.append(checkpoint_damage(workdir))
        if "disk" in only:
            rows.append(disk_full(workdir))
        if "rewards" in only:
            rows.append(reward_faults(nfaults))
            if not a.quick:
                rows.append(reward_faults_in_training(workdir, steps=4))
        if "nonfinite" in only:
            rows.append(nonfinite(workdir))
    finally:
        if a.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"\nchaos suite ({'quick' if a.quick else 'full'}, seed {a.seed}, {time.perf_counter() - t0:.0f} s)\n")
    print("| check | result | numbers |\n|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {'PASS' if r['ok'] else 'FAIL'} | {r['detail']} |")
    for r in rows:
        for p in r["problems"]:
            print(f"FAIL {r['name']}: {p}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
