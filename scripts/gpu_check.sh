#!/usr/bin/env bash
# The GPU checks of issue 15 as one prepared script, for a lent GPU machine that has torch,
# transformers and peft but no internet (docs/results/gpu.md):
#   1. tests/test_gpu.py: the engine and the trainer on CUDA against the CPU;
#   2. benchmarks/gpu.py: bf16 peak, engine and trainer tokens/s, MFU, async / sync ratio on
#      random-weight models of SmolLM2's shape and a ~1.5 B Qwen2 shape;
#   3. scripts/hf_compiled_decode_probe.py: transformers' decoding eager and as a CUDA graph
#      (static cache + torch.compile), what graphs would buy the engine (GPU_PROBE_TIMEOUT=0 skips).
# Prepare on a machine with the package index (the wheels the GPU image lacks, the shape
# directories), then carry .gpu to the GPU machine and run this script there from the repo root:
#   bash scripts/gpu_check.sh prepare        # here: .gpu/whl, .gpu/models
#   OUT=/some/dir bash scripts/gpu_check.sh  # there: results under $OUT
# Extra arguments after `run` go to benchmarks/gpu.py (e.g. --sections peak,engine).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-run}" = prepare ]; then
  set -e
  # what conveyor imports and a PyTorch image may lack (pydantic, math-verify and their needs),
  # as wheels for the GPU machine's Python (3.12, x86-64)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/whl \
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
  .venv/bin/python scripts/shape_models.py .gpu/models
  exit 0
fi
[ "${1:-run}" = run ] && shift || true
OUT=${OUT:-/tmp/conveyor_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CONVEYOR_SHAPE_MODELS=$PWD/.gpu/models CONVEYOR_CACHE=/tmp/conveyor_cache
if ls .gpu/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
    || echo "wheel install failed"
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
{ nvidia-smi; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"; } \
  > "$OUT/env.txt" 2>&1
T0=$(date +%s)
timeout "${GPU_TEST_TIMEOUT:-180}" python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -o addopts="-ra" \
  2>&1 | tee "$OUT/pytest.log" | tail -40
echo "tests: $(( $(date +%s) - T0 )) s"
T0=$(date +%s)
timeout "${GPU_BENCH_TIMEOUT:-330}" python3 benchmarks/gpu.py --out "$OUT/gpu.json" "$@" 2>&1 | tee "$OUT/bench.log" | tail -30
echo "benchmarks: $(( $(date +%s) - T0 )) s"
if [ "${GPU_PROBE_TIMEOUT:-200}" -gt 0 ]; then
  T0=$(date +%s)
  timeout "${GPU_PROBE_TIMEOUT:-200}" python3 scripts/hf_compiled_decode_probe.py .gpu/models/smollm2-135m \
    --variants static_compiled,dynamic,static_eager --repeats 2 2>&1 | tee "$OUT/compiled_probe.txt" | grep -v Warning
  echo "probe: $(( $(date +%s) - T0 )) s"
fi
