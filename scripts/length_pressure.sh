#!/usr/bin/env bash
# Issue 45 section 4 (docs/results/critics.md): the length pressure of a critic that is wrong, on
# `math_python` (MAWPS singleop with the sandboxed Python tool). SAO (configs/sao.yaml) at the
# 320-episode budget of docs/results/agents.md (4 critic warm-up steps + 16 updates of 16
# episodes; held-out pass@1 after only), one seed per variant:
#   base       the token-mean loss sao_experiments.sh pins (a failed episode's summed advantage ~ -V x length)
#   seqmean    loss.aggregation=seq_mean_token_mean (each episode weighs the same, whatever its length;
#              configs/sao.yaml's default since this experiment)
#   bounds     critic.value_bounds=[0,1] (the values clamped to the reward's range), token-mean loss
# Runs in docs/results/runs/critics/sao_length_<variant>_s<seed>/ (finished ones skipped), via
# sao_experiments.sh (CONVEYOR_SRC= pins the code, as there). Needs bubblewrap. ~50 min a run on the
# 2-core VM (about 15 GB of memory each: one at a time on a 24 GB machine). The drift: per update
# agent/turns_mean, agent/tool_call_rate, response/length_mean, advantage/length_corr and
# advantage/sum_unrewarded in each run's metrics.jsonl; a table by windows of updates:
#   python scripts/length_table.py docs/results/runs/critics/sao_length_*_s0
#   bash scripts/length_pressure.sh 0 "seqmean bounds base"
set -euo pipefail
cd "$(dirname "$0")/.."
command -v bwrap >/dev/null || { echo "bubblewrap (bwrap) is needed: sudo apt-get install bubblewrap" >&2; exit 2; }
X="env.name=math_python run.eval_every=1000 run.eval_before=false critic.warmup_steps=4 trainer.total_steps=16"
for v in ${2:-seqmean bounds base}; do
  case $v in
    base) extra="" ;;
    seqmean) extra="loss.aggregation=seq_mean_token_mean" ;;
    bounds) extra="critic.value_bounds=[0,1]" ;;
    *) echo "variants: base seqmean bounds, got $v" >&2; exit 2 ;;
  esac
  # sao_experiments.sh fixes the step count per preset; the 320-episode budget's comes last (later wins)
  OUT=docs/results/runs/critics LABEL=length_$v bash scripts/sao_experiments.sh "${1:-0}" sao "$X $extra"
done
