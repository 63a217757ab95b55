#!/bin/bash
# This session's changes against the tree before it (465a2c7: BEFORE, a worktree's src/), with nothing else running.
# From the repository root:
#   BEFORE=/work/before/src bash docs/history/results/step_decided_2026-12-06/run.sh
set -u
R=docs/history/results/step_decided_2026-12-06
B=${BEFORE:?a checkout of 465a2c7\'s src}
PY=.venv/bin/python
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
ALL=fuyou-exact,fuyou-speculative,fuyou-exact-device,fuyou-speculative-device
# the training thread's step() (updates left for the next forward), 390 parameters, 3 rounds, the trees alternating
for round in 1 2 3; do for size in 16 4096; do for tier in device ram; do for tree in $B src; do
  name=$([ "$tree" = "$B" ] && echo before || echo after)
  echo -n "round $round $name: "; PYTHONPATH=$tree $PY $R/step_thread.py 390 $size $tier next_forward 2>/dev/null | tail -1
done; done; done; done > $R/step_thread.txt
# the whole step and the worker through the benchmark, torch's optimizer beside
$PY benchmarks/update_rate_bench.py --params 1597440 --param-elems 4096 --rounds 3 --steps 10 --warmup 3 \
  --swap-dir /tmp --systems torch-bare,torch-adamw,$ALL --before-src $B --before-systems $ALL \
  --json $R/per_param.json > $R/per_param.txt
# large parameters (64M fp32, 16 MiB chunks): nothing slower
$PY benchmarks/update_rate_bench.py --dtype fp32 --rounds 3 --steps 5 --swap-dir /tmp \
  --systems torch-bare,fuyou-exact,fuyou-speculative --before-src $B --json $R/rate_fp32.json > $R/rate_fp32.txt
