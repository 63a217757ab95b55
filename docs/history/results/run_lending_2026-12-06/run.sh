#!/usr/bin/env bash
# A run's chunks lent and given back at once (TensorStore.lend_chunks, give_back) and the per-parameter trims beside
# them, against the tree before (a worktree of 0e064d1 at $BEFORE), interleaved, with nothing else running.
# From the repository root:  BEFORE=/work/before/src AFTER=/tmp/after_src bash docs/history/results/run_lending_2026-12-06/run.sh
# (AFTER: a copy of this checkout's src, for the split; update_rate_bench.py runs this checkout's src itself).
set -e
R=docs/history/results/run_lending_2026-12-06
B=${BEFORE:?a checkout of 0e064d1\'s src}
A=${AFTER:?a copy of the after tree\'s src}
PY=.venv/bin/python
ALL=fuyou-exact,fuyou-speculative,fuyou-exact-device,fuyou-speculative-device
# the cost per parameter: 390 parameters of 4,096 elements, torch's optimizer beside
$PY benchmarks/update_rate_bench.py --params 1597440 --param-elems 4096 --rounds 3 --steps 10 --warmup 3 \
  --swap-dir /tmp --systems torch-bare,torch-adamw,$ALL --before-src $B --before-systems $ALL \
  --json $R/per_param.json > $R/per_param.txt
# each thread apart: the training thread's queueing with the worker held, then the worker alone, alternating trees
for r in 1 2 3; do for t in ram device; do for tree in $B $A; do
  echo -n "$tree "; LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=$tree $PY docs/history/results/update_batch_2026-12-06/per_param_split.py 390 4096 $t 2>/dev/null | tail -1
done; done; done > $R/per_param_split.txt
# large parameters (64M, 16 MiB chunks): nothing slower
for dtype in bf16 fp32; do
  $PY benchmarks/update_rate_bench.py --dtype $dtype --rounds 3 --steps 5 --swap-dir /tmp \
    --systems torch-bare,fuyou-exact,fuyou-speculative --before-src $B --json $R/rate_$dtype.json > $R/rate_$dtype.txt
done
