#!/bin/bash
# warm-up before/after: old = commit 368e85f checked out in /work/old-wt (git worktree) and put first on
# PYTHONPATH (its warm-up keeps the state on the SSD), new = this commit; 2 interleaved rounds
set -e
cd /work/main
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
for r in 1 2; do
  if [ $r = 1 ]; then order="new old"; else order="old new"; fi
  for v in $order; do
    if [ $v = old ]; then export PYTHONPATH=/work/old-wt/src; else unset PYTHONPATH; fi
    mkdir -p /work/wubench/$v-r$r
    .venv/bin/python -m benchmarks.peers --sizes 350M --systems fuyou-hf --dtype fp32 --batch 2 --rounds 1 \
        --warmup 3 --steps 2 --out /work/wubench/$v-r$r > /work/wubench/$v-r$r.log 2>&1
  done
done
echo done
