#!/usr/bin/env bash
# Every performance figure of docs/results/performance.md, in one go (run on a quiet machine).
# Usage: bash scripts/perf_benchmarks.sh [OUT_DIR]   (default docs/results/perf)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/results/perf}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
export OMP_WAIT_POLICY=PASSIVE
$PY benchmarks/engine.py --model smollm2-135m-instruct --output "$OUT/engine_smollm2.json"
$PY benchmarks/engine.py --model tiny --requests 128 --output "$OUT/engine_tiny.json"
$PY benchmarks/trainer.py --model smollm2-135m-instruct --updates 3 --output "$OUT/trainer_smollm2.json"
# the same with tcmalloc preloaded into every child (apt-get install libtcmalloc-minimal4), if present
if ls /usr/lib/*/libtcmalloc_minimal.so.4 /usr/lib/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  $PY benchmarks/trainer.py --model smollm2-135m-instruct --updates 3 --allocator tcmalloc --output "$OUT/trainer_smollm2_tcmalloc.json"
fi
$PY benchmarks/weight_sync.py --model smollm2-135m-instruct --output "$OUT/weight_sync_smollm2.json"
$PY benchmarks/proximal_costs.py --model tiny --output "$OUT/proximal_costs_tiny.json"
$PY benchmarks/proximal_costs.py --model smollm2-135m-instruct --sequences 8 --steps 1 --output "$OUT/proximal_costs_smollm2.json"
$PY benchmarks/async_vs_sync.py --model smollm2-135m-instruct --out runs/bench_async_vs_sync
cp runs/bench_async_vs_sync/summary.json "$OUT/async_vs_sync_smollm2.json"
