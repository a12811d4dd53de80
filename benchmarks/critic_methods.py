"""The critic methods on a task where a critic can help (issue 45, section 3; MISSION.md sections 3-4).

Usage: python benchmarks/critic_methods.py --model RUN/export [--arms grpo,grpo_dis,sao,...]
       [--seeds 0,1,2] [--steps 20] [--out runs/critic_methods] [--parallel 2] [--table-only]
       [--set key=value ...] [--json OUT.json] [--quick]

Every run is ``conveyor train critic_mix`` (configs/critic_mix.yaml: the vendored critic_mix set,
one-step sums mixed with MAWPS multiarith, 16 responses per update, held-out pass@1 from 4
responses per problem at T = 0.6 before and after training) with an arm's keys on top. An arm is a shipped preset (its keys, except
``trainer.total_steps``, become overrides, so the arm is exactly what ``conveyor train <preset>``
trains) plus, for the ablations, a few keys:

========================  =================================================================
arm                       what it trains
========================  =================================================================
grpo                      configs/grpo.yaml: groups of 4, decoupled PPO
grpo_dis                  configs/grpo_dis.yaml: groups of 4, SAO's double-sided mask (DIS)
sao                       configs/sao.yaml: one response per prompt, a policy-copy critic
                          (K = 2, attention frozen, 10 warm-up updates), DIS
asyppo                    configs/asyppo.yaml: two head critics, 10% / 20% token masks
asyppo_nomask             asyppo without either mask (``critic.mask_*_frac=0``)
asyppo_full               asyppo's loss with one full critic (a policy copy, attention
                          frozen, ``critic.lr`` 5e-5 as SAO's) instead of the heads, no masks
========================  =================================================================

Equal samples: every arm trains on 16 responses per update for ``--steps`` updates; the critic
arms also roll out their warm-up updates (``critic.warmup_steps`` x 16 responses, critic only),
counted in the table's ``samples`` column. Runs go ``--parallel`` at a time (each inline run keeps
about one of this machine's cores busy; the trainer is its bottleneck), each in
``OUT/<arm>_s<seed>`` with its console in ``OUT/<arm>_s<seed>.log``; a run whose ``summary.json``
exists is not run again (``--table-only``: none is run). Every run starts from the same weights,
so only the first run evaluates them before training (its figure is every row's "before").

Prints one row per run (held-out pass@1 before / after, the after split into sums and
multiarith, the training reward per 5 updates: the learning curve, mean response length of the last 5,
the critic's ``value/explained_variance`` and ``value/prompt_corr`` over the last 5 critic
steps, samples, seconds), then each arm's mean and standard deviation over seeds (ddof 1); the last
line is the JSON of everything (also written by ``--json``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

# arm -> (preset whose keys it trains with, extra overrides)
ARMS: dict[str, tuple[str, list[str]]] = {
    "grpo": ("grpo", []),
    "grpo_dis": ("grpo_dis", []),
    "sao": ("sao", []),
    "asyppo": ("asyppo", []),
    "asyppo_nomask": ("asyppo", ["critic.mask_low_frac=0", "critic.mask_high_frac=0"]),
    "asyppo_full": ("asyppo", ["critic.backbone=policy", "critic.num_critics=1", "critic.freeze_attention=true",
                               "critic.lr=5e-5", "critic.mask_low_frac=0", "critic.mask_high_frac=0"]),
}


def flatten(tree: dict, prefix: str = "") -> list[str]:
    """A preset's nested keys as ``a.b=value`` overrides (YAML / JSON scalars; lists as JSON)."""
    out: list[str] = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += flatten(value, name + ".")
        elif isinstance(value, list):
            out.append(f"{name}={json.dumps(value)}")
        elif value is None:
            out.append(f"{name}=null")
        elif isinstance(value, bool):
            out.append(f"{name}={'true' if value else 'false'}")
        else:
            out.append(f"{name}={value}")
    return out


