#!/bin/bash
# The tail's read-ahead, before/after: old = commit d8f10e5 (no read-ahead) checked out in /work/old-wt (git
# worktree) and put first on PYTHONPATH; new = this tree. GPT-2 350M, fp32, batch 2, the Lightning strategy with
# the whole optimizer state on the SSD (fuyou-state-ssd); torch beside them; 3 interleaved rounds, each run a fresh
# process, jemalloc (the harness preloads it).
set -e
cd /work/main
out=${OUT:-/work/tailbench}
for r in 1 2 3; do
  if [ $((r % 2)) = 1 ]; then order="torch new old"; else order="old new torch"; fi
  for v in $order; do
    if [ $v = old ]; then export PYTHONPATH=/work/old-wt/src; else unset PYTHONPATH; fi
    system=fuyou-state-ssd; [ $v = torch ] && system=torch
    mkdir -p $out/$v-r$r
    .venv/bin/python -m benchmarks.peers --sizes 350M --systems $system --dtype fp32 --batch 2 --rounds 1 \
        --warmup 6 --steps 3 --out $out/$v-r$r > $out/$v-r$r.log 2>&1
  done
done
echo done
