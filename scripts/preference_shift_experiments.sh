#!/usr/bin/env bash
# Issue 13 section 5 / 6, "Preference shift": SAO (a critic, configs/preference_shift.yaml) against
# the sliding-window baseline (no critic) on the style task, 120 updates of 16 responses (SAO adds
# 10 critic warm-up steps), target style switching every 40 versions (cute -> chuunibyou ->
# classical). Sequential runs into docs/results/runs/preference_shift/ (finished ones skipped);
# CONVEYOR_SRC=DIR imports conveyor from a pinned checkout (git worktree add --detach DIR REV) and
# records its commit in the run dir. Then, per run:
#   python scripts/preference_shift.py RUN --smooth 4 --heldout
#   bash scripts/preference_shift_experiments.sh "0 1" "sao window"
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS=${1:-"0 1"}
VARIANTS=${2:-"sao window"}
OUT=${OUT:-docs/results/runs/preference_shift}
mkdir -p "$OUT"
for seed in $SEEDS; do
  for v in $VARIANTS; do
    case $v in
      sao) EXTRA="" ;;
      window) EXTRA="loss.advantage=sliding_window critic.warmup_steps=0" ;;
      *) echo "unknown variant $v" >&2; exit 2 ;;
    esac
    # loss.aggregation=token_mean: the preset's before issue 45 section 4, which the documented runs used
    dir="$OUT/${v}_s${seed}"
    [ -f "$dir/summary.json" ] && { echo "skip $dir (done)"; continue; }
    rm -rf "$dir"
    git -C "${CONVEYOR_SRC:-.}" rev-parse HEAD > "$dir.commit"
    echo "== $v seed $seed -> $dir ($(date -u +%H:%M:%S))"
    PYTHONPATH=${CONVEYOR_SRC:+$CONVEYOR_SRC/src}${PYTHONPATH:+:$PYTHONPATH} .venv/bin/conveyor train \
      configs/preference_shift.yaml run.seed=$seed data.shuffle_seed=$seed loss.aggregation=token_mean \
      run.checkpoint_every=1000 run.final_checkpoint=none run.export=false run.progress=false \
      run.dir="$dir" $EXTRA > "$dir.log" 2>&1 || echo "FAILED $v seed $seed (see $dir.log)"
    rm -rf "$dir/checkpoints"
    mv "$dir.log" "$dir/console.log" 2>/dev/null || true
    mv "$dir.commit" "$dir/conveyor_commit.txt" 2>/dev/null || true
  done
done
