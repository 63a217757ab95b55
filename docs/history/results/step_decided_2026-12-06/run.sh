#!/bin/bash
# The training thread's step() over 390 small parameters, the tree before this session (BEFORE: its src/) against
# this one, 3 rounds alternating, a fresh process per configuration; jemalloc; nothing else running.
#   BEFORE=/work/before/src bash docs/history/results/step_decided_2026-12-06/run.sh
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../../.." && pwd)
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
for round in 1 2 3; do
  for size in 16 4096; do
    for tier in device ram; do
      for tree in "$BEFORE" "$root/src"; do
        name=$([ "$tree" = "$BEFORE" ] && echo before || echo after)
        echo -n "round $round $name: "
        PYTHONPATH=$tree "$root/.venv/bin/python" "$here/step_thread.py" 390 $size $tier next_forward 2>&1 | tail -1
      done
    done
  done
done
