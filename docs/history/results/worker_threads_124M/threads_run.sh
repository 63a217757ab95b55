#!/bin/bash
cd /work/main
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
for r in 1 2; do
  for cfg in "torch x 0" "fuyou next_forward 4GiB" "fuyou1 next_forward 4GiB" "fuyou backward 0" "fuyou1 backward 0"; do
    .venv/bin/python docs/history/results/worker_threads_124M/threads_exp.py $cfg 2>&1 | grep -E "median"
  done
done
