#!/usr/bin/env bash
# The default main job (30 updates, no evaluations) with conveyor imported from commit REV (a
# detached worktree in /tmp/conveyor-REV; REV may also be a checkout's directory, used as it is), into
# docs/results/runs/main_job/amd_NAME_sSEED, with /usr/bin/time -v (peak memory). Extra
# arguments are config overrides. EVAL_AFTER=true adds the held-out evaluation after training (the
# one before is the base model's, 0.218 in every run, and stays off). One run at a time; for
# before / after pairs of engine changes:
#   bash scripts/main_job_at.sh 1896bd2 engine15_before 0
#   bash scripts/main_job_at.sh 9f3a96d engine15_after 0
#   python scripts/main_job_costs.py docs/results/runs/main_job/amd_engine15_*
set -euo pipefail
cd "$(dirname "$0")/.."
REV=$1; NAME=$2; SEED=${3:-0}; shift 3 || shift $#
OUT=${OUT:-docs/results/runs/main_job}
if [ -d "$REV" ]; then src=$REV; else
  src=/tmp/conveyor-$REV
  [ -d "$src" ] || git worktree add --detach "$src" "$REV" >/dev/null
fi
dir="$OUT/amd_${NAME}_s${SEED}"
[ -f "$dir/summary.json" ] && { echo "skip $dir (done)"; exit 0; }
rm -rf "$dir"
mkdir -p "$OUT"
git -C "$src" rev-parse HEAD > "$dir.commit"
echo "== $NAME seed $SEED at $REV -> $dir ($(date -u +%H:%M:%S))"
PYTHONPATH=$src/src${PYTHONPATH:+:$PYTHONPATH} /usr/bin/time -v .venv/bin/conveyor train "$@" \
  run.seed=$SEED data.shuffle_seed=$SEED run.eval_before=false run.eval_after=${EVAL_AFTER:-false} run.export=false \
  run.final_checkpoint=none run.checkpoint_every=1000 run.progress=false run.dir="$dir" > "$dir.log" 2>&1 \
  || echo "FAILED $NAME seed $SEED (see $dir.log)"
rm -rf "$dir/checkpoints" "$dir/run.lock"
mv "$dir.log" "$dir/console.log" 2>/dev/null || true
mv "$dir.commit" "$dir/conveyor_commit.txt" 2>/dev/null || true
