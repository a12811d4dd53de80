#!/usr/bin/env bash
# SAO vs GRPO vs GRPO + DIS on the main job's task (SmolLM2-135M-Instruct, calculator tool, MAWPS
# singleop), issue 11 section 5. Every run samples 800 responses: 16 per update; SAO and VAPO-style
# runs spend 10 x 16 of them on the critic warm-up and take 40 policy updates, the group runs take
# 50. Held-out accuracy (greedy, 110 problems) before, every 10 versions and after. Runs are
# sequential (one 2-core machine: wall-clock comparable) and land in docs/results/runs/sao/. The runs so far
# were made with the plain hand-out (async.wait_for_expiring=false, the default then) and the token-mean
# loss (loss.aggregation=token_mean, the critic presets' before issue 45 section 4): both pinned so
# that new runs stay comparable (an EXTRA key comes later and wins).
#   bash scripts/sao_experiments.sh "0 1" "sao grpo grpo_dis"      # seeds, presets
#   bash scripts/sao_experiments.sh 1 sao reward.overlong=soft     # extra overrides (name the run dir)
# CONVEYOR_SRC=DIR imports conveyor from a pinned checkout DIR (git worktree add --detach DIR REV) and
# records its commit in the run dir (conveyor_commit.txt).
#   LABEL=abl-k1 bash scripts/sao_experiments.sh 0 sao critic.updates_per_step=1   # run dir sao_abl-k1_s0
# OUT=DIR puts the runs elsewhere (AsyPPO's: OUT=docs/results/runs/asyppo, scripts/asyppo_experiments.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS=${1:-"0 1"}
PRESETS=${2:-"sao grpo grpo_dis"}
EXTRA=${3:-""}
OUT=${OUT:-docs/results/runs/sao}
mkdir -p "$OUT"
for seed in $SEEDS; do
  for p in $PRESETS; do
    steps=50
    case $p in sao|vapo_nodis) steps=40 ;; asyppo) steps=45 ;; esac  # (critic warm-up: 10 / 5 steps of 16)
    suffix=${LABEL:-$(echo "$EXTRA" | tr ' =.' '_-')}
    dir="$OUT/${p}${suffix:+_$suffix}_s${seed}"
    [ -f "$dir/summary.json" ] && { echo "skip $dir (done)"; continue; }
    rm -rf "$dir"
    git -C "${CONVEYOR_SRC:-.}" rev-parse HEAD > "$dir.commit"
    echo "== $p seed $seed -> $dir ($(date -u +%H:%M:%S))"
    PYTHONPATH=${CONVEYOR_SRC:+$CONVEYOR_SRC/src}${PYTHONPATH:+:$PYTHONPATH} .venv/bin/conveyor train "configs/$p.yaml" trainer.total_steps=$steps run.seed=$seed data.shuffle_seed=$seed \
      run.eval_every=10 run.checkpoint_every=1000 run.final_checkpoint=none run.export=false run.progress=false \
      async.wait_for_expiring=false loss.aggregation=token_mean run.dir="$dir" $EXTRA > "$dir.log" 2>&1 || echo "FAILED $p seed $seed (see $dir.log)"
    rm -rf "$dir/checkpoints"
    mv "$dir.log" "$dir/console.log" 2>/dev/null || true
    mv "$dir.commit" "$dir/conveyor_commit.txt" 2>/dev/null || true
  done
done
