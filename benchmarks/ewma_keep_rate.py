"""Why does the EWMA proximal policy reset so often? (issue 10, section 5c)

Usage: python benchmarks/ewma_keep_rate.py [--model smollm2-135m-instruct] [--eta 4] [--steps 12]
       [--lr 3e-5] [--quick] [--out DIR]

Runs the ``ewma`` cell of the staleness grid (``benchmarks/staleness_robustness.py``: MAWPS
prompts, format reward, 3 prompts x 8 responses, ``max_new_tokens=32``, T 0.7, two-ratio loss,
one engine and one trainer thread) and, on every batch before its update, measures the
discrepancy keep-rate -- the share of response tokens with ``pi_x / pi_behav`` inside the
two-ratio band ``[loss.discrepancy_low, loss.discrepancy_high]`` (default [0.8, 1.25]), the
quantity the EWMA auto-reset compares with ``proximal.ewma_reset_keep_rate`` (0.90) -- for
several candidate proximal policies ``pi_x`` on the same tokens:

* ``active``: the run's own EWMA (``proximal.method=ewma``; since issue 10 the rule of
  MISSION.md section 2: updated after every optimiser step, ``W`` = the window in optimiser steps);
* ``current``: the trainer's current parameters (version v). On tokens sampled by version v
  this is the exact pi_old_train, so its keep-rate at lag 0 is the floor set by the
  training / inference numerics alone; at lag k it shows how far k updates move the policy;
* ``ewma_w_s1`` (``--shadows``, default): a shadow bias-corrected EWMA with
  ``beta = W / (W + 2)``, W = the batch's largest staleness + 1 (the rule before issue 10), with
  its own auto-reset at the same threshold;
* ``ewma_w_s`` (optional shadow): the same with W = the largest staleness (the active rule; a
  check of the active EWMA, or the new rule when run against older code).

With one optimiser step per update (the grid's setting) "per optimiser step" and "per version"
coincide, so the shadows differ only in W. Every keep-rate is also split by the token's lag
(trainer version - the version that sampled it). Writes ``steps.jsonl`` (one row per update)
and ``summary.json`` under ``--out`` and prints the summary: resets per rule and the mean
keep-rate per rule and lag.

Recorded runs: docs/results/proximal.md, "EWMA: as specified, and why the auto-reset fires"
(data in docs/results/ewma_keep_rate/).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

LAGS = ("0", "1", "2", "3", "4+")
SHADOWS = {"ewma_w_s": 0, "ewma_w_s1": 1}  # name -> offset of W from the largest staleness


class ShadowEWMA:
    """A bias-corrected parameter EWMA (MISSION.md section 2) kept beside the run, with its own
    auto-reset; ``offset`` = 0 for W = largest staleness, 1 for W = largest staleness + 1."""

    def __init__(self, model: torch.nn.Module, offset: int, threshold: float):
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.offset, self.threshold = offset, threshold
        self.norm = 1.0  # W_t of the bias correction
        self.resets = 0

    @torch.no_grad()
    def after_update(self, model: torch.nn.Module, staleness_max: int, keep: float) -> bool:
        """Reset (returns True) if ``keep`` is below the threshold, else one EWMA step."""
        if keep < self.threshold:
            self.model.load_state_dict(model.state_dict())
            self.norm = 1.0
            self.resets += 1
            return True
        window = staleness_max + self.offset
        beta = window / (window + 2.0)
        prev = self.norm
        self.norm = beta * prev + 1.0
        a = beta * prev / self.norm
        src = model.state_dict()
        done: set[int] = set()
        for k, t in self.model.state_dict().items():
            if t.data_ptr() in done:  # tied weights: one tensor, one update
                continue
            done.add(t.data_ptr())
            if t.is_floating_point():
                t.mul_(a).add_(src[k].to(t.dtype), alpha=1.0 / self.norm)
            else:
                t.copy_(src[k])
        return False


def _keep_counts(lp, mb, lo, hi, version):
    """``{lag: [kept, counted]}`` for log-probs ``lp`` of micro-batch ``mb``."""
    m = mb.mask > 0
    rho = torch.exp((lp.float() - mb.behaviour_logprobs.float()).clamp(-20, 20))
    ok = (rho >= lo) & (rho <= hi) & m
    lag = (version - mb.versions).clamp(min=0)
    out = {}
    for i, name in enumerate(LAGS):
        sel = m & ((lag >= 4) if name == "4+" else (lag == i))
        out[name] = [int((ok & sel).sum()), int(sel.sum())]
    return out


def instrument(trainer, rows: list[dict], threshold: float, shadow_names=("ewma_w_s1",)) -> None:
    """Wrap ``trainer.proximal`` (an EWMA strategy) to measure the keep-rates of the candidates."""
    prox = trainer.proximal
    lo, hi = trainer.loss_cfg.discrepancy_low, trainer.loss_cfg.discrepancy_high
    shadows = {name: ShadowEWMA(trainer.model, SHADOWS[name], threshold) for name in shadow_names}
    acc: dict[str, dict[str, list[int]]] = {}
    orig_old, orig_after = prox.old_logprobs, prox.after_update

    def add(name, counts):
        tgt = acc.setdefault(name, {k: [0, 0] for k in LAGS})
        for k, (a, b) in counts.items():
            tgt[k][0] += a
            tgt[k][1] += b

    def old_logprobs(tr, mb):
        lp = orig_old(tr, mb)
        add("active", _keep_counts(lp, mb, lo, hi, tr.version))
        with torch.no_grad():
            cur, _ = tr._logprobs(tr.model, mb)
            add("current", _keep_counts(cur, mb, lo, hi, tr.version))
            for name, sh in shadows.items():
                slp, _ = tr._logprobs(sh.model, mb)
                add(name, _keep_counts(slp, mb, lo, hi, tr.version))
        return lp

    def after_update(model, new_version, metrics):
        def rate(c, lag=None):
            kept = sum(c[k][0] for k in LAGS) if lag is None else c[lag][0]
            n = sum(c[k][1] for k in LAGS) if lag is None else c[lag][1]
            return kept / n if n else None

        row = {
            "version": new_version,
            "staleness_max": metrics.get("staleness/max"),
            "staleness_mean": metrics.get("staleness/mean"),
            "reward": metrics.get("reward/mean"),
            "tokens_by_lag": {k: acc["current"][k][1] for k in LAGS},
        }
        for name, c in acc.items():
            row[f"keep/{name}"] = rate(c)
            row[f"keep_by_lag/{name}"] = {k: rate(c, k) for k in LAGS}
        for name, sh in shadows.items():
            row[f"reset/{name}"] = sh.after_update(
                model, int(metrics.get("staleness/max", 0)), rate(acc[name])
            )
        st = orig_after(model, new_version, metrics)
        row["reset/active"] = any(e.get("event") == "ewma_reset" for e in st.events)
        row["active_beta"] = st.values.get("proximal/ewma_beta")
        rows.append(row)
        acc.clear()
        print(
            json.dumps(
                {
                    k: (round(v, 4) if isinstance(v, float) else v)
                    for k, v in row.items()
                    if not k.startswith("keep_by_lag")
                }
            ),
            flush=True,
        )
        return st

    prox.old_logprobs, prox.after_update = old_logprobs, after_update


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--eta", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument(
        "--threshold", type=float, default=0.90, help="proximal.ewma_reset_keep_rate (all rules)"
    )
    ap.add_argument("--shadows", default="ewma_w_s1", help="shadow rules: ewma_w_s1, ewma_w_s")
    ap.add_argument(
        "--quick", action="store_true", help="tiny model, 2 steps, eta 1 (CI smoke run)"
    )
    ap.add_argument("--out", default="runs/bench_ewma_keep_rate")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.eta = "tiny", 2, 1
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    overrides = [
        f"model.name={args.model}",
        f"trainer.total_steps={args.steps}",
        "trainer.batch_size=3",
        "rollout.group_size=8",
        "rollout.max_new_tokens=32",
        "reward.fn=format",
        f"trainer.lr={args.lr}",
        "trainer.warmup_steps=0",
        "trainer.num_threads=1",
        "rollout.engine_threads=1",
        "rollout.temperature=0.7",
        "rollout.tool=none",
        "loss.kl_coef=0",
        "loss.name=two_ratio",
        "proximal.method=ewma",
        f"proximal.ewma_reset_keep_rate={args.threshold}",
        f"async.eta={args.eta}",
        "run.eval_before=false",
        "run.eval_after=false",
        "run.export=false",
        "run.progress=false",
        "run.checkpoint_every=1000",
        f"run.dir={out / 'run'}",
    ]
    from conveyor import train as train_mod
    from conveyor.config import load_config

    rows: list[dict] = []
    shadows = [x for x in args.shadows.split(",") if x]
    if unknown := set(shadows) - set(SHADOWS):
        raise SystemExit(f"--shadows: unknown {sorted(unknown)}; choose from {sorted(SHADOWS)}")
    base = train_mod.Trainer

    class Instrumented(base):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            instrument(self, rows, args.threshold, shadows)

    train_mod.Trainer = Instrumented
    try:
        train_mod.run_training(load_config(None, overrides))
    finally:
        train_mod.Trainer = base
    with (out / "steps.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    rules = [k.split("/", 1)[1] for k in rows[0] if k.startswith("keep/")]
    summary = {
        "args": vars(args),
        "updates": len(rows),
        "resets": {r: sum(bool(x.get(f"reset/{r}")) for x in rows) for r in ["active", *shadows]},
        "mean_keep": {r: sum(x[f"keep/{r}"] for x in rows) / len(rows) for r in rules},
    }
    lag_tok = {k: sum(x["tokens_by_lag"][k] for x in rows) for k in LAGS}
    summary["tokens_by_lag"] = lag_tok
    summary["mean_keep_by_lag"] = {}
    for r in rules:  # token-weighted over the run
        summary["mean_keep_by_lag"][r] = {}
        for k in LAGS:
            num = sum(
                x[f"keep_by_lag/{r}"][k] * x["tokens_by_lag"][k]
                for x in rows
                if x[f"keep_by_lag/{r}"][k] is not None
            )
            summary["mean_keep_by_lag"][r][k] = num / lag_tok[k] if lag_tok[k] else None
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
