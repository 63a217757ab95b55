#!/usr/bin/env bash
# The final tree (9bbd19f: grouped jobs, and the one pass over a run's list of chunks in one call) against af972e2,
# the same way as run.sh. From the repository root:
#   BEFORE=/work/before/src FINAL=/tmp/final_src bash docs/history/results/grouped_updates_2026-12-06/run_final.sh
set -e
R=docs/history/results/grouped_updates_2026-12-06
B=${BEFORE:?a checkout of af972e2\'s src}
PY=.venv/bin/python
ALL=fuyou-exact,fuyou-speculative,fuyou-exact-device,fuyou-speculative-device
$PY benchmarks/update_rate_bench.py --params 1597440 --param-elems 4096 --rounds 3 --steps 10 --warmup 3 --swap-dir /tmp \
  --systems torch-bare,torch-adamw,$ALL --before-src $B --before-systems $ALL \
  --json $R/final_per_param.json > $R/final_per_param.txt
for r in 1 2 3; do for t in ram device; do for tree in $B ${FINAL:?a copy of 9bbd19f\'s src}; do
  echo -n "$tree "; LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=$tree $PY docs/history/results/update_batch_2026-12-06/per_param_split.py 390 4096 $t 2>/dev/null | tail -1
done; done; done > $R/final_per_param_split.txt
for dtype in bf16 fp32; do
  $PY benchmarks/update_rate_bench.py --dtype $dtype --rounds 3 --steps 5 --swap-dir /tmp \
    --systems torch-bare,fuyou-exact,fuyou-speculative --before-src $B --json $R/final_rate_$dtype.json > $R/final_rate_$dtype.txt
done
