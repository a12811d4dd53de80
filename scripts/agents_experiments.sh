#!/usr/bin/env bash
# Issue 14 section 5 (docs/results/agents.md): SmolLM2-135M-Instruct trained on `math_python`
# (MAWPS singleop with the sandboxed Python tool, fenced tool calls) with SAO (configs/sao.yaml:
# one episode per prompt, critic, skip-observation GAE) and with GRPO (configs/grpo.yaml: groups of
# 4). Each run's metrics.jsonl carries agent/turns_mean, agent/tool_call_rate,
# agent/tool_call_success_rate and the sandbox incident counts. Needs bubblewrap. Sequential runs
# into docs/results/runs/agents/ (finished ones skipped), via sao_experiments.sh (CONVEYOR_SRC= pins
# the code, as there). Two budgets:
#   BUDGET=800 (default): the 800-episode budget of the SAO / AsyPPO comparisons on the calculator
#     task (sao: 10 critic warm-up steps + 40 updates of 16; grpo: 50 updates of 16), held-out
#     pass@1 (greedy, 110 problems, episodes with the tool) before, every 10 versions and after;
#     about 2.5 h a run on the 2-core VM (episodes of ~240 tokens at ~25 tokens/s).
#   BUDGET=320: what fits a 3-hour session, 320 episodes a run (sao: 4 warm-up steps + 16 updates
#     of 16; grpo: 20 updates of 16), held-out pass@1 after training only (before: the base model's
#     figure, runs/agents/eval_smollm2_math_python_mawps_heldout_greedy.json, the same settings).
#   bash scripts/agents_experiments.sh "0 1" "sao grpo"
#   BUDGET=320 bash scripts/agents_experiments.sh 0 "sao grpo"
set -euo pipefail
cd "$(dirname "$0")/.."
command -v bwrap >/dev/null || { echo "bubblewrap (bwrap) is needed: sudo apt-get install bubblewrap" >&2; exit 2; }
case ${BUDGET:-800} in
  800) OUT=docs/results/runs/agents LABEL=math_python bash scripts/sao_experiments.sh "${1:-0 1}" "${2:-sao grpo}" "env.name=math_python" ;;
  320)
    X="env.name=math_python run.eval_every=1000 run.eval_before=false"
    for p in ${2:-sao grpo}; do
      case $p in
        sao) extra="critic.warmup_steps=4 trainer.total_steps=16" ;;
        grpo) extra="trainer.total_steps=20" ;;
        *) echo "BUDGET=320 knows sao and grpo, got $p" >&2; exit 2 ;;
      esac
      OUT=docs/results/runs/agents LABEL=math_python_e320 bash scripts/sao_experiments.sh "${1:-0}" "$p" "$X $extra"
    done ;;
  *) echo "BUDGET must be 800 or 320, got ${BUDGET}" >&2; exit 2 ;;
esac
