#!/usr/bin/env bash
# Failure handling on the tiny model (fast): reward exceptions / timeouts, non-finite losses,
# kill -9 then --resume. Writes its runs under ${OUT:-/tmp/conveyor-failures}; prints a summary.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/conveyor-failures}
rm -rf "$OUT"; mkdir -p "$OUT"
C=.venv/bin/conveyor
COMMON=(model.name=tiny trainer.batch_size=4 rollout.group_size=4 rollout.max_new_tokens=24
        data.heldout_limit=8 run.eval_max_new_tokens=8 run.export=false trainer.lr=1e-4)

echo "== 1. flaky rewards (10% raise, 10% hang 5 s, timeout 1 s) =="
$C train "${COMMON[@]}" trainer.total_steps=6 reward.fn=conveyor.rewards.faults:flaky_math_reward \
  reward.timeout_s=1 reward.failure_score=-0.5 run.dir="$OUT/flaky" > "$OUT/flaky.log" 2>&1
echo "exit code $?"
python3 - "$OUT/flaky" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
print("steps", rows[-1]["step"], "reward failures", rows[-1]["rollout/reward_failures"],
      "per-step failed share", [round(r["rollout/reward_failed_share"], 2) for r in rows])
PY

echo "== 2. non-finite losses (lr 1e30, no clipping): steps skipped, then a clear stop =="
$C train "${COMMON[@]}" trainer.total_steps=20 trainer.lr=1e30 trainer.grad_clip=null reward.fn=conveyor.rewards.faults:response_length_reward \
  trainer.max_nonfinite_in_a_row=3 run.eval_before=false run.dir="$OUT/nonfinite" > "$OUT/nonfinite.log" 2>&1
echo "exit code $? (non-zero expected)"
grep -E "NonFiniteLossError|consecutive" "$OUT/nonfinite.log" | tail -2
grep -c skipped_nonfinite "$OUT/nonfinite/events.jsonl" | sed 's/^/skipped-step events: /'
ls "$OUT/nonfinite/checkpoints"

echo "== 3. kill -9 mid-run, then --resume =="
$C train "${COMMON[@]}" trainer.total_steps=400 run.checkpoint_every=5 run.eval_before=false \
  run.dir="$OUT/killed" > "$OUT/killed.log" 2>&1 &
PID=$!
for _ in $(seq 1 600); do
  n=$( (wc -l < "$OUT/killed/metrics.jsonl") 2>/dev/null || echo 0)
  [ "${n:-0}" -ge 12 ] && break
  sleep 0.5
done
kill -9 $PID; wait $PID 2>/dev/null
echo "killed at step $(tail -1 "$OUT/killed/metrics.jsonl" | python3 -c 'import json,sys; print(json.load(sys.stdin)["step"])'); checkpoints: $(ls "$OUT/killed/checkpoints" | tr '\n' ' ')"
$C train --resume "$OUT/killed" trainer.total_steps=16 run.eval_after=false > "$OUT/resumed.log" 2>&1
echo "resume exit code $?"
python3 - "$OUT/killed" <<'PY'
import json, sys
run = sys.argv[1]
rows = [json.loads(l) for l in open(run + "/trained.jsonl")]
steps = [r["step"] for r in rows]
print("steps logged (incl. work lost after the checkpoint):", steps)
# the effective history: for each step, the last write wins (a step redone after the resume)
last = {}
for r in rows:
    last[r["step"]] = r
groups = [g["group"] for s in sorted(last) for g in last[s]["groups"]]
print("effective steps", sorted(last), "trajectory groups", len(groups), "unique", len(set(groups)))
assert len(groups) == len(set(groups)), "a trajectory was trained twice"
ev = [json.loads(l) for l in open(run + "/events.jsonl")]
print("resume events:", [e for e in ev if e["event"] == "resume"])
PY
