#!/usr/bin/env bash
# Baseline evaluation of the default model (greedy) on MAWPS singleop, SVAMP and a GSM8K test
# subset; writes docs/results/eval_*.json. Run from the repository root after scripts/install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
C=.venv/bin/conveyor
OUT=docs/results
$C eval --dataset mawps:singleop --max-new-tokens 128 --no-progress -o $OUT/eval_smollm2_mawps_singleop.json
$C eval --dataset svamp --n 300 --max-new-tokens 128 --no-progress -o $OUT/eval_smollm2_svamp300.json
$C eval --dataset gsm8k:test --n 100 --max-new-tokens 256 --no-progress -o $OUT/eval_smollm2_gsm8k100.json
