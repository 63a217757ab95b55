#!/bin/sh
# before = /work/main (c8d27e0), after = /work/norm; jemalloc; nothing else running.
set -e
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
PY=/work/main/.venv/bin/python
for r in 1 2 3; do
  for tree in main norm; do
    echo "round $r: $tree"; LD_PRELOAD=$J PYTHONPATH=/work/$tree/src $PY norm_rate.py
  done
done > norm_rate.txt
cd /work/norm
for d in bf16 fp32; do
  PYTHONPATH=/work/norm/src $PY benchmarks/update_rate_bench.py --dtype $d \
    --systems torch-bare,torch-norm+bare,fuyou-exact,fuyou-speculative --before-src /work/main/src \
    --rounds 3 --steps 5 --json docs/history/results/norm_blocks_2026-12-07/rate_$d.json \
    > docs/history/results/norm_blocks_2026-12-07/rate_$d.txt 2>&1
done
