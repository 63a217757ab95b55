#!/usr/bin/env bash
# A lent chunk's views kept with its slot's memory (HostBuffer.kept), against the tree before (a worktree of 6aafe3f
# at $BEFORE), interleaved, with nothing else running. From the repository root:
#   BEFORE=/work/before/src bash docs/history/results/kept_views_2026-12-06/run.sh
set -e
R=docs/history/results/kept_views_2026-12-06
B=${BEFORE:?a checkout of 6aafe3f\'s src}
PY=.venv/bin/python
JE=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
ALL=fuyou-exact,fuyou-speculative,fuyou-exact-device,fuyou-speculative-device
# the worker's time in its jobs and the whole step, 390 parameters of 4,096 elements, each tier and schedule, trees alternating
for r in 1 2 3; do for cfg in "ram next_forward" "ram backward" "device next_forward" "device backward"; do
  for tree in $B src; do
    echo -n "$tree "; LD_PRELOAD=$JE PYTHONPATH=$tree $PY $R/time_worker.py 390 4096 $cfg 2>/dev/null | tail -1
done; done; done > $R/worker.txt
# the same through the benchmark, torch's optimizer beside
$PY benchmarks/update_rate_bench.py --params 1597440 --param-elems 4096 --rounds 3 --steps 10 --warmup 3 \
  --swap-dir /tmp --systems torch-bare,torch-adamw,$ALL --before-src $B --before-systems $ALL \
  --json $R/per_param.json > $R/per_param.txt
# large parameters (64M, 16 MiB chunks): nothing slower
for dtype in bf16 fp32; do
  $PY benchmarks/update_rate_bench.py --dtype $dtype --rounds 3 --steps 5 --swap-dir /tmp \
    --systems torch-bare,fuyou-exact,fuyou-speculative --before-src $B --json $R/rate_$dtype.json > $R/rate_$dtype.txt
done
