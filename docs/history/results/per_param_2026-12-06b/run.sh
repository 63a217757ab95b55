#!/bin/bash
# This session's changes against the tree before them (5f7b2ef: BEFORE, a worktree's src/), with nothing else running.
# From the repository root:
#   BEFORE=/work/before/src bash docs/history/results/per_param_2026-12-06b/run.sh
set -u
R=docs/history/results/per_param_2026-12-06b
S=docs/history/results/step_decided_2026-12-06/step_thread.py
B=${BEFORE:?a checkout of 5f7b2ef\'s src}
PY=.venv/bin/python
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
ALL=fuyou-exact,fuyou-speculative,fuyou-exact-device,fuyou-speculative-device
name() { [ "$1" = "$B" ] && echo before || echo after; }
# the whole step with clipping at work, 390 x 4,096, 3 rounds, the trees alternating, torch beside
for round in 1 2 3; do for tier in ram device; do for tree in $B src; do
  echo -n "round $round $(name $tree): "; PYTHONPATH=$tree $PY $R/clip_step.py 390 4096 $tier 2>/dev/null | tail -1
done; done; echo -n "round $round torch: "; PYTHONPATH=src $PY $R/clip_step.py 390 4096 torch 2>/dev/null | tail -1
done > $R/clip_step.txt
# the training thread's step() alone (updates left for the next forward), as in step_decided_2026-12-06
for round in 1 2 3; do for size in 16 4096; do for tier in device ram; do for tree in $B src; do
  echo -n "round $round $(name $tree): "; PYTHONPATH=$tree $PY $S 390 $size $tier next_forward 2>/dev/null | tail -1
done; done; done; done > $R/step_thread.txt
# Python's garbage collections over 100 steps
for tier in ram device; do for tree in $B src; do
  echo -n "$(name $tree): "; PYTHONPATH=$tree $PY $R/gc_counts.py $tier 2>/dev/null | tail -1
done; done > $R/gc_counts.txt
# the worker's phases in a grouped device-tier job (the tree after)
PYTHONPATH=src $PY $R/worker_phases.py 2 2>/dev/null > $R/worker_phases.txt
# the benchmark, every fuyou system in both trees, torch's optimizer beside (no clipping there)
$PY benchmarks/update_rate_bench.py --params 1597440 --param-elems 4096 --rounds 3 --steps 10 --warmup 3 \
  --swap-dir /tmp --systems torch-bare,torch-adamw,$ALL --before-src $B --before-systems $ALL \
  --json $R/per_param.json > $R/per_param.txt 2>/dev/null
# large parameters (64M, 16 MiB chunks), fp32 and bf16 weights: nothing slower
for dtype in fp32 bf16; do
  $PY benchmarks/update_rate_bench.py --dtype $dtype --rounds 3 --steps 5 --swap-dir /tmp \
    --systems torch-bare,fuyou-exact,fuyou-speculative --before-src $B --json $R/rate_$dtype.json > $R/rate_$dtype.txt 2>/dev/null
done
# the same phases under each OpenMP wait policy (libgomp), 2 rounds: why torch's kernel is slower inside the step
for round in 1 2; do for policy in default ACTIVE PASSIVE; do
  echo "round $round, OMP_WAIT_POLICY=$policy"
  if [ $policy = default ]; then PYTHONPATH=src $PY $R/worker_phases.py 2 2>/dev/null
  else OMP_WAIT_POLICY=$policy PYTHONPATH=src $PY $R/worker_phases.py 2 2>/dev/null; fi
done; done > $R/omp_policy.txt
# GPT-2 350M training, both trees and torch (about 13 minutes)
$PY -m benchmarks.ab --old-src $B --system fuyou-lightning --size 350M --rounds 3 --out $R/ab_350M_fuyou-lightning \
  > $R/ab_350M_fuyou-lightning.txt 2>&1