def arm_overrides(arm: str) -> list[str]:
    """The overrides of ``arm`` on top of critic_mix (its preset's keys but the step count, then the
    arm's own). Raises SystemExit for an unknown arm."""
    from conveyor.presets import find_preset

    if arm not in ARMS:
        raise SystemExit(f"unknown arm {arm!r}; arms: {', '.join(ARMS)}")
    preset, extra = ARMS[arm]
    path = find_preset(preset)
    if path is None:
        raise SystemExit(f"preset {preset!r} of arm {arm!r} not found")
    keys = [o for o in flatten(yaml.safe_load(path.read_text()) or {}) if not o.startswith("trainer.total_steps=")]
    return keys + extra


def run_one(arm: str, seed: int, a: argparse.Namespace, first: bool) -> subprocess.Popen | None:
    """Start ``conveyor train critic_mix`` for (arm, seed) unless its summary.json exists."""
    run_dir = Path(a.out) / f"{arm}_s{seed}"
    if (run_dir / "summary.json").exists():
        return None
    keys = arm_overrides(arm)
    if a.quick and "loss.advantage=gae" in keys:
        keys.append("critic.warmup_steps=1")
    cmd = [sys.executable, "-m", "conveyor.cli", "train", "critic_mix", *keys,
           f"model.name={a.model}", f"trainer.total_steps={a.steps}", f"run.seed={seed}", f"run.dir={run_dir}",
           f"run.eval_before={'true' if first else 'false'}", "run.export=false", "run.final_checkpoint=none",
           "run.checkpoint_every=1000",  # no step checkpoints (1.6-3 GB each; ~30 GB for 18 runs)
           "run.progress=false", *a.set]
    print(f"start {arm}_s{seed}: {' '.join(cmd[3:])}", flush=True)
    with open(Path(a.out) / f"{arm}_s{seed}.log", "w") as log:  # the child keeps its own copy of the file
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def eval_parts(path: Path) -> dict | None:
    """Held-out pass@1 of one ``eval_*.json``: all, sums, multiarith (None: no such file)."""
    if not path.exists():
        return None
    d = json.loads(path.read_text())
    parts: dict[str, list[float]] = {"all": [], "sums": [], "multiarith": []}
    for rec in d["records"]:
        score = sum(rec["correct"]) / len(rec["correct"])
        parts["all"].append(score)
        parts["sums" if "/sums/" in rec["id"] else "multiarith"].append(score)
    return {k: (statistics.fmean(v) if v else float("nan")) for k, v in parts.items()}


def mean_of(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None and not math.isnan(r[key])]
    return statistics.fmean(vals) if vals else float("nan")


