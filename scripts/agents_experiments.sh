#!/usr/bin/env bash
# Issue 14 section 5 (docs/results/agents.md): SmolLM2-135M-Instruct trained on `math_python`
# (MAWPS singleop with the sandboxed Python tool, fenced tool calls) with SAO (configs/sao.yaml:
# one episode per prompt, critic, skip-observation GAE) and with GRPO (configs/grpo.yaml: groups of
# 4), the same 800-episode budget as the SAO / AsyPPO comparisons on the calculator task
# (sao: 10 critic warm-up steps + 40 updates of 16 episodes; grpo: 50 updates of 16). Held-out
# pass@1 (greedy, 110 problems, episodes with the tool) before, every 10 versions and after; each
# run's metrics.jsonl carries agent/turns_mean, agent/tool_call_rate, agent/tool_call_success_rate
# and the sandbox incident counts. Needs bubblewrap. Sequential runs into docs/results/runs/agents/
# (finished ones skipped), via sao_experiments.sh (CONVEYOR_SRC= pins the code, as there).
#   bash scripts/agents_experiments.sh "0 1" "sao grpo"
set -euo pipefail
cd "$(dirname "$0")/.."
command -v bwrap >/dev/null || { echo "bubblewrap (bwrap) is needed: sudo apt-get install bubblewrap" >&2; exit 2; }
OUT=docs/results/runs/agents LABEL=math_python bash scripts/sao_experiments.sh "${1:-0 1}" "${2:-sao grpo}" "env.name=math_python"
