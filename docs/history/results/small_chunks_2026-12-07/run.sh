#!/bin/sh
# before = /work/main (fe79e4d), after = /work/norm; jemalloc; nothing else running.
set -e
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
PY=/work/main/.venv/bin/python
R=/work/norm/docs/history/results
for r in 1 2 3; do
  for tree in main norm; do
    echo "round $r: $tree"
    LD_PRELOAD=$J PYTHONPATH=/work/$tree/src $PY pass_threads.py
    LD_PRELOAD=$J PYTHONPATH=/work/$tree/src $PY $R/small_step_phases_2026-12-07/phases.py 2>&1 | grep whole
    for tier in ram device; do LD_PRELOAD=$J PYTHONPATH=/work/$tree/src $PY $R/per_param_2026-12-06b/clip_step.py 390 4096 $tier; done
  done
  LD_PRELOAD=$J $PY $R/per_param_2026-12-06b/clip_step.py 390 4096 torch
done > rounds.txt 2>&1
cd /work/norm
PYTHONPATH=/work/norm/src $PY benchmarks/update_rate_bench.py --params 1597440 --param-elems 4096 \
  --systems torch-adamw,fuyou-exact,fuyou-speculative,fuyou-exact-device,fuyou-speculative-device \
  --before-src /work/main/src --before-systems fuyou-exact,fuyou-speculative,fuyou-exact-device,fuyou-speculative-device \
  --rounds 3 --steps 20 --warmup 3 --json $R/small_chunks_2026-12-07/per_param.json > $R/small_chunks_2026-12-07/per_param.txt 2>&1
