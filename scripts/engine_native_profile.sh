#!/usr/bin/env bash
# A native (C / C++) profile of the main job's engine thread (issue 16, docs/results/main_job.md section 11): a
# 12-update default run, py-spy (pip install py-spy) attached for 150 s after 150 s; stacks in /tmp/prof/native.txt,
# summarised by scripts/summarise_native_profile.py.
cd "$(dirname "$0")/.."
mkdir -p /tmp/prof
.venv/bin/conveyor train trainer.total_steps=12 run.eval_before=false run.eval_after=false run.checkpoint_every=1000 \
  run.final_checkpoint=none run.export=false run.progress=false run.dir=/tmp/prof/run > /tmp/prof/run.log 2>&1 &
pid=$!
sleep 150
.venv/bin/py-spy record --native --rate 25 --duration 150 --format raw -o /tmp/prof/native.txt --pid $pid > /tmp/prof/pyspy.log 2>&1
.venv/bin/py-spy dump --native --pid $pid > /tmp/prof/dump.txt 2>&1
wait $pid
