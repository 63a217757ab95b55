#!/bin/sh
# before = /work/main (41d1c86), after = /work/tile; jemalloc; nothing else running; a fresh process per line.
set -e
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
PY=/work/main/.venv/bin/python
R=/work/tile/docs/history/results/pass_tiles_2026-12-07
for r in 1 2 3; do
  for mode in inplace outofplace; do
    for tree in main tile; do
      echo -n "round $r $tree: "
      LD_PRELOAD=$J PYTHONPATH=/work/$tree/src $PY $R/pass.py --mode $mode
    done
  done
done > $R/pass.txt 2>&1
cd /work/tile
for d in bf16 fp32; do
  PYTHONPATH=/work/tile/src $PY benchmarks/update_rate_bench.py --dtype $d --before-src /work/main/src \
    --systems torch-bare,torch-norm+bare,fuyou-exact,fuyou-speculative --rounds 3 --steps 5 \
    --json $R/rate_$d.json > $R/rate_$d.txt 2>&1
done
