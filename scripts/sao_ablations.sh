#!/usr/bin/env bash
# SAO ablations (issue 11 section 5): each changes one thing of configs/sao.yaml at the same sample
# budget (800 sampled responses: a run without the critic warm-up takes 50 policy updates instead
# of 10 warm-up steps + 40). Runs go through scripts/sao_experiments.sh (same pinned settings,
# held-out evaluations every 10 versions) and land in docs/results/runs/sao/sao_abl-NAME_sS.
#   bash scripts/sao_ablations.sh "0 1" "baseline k1 attention_trained no_warmup sliding_window naive_gae"
# With CONVEYOR_SRC=DIR the runs import conveyor from DIR (a pinned checkout: git worktree add --detach DIR REV),
# so the code can change while a queue of runs goes on.
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS=${1:-"0 1"}
NAMES=${2:-"baseline k1 attention_trained no_warmup sliding_window naive_gae"}
overrides() {
  case $1 in
    baseline) echo "" ;;                                                 # configs/sao.yaml itself, same code
    k1) echo "critic.updates_per_step=1" ;;                              # K = 1 critic update per policy update
    attention_trained) echo "critic.freeze_attention=false" ;;           # the critic's attention trains too
    no_warmup) echo "critic.warmup_steps=0 trainer.total_steps=50" ;;    # no critic warm-up
    sliding_window) echo "loss.advantage=sliding_window critic.warmup_steps=0 trainer.total_steps=50" ;;  # no critic
    naive_gae) echo "critic.skip_observations=false" ;;                  # the TD chain runs through observations
    *) echo "unknown ablation $1 (baseline k1 attention_trained no_warmup sliding_window naive_gae)" >&2; exit 2 ;;
  esac
}
for seed in $SEEDS; do
  for name in $NAMES; do
    extra=$(overrides "$name")
    LABEL="abl-$name" bash scripts/sao_experiments.sh "$seed" sao "$extra"
  done
done
