#!/usr/bin/env bash
# AsyPPO's learning comparison (issue 13 section 6, "Learning"): on the main job's task
# (SmolLM2-135M-Instruct, calculator tool, MAWPS singleop), groups of 4 responses, 800 sampled
# responses per run (5 critic warm-up steps + 45 updates of 16; GRPO: 50 updates), decoupled PPO:
#   ensemble  configs/asyppo.yaml: 2 head critics (two-layer heads on the policy's detached
#             hidden states), response j -> critic j mod 2, masks k = 0.1 / h = 0.2
#   nomask    the same without the uncertainty masks (k = h = 0)
#   head1     one head critic (no ensemble, no masks)
#   full      one full critic (a copy of the policy, attention frozen)
#   grpo      configs/grpo.yaml, no critic (its runs with the same budget are in runs/sao: grpo_s0/s1)
# Sequential runs into docs/results/runs/asyppo/ (finished ones skipped), via sao_experiments.sh.
#   bash scripts/asyppo_experiments.sh "0 1" "ensemble nomask head1 full"
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS=${1:-"0 1"}
VARIANTS=${2:-"ensemble nomask head1 full"}
export OUT=docs/results/runs/asyppo
for v in $VARIANTS; do
  case $v in
    ensemble) LABEL=ensemble bash scripts/sao_experiments.sh "$SEEDS" asyppo ;;
    nomask) LABEL=nomask bash scripts/sao_experiments.sh "$SEEDS" asyppo "critic.mask_low_frac=0 critic.mask_high_frac=0" ;;
    head1) LABEL=head1 bash scripts/sao_experiments.sh "$SEEDS" asyppo "critic.num_critics=1" ;;
    full) LABEL=full bash scripts/sao_experiments.sh "$SEEDS" asyppo "critic.num_critics=1 critic.backbone=policy critic.freeze_attention=true critic.lr=5e-5" ;;
    grpo) LABEL= bash scripts/sao_experiments.sh "$SEEDS" grpo ;;
    *) echo "unknown variant $v" >&2; exit 2 ;;
  esac
done
