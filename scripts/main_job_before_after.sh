#!/usr/bin/env bash
# The full main job before / after issue 16's options, one run after the other, for each seed
# (docs/results/main_job.md sections 6-7). Each run's peak memory comes from /usr/bin/time -v.
#   bash scripts/main_job_before_after.sh "0 1" [OUT_DIR]
#   python scripts/compare_runs.py OUT_DIR/* --table
set -u
SEEDS=${1:-0}
OUT=${2:-runs/main_job}
mkdir -p "$OUT"
BEFORE="rollout.prefix_cache_tokens=0 async.wait_for_expiring=false"  # the defaults before issue 16
AFTER="rollout.engine_dtype=auto rollout.priority=oldest_first async.wait_for_expiring=true"
for seed in $SEEDS; do
  for arm in before after; do
    opts=$BEFORE; [ "$arm" = after ] && opts=$AFTER
    dir="$OUT/${arm}_s${seed}"
    echo "== $arm seed $seed -> $dir ($(date -u +%H:%M:%S)): conveyor train $opts run.seed=$seed data.shuffle_seed=$seed"
    /usr/bin/time -v .venv/bin/conveyor train $opts run.seed=$seed data.shuffle_seed=$seed run.dir="$dir" \
      > "$dir.log" 2>&1 || echo "FAILED $arm seed $seed (see $dir.log)"
  done
done