def summarise(run_dir: Path, before: dict | None) -> dict | None:
    """One run's row (None when it has not finished)."""
    if not (run_dir / "summary.json").exists():
        return None
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steps = [r for r in rows if r.get("reward/mean") is not None]
    valued = [r for r in rows if r.get("value/explained_variance") is not None]
    warm_path = run_dir / "critic_warmup.jsonl"  # the critic's warm-up updates (their own rollouts)
    warm = sum(1 for ln in warm_path.read_text().splitlines() if ln.strip()) if warm_path.exists() else 0
    cfg = json.loads((run_dir / "config.json").read_text())
    per_update = cfg["trainer"]["batch_size"] * cfg["rollout"]["group_size"]
    return {
        "before": eval_parts(run_dir / "eval_before.json") or before,
        "after": eval_parts(run_dir / "eval_after.json"),
        "reward_by_5": [mean_of(steps[i:i + 5], "reward/mean") for i in range(0, len(steps), 5)],
        "reward_last5": mean_of(steps[-5:], "reward/mean"),
        "length_last5": mean_of(steps[-5:], "response/length_mean"),
        "value_ev_last5": mean_of(valued[-5:], "value/explained_variance"),
        "value_corr_prompt_last5": mean_of(valued[-5:], "value/prompt_corr"),
        "samples": per_update * (summary["steps"] + warm),
        "seconds": summary["wall_seconds"],
        "stop_reason": summary.get("stop_reason"),
    }


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def table(results: dict[str, dict[int, dict | None]]) -> tuple[str, dict]:
    """Per-run rows and per-arm mean / std (ddof 1) of the final held-out pass@1 (all, sums,
    multiarith) and the last updates' reward."""
    lines = ["| run | held-out before -> after (all) | after: sums / multiarith | training reward per 5 updates "
             "| length last 5 | value ev / corr (last 5) | samples | s |", "|---|---|---|---|---|---|---|---|"]
    agg: dict[str, dict] = {}
    for arm, by_seed in results.items():
        finals: dict[str, list[float]] = {"all": [], "sums": [], "multiarith": [], "reward_last5": []}
        for seed, r in sorted(by_seed.items()):
            if r is None:
                continue
            b, f = r["before"], r["after"]
            lines.append(f"| {arm}_s{seed} | {fmt(b and b['all'])} -> **{fmt(f and f['all'])}** "
                         f"| {fmt(f and f['sums'])} / {fmt(f and f['multiarith'])} | "
                         f"{' -> '.join(fmt(x) for x in r['reward_by_5'])} | {fmt(r['length_last5'], 1)} | {fmt(r['value_ev_last5'])} / "
                         f"{fmt(r['value_corr_prompt_last5'])} | {r['samples']} | {r['seconds']:.0f} |")
            if f:
                for k in ("all", "sums", "multiarith"):
                    finals[k].append(f[k])
                finals["reward_last5"].append(r["reward_last5"])
        agg[arm] = {k: {"mean": statistics.fmean(v) if v else None,
                        "std": statistics.stdev(v) if len(v) > 1 else None,
                        "n": len(v)} for k, v in finals.items()}
    lines += ["", "| arm | seeds | held-out after, all (mean +- std) | sums | multiarith | reward, last 5 updates |",
              "|---|---|---|---|---|---|"]
    for arm, s in agg.items():
        cells = [f"{fmt(s[k]['mean'])} +- {fmt(s[k]['std'])}" for k in ("all", "sums", "multiarith", "reward_last5")]
        lines.append(f"| {arm} | {s['all']['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines), agg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="runs/main/export", help="the policy (a main-job export; see configs/critic_mix.yaml)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="runs/critic_methods")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--table-only", action="store_true", help="run nothing; tabulate the finished runs")
    ap.add_argument("--set", action="append", default=[], help="extra key=value for every run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="tiny model, arms grpo and sao, seed 0, 2 updates (a smoke test)")
    a = ap.parse_args()
    if a.quick:
        a.model, a.arms, a.seeds, a.steps = "tiny", "grpo,sao", "0", 2
        a.set += ["rollout.max_new_tokens=8", "run.eval_max_new_tokens=8",
                  "data.heldout_limit=4"]
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
    for arm in arms:
        arm_overrides(arm)  # unknown arms fail before anything runs
    Path(a.out).mkdir(parents=True, exist_ok=True)
    # seed-major order: every arm's first seed before any second seed (a cut-short batch stays comparable)
    queue = [(arm, seed) for seed in seeds for arm in arms]
    first_key = queue[0] if queue else None
    running: list[tuple[str, int, subprocess.Popen]] = []
    failed: list[str] = []
    while not a.table_only and (queue or running):
        while queue and len(running) < max(1, a.parallel):
            arm, seed = queue.pop(0)
            proc = run_one(arm, seed, a, first=(arm, seed) == first_key)
            if proc is not None:
                running.append((arm, seed, proc))
        time.sleep(2)
        for item in list(running):
            arm, seed, proc = item
            if proc.poll() is not None:
                running.remove(item)
                print(f"done {arm}_s{seed}: exit {proc.returncode}", flush=True)
                if proc.returncode != 0:
                    failed.append(f"{arm}_s{seed}")
    before = eval_parts(Path(a.out) / f"{first_key[0]}_s{first_key[1]}" / "eval_before.json") if first_key else None
    results = {arm: {seed: summarise(Path(a.out) / f"{arm}_s{seed}", before) for seed in seeds} for arm in arms}
    text, agg = table(results)
    print(text)
    out = {"settings": {k: v for k, v in vars(a).items()}, "runs": results, "arms": agg, "failed": failed}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    if failed:
        raise SystemExit(f"runs failed: {', '.join(failed)} (their logs: {a.out}/<run>.log)")


if __name__ == "__main__":
    main()
