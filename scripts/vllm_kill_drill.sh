#!/usr/bin/env bash
# Kill drill: the vLLM server killed with SIGKILL mid-run; the run must stop with a checkpoint and a clear
# error (non-zero exit); then --resume continues with a new server, and no group is trained twice.
cd "$(dirname "$0")/.."
RUN=${RUN:-/tmp/conveyor_vllm_drill}; rm -rf $RUN
.venv/bin/conveyor train rollout.engine=vllm trainer.total_steps=6 run.eval_before=false run.eval_after=false \
  run.export=false run.checkpoint_every=1 run.progress=false run.dir=$RUN > $RUN.first.out 2>&1 &
TP=$!
while [ "$(wc -l < $RUN/metrics.jsonl 2>/dev/null || echo 0)" -lt 3 ]; do sleep 2; done
SP=$(grep -o "pid [0-9]*)" $RUN/train.log | head -1 | tr -dc 0-9)
echo "killing vLLM server pid $SP at $(date -u +%T) after $(wc -l < $RUN/metrics.jsonl) steps"
kill -9 $SP
wait $TP; echo "train exit code $?"
tail -6 $RUN.first.out
ls $RUN/checkpoints
ps aux | grep -c "[V]LLM::"
.venv/bin/conveyor train --resume $RUN > $RUN.resume.out 2>&1; echo "resume exit code $?"
tail -3 $RUN.resume.out
.venv/bin/python - <<PY
import json
rows=[json.loads(l) for l in open("$RUN/trained.jsonl")]
groups=[g["group"] for r in rows for g in r.get("groups",[])]
print("trained rows", len(rows), "groups", len(groups), "distinct", len(set(groups)))
print("steps", [json.loads(l)["step"] for l in open("$RUN/metrics.jsonl")])
PY
