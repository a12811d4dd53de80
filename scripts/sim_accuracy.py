"""The simulator's accuracy on real runs, with and without a shared prompt prefill
(docs/results/performance.md section 5): calibrate ``conveyor simulate`` from the first run
directory, predict every listed run's wall-clock at its own eta (mean of --seeds simulator seeds)
with ``rollout.shared_prefill`` true and false, and print the error and busy fractions.

Usage: python scripts/sim_accuracy.py CALIBRATION_RUN_DIR [OTHER_RUN_DIR ...] [--seeds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from conveyor.simulate import calibrate, simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run directories written by conveyor train; the first calibrates")
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    base = calibrate(args.runs[0])
    for shared in (False, True):
        for run in args.runs:
            conf = json.loads((Path(run) / "config.json").read_text())
            summ = json.loads((Path(run) / "summary.json").read_text())
            cfg = base.model_copy(deep=True)
            cfg.eta = conf["async"]["eta"]
            cfg.rollout.shared_prefill = shared
            results = []
            for seed in range(args.seeds):
                cfg.seed = seed
                results.append(simulate(cfg))
            wall = statistics.fmean(r.wall_seconds for r in results)
            print(json.dumps({
                "shared_prefill": shared, "run": Path(run).name, "eta": cfg.eta, "measured_s": round(summ["wall_seconds"], 1),
                "predicted_s": round(wall, 1), "error": round(wall / summ["wall_seconds"] - 1, 3),
                "engine_busy": [round(summ["engine_busy"], 2), round(statistics.fmean(r.rollout_busy for r in results), 2)],
                "trainer_busy": [round(summ["trainer_busy"], 2), round(statistics.fmean(r.trainer_busy for r in results), 2)],
            }))


if __name__ == "__main__":
    main()
