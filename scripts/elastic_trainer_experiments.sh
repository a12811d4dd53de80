#!/usr/bin/env bash
# Issue 16, docs/results/main_job.md section 14: the default main job (30 updates, no held-out
# evaluations) with the trainer borrowing the idle engine's threads during its updates
# (trainer.elastic_threads=true, arm "on") against without ("off"); arm "both" adds
# rollout.elastic_threads=true (the engine borrows the trainer's threads while it waits for a
# batch), arm "ref" adds trainer.reference_scoring=background to "on"; arms "bf16" / "bf16_on" are
# "off" / "on" with the engine following the bf16 trainer (rollout.engine_dtype=auto: a faster
# engine that idles more, section 12). One run at a time, each by scripts/main_job_at.sh (under
# /usr/bin/time -v: peak resident memory in console.log); run directories
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
# the KL reference in the update, as when section 14 was measured (the default is auto since section 18)
upd="trainer.reference_scoring=update"
for seed in $SEEDS; do
  for arm in $ARMS; do
    case $arm in
      off) opts="trainer.elastic_threads=false $upd" ;;
      on) opts="trainer.elastic_threads=true $upd" ;;
      both) opts="trainer.elastic_threads=true rollout.elastic_threads=true $upd" ;;
      ref) opts="trainer.elastic_threads=true trainer.reference_scoring=background" ;;
      bf16) opts="trainer.elastic_threads=false rollout.engine_dtype=auto $upd" ;;
      bf16_on) opts="trainer.elastic_threads=true rollout.engine_dtype=auto $upd" ;;
      *) echo "unknown arm $arm" >&2; exit 2 ;;
    esac
    OUT=$OUT bash scripts/main_job_at.sh "${CONVEYOR_SRC:-$PWD}" "elastic_$arm" "$seed" $opts
  done
done
