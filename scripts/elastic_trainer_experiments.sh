#!/usr/bin/env bash
# Issue 16, docs/results/main_job.md section 14: the default main job (30 updates, no held-out
# evaluations) with the trainer borrowing the idle engine's threads during its updates
# (trainer.elastic_threads=true, arm "on") against without ("off"); arm "both" adds
# rollout.elastic_threads=true (the engine borrows the trainer's threads while it waits for a
# batch), arm "ref" adds trainer.reference_scoring=background to "on"; arms "bf16" / "bf16_on" are
# "off" / "on" with the engine following the bf16 trainer (rollout.engine_dtype=auto: a faster
# engine that idles more, section 12). One run at a time, each
# under /usr/bin/time -v (peak resident memory in console.log); run directories
# $OUT/amd_elastic_<arm>_s<seed> (finished ones skipped), no checkpoints. CONVEYOR_SRC= pins the
# code (a worktree), as in sao_experiments.sh. Compare:
#   python scripts/main_job_costs.py docs/results/runs/main_job/amd_elastic_*
#   bash scripts/elastic_trainer_experiments.sh "0 1" "off on"
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS=${1:-"0 1"}
ARMS=${2:-"off on"}
OUT=${OUT:-docs/results/runs/main_job}
mkdir -p "$OUT"
for seed in $SEEDS; do
  for arm in $ARMS; do
    case $arm in
      off) opts="trainer.elastic_threads=false" ;;
      on) opts="trainer.elastic_threads=true" ;;
      both) opts="trainer.elastic_threads=true rollout.elastic_threads=true" ;;
      ref) opts="trainer.elastic_threads=true trainer.reference_scoring=background" ;;
      bf16) opts="trainer.elastic_threads=false rollout.engine_dtype=auto" ;;
      bf16_on) opts="trainer.elastic_threads=true rollout.engine_dtype=auto" ;;
      *) echo "unknown arm $arm" >&2; exit 2 ;;
    esac
    dir="$OUT/amd_elastic_${arm}_s${seed}"
    [ -f "$dir/summary.json" ] && { echo "skip $dir (done)"; continue; }
    rm -rf "$dir"
    git -C "${CONVEYOR_SRC:-.}" rev-parse HEAD > "$dir.commit"
    echo "== $arm seed $seed -> $dir ($(date -u +%H:%M:%S))"
    PYTHONPATH=${CONVEYOR_SRC:+$CONVEYOR_SRC/src}${PYTHONPATH:+:$PYTHONPATH} /usr/bin/time -v .venv/bin/conveyor train $opts \
      run.seed=$seed data.shuffle_seed=$seed run.eval_before=false run.eval_after=false run.export=false \
      run.final_checkpoint=none run.checkpoint_every=1000 run.progress=false run.dir="$dir" > "$dir.log" 2>&1 \
      || echo "FAILED $arm seed $seed (see $dir.log)"
    rm -rf "$dir/checkpoints" "$dir/run.lock"
    mv "$dir.log" "$dir/console.log" 2>/dev/null || true
    mv "$dir.commit" "$dir/conveyor_commit.txt" 2>/dev/null || true
  done
done
