#!/usr/bin/env bash
# Issue 13 section 6, "the controller on vs off": AsyPPO's adaptive async-ratio controller
# (async.adaptive=true: eta = floor(ratio x eta_max), eta_max 4, ratio from 0.7, one step of 0.1
# toward on-policy when the batch reward variance exceeds 0.15, else away) against fixed eta 2 and
# fixed eta 4, on configs/asyppo.yaml's setting (2 head critics, masks, groups of 4) at the same
# 800-response budget (5 critic warm-up steps + 45 updates of 16). Compare wall-clock to the same
# training reward, held-out pass@1 after, and the eta trace (events.jsonl: the eta events with
# their reasons). Sequential runs into docs/results/runs/controller/ (finished ones skipped), via
# sao_experiments.sh (CONVEYOR_SRC= pins the code, as there).
#   bash scripts/controller_experiments.sh "0 1" "adaptive eta2 eta4"
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS=${1:-"0 1"}
export OUT=docs/results/runs/controller
for v in ${2:-adaptive eta2 eta4}; do
  case $v in
    adaptive) LABEL=adaptive bash scripts/sao_experiments.sh "$SEEDS" asyppo "async.adaptive=true async.eta_max=4" ;;
    eta2) LABEL=eta2 bash scripts/sao_experiments.sh "$SEEDS" asyppo "async.eta=2" ;;
    eta4) LABEL=eta4 bash scripts/sao_experiments.sh "$SEEDS" asyppo "async.eta=4" ;;
    *) echo "unknown variant $v" >&2; exit 2 ;;
  esac
done
