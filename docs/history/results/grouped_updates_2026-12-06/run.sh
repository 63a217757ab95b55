#!/usr/bin/env bash
# Grouped updates (OptimizerState.group_job) against the tree before them (a worktree of af972e2 at $BEFORE),
# interleaved, one run after another with nothing else running. From the repository root:
#   BEFORE=/work/before/src AFTER=/tmp/after_src bash docs/history/results/grouped_updates_2026-12-06/run.sh
# (AFTER: a copy of b39b44e's src). The final tree's rows (final_*): a copy of 9bbd19f's src, PREFIX=final_; they ran
# as run_final.sh, the same commands less the device tier's 64M rows and GPT-2 350M.
set -e
R=docs/history/results/grouped_updates_2026-12-06
B=${BEFORE:?a checkout of af972e2\'s src}
A=${AFTER:?a copy of the after tree\'s src}
P=${PREFIX:-}
PY=.venv/bin/python
ALL=fuyou-exact,fuyou-speculative,fuyou-exact-device,fuyou-speculative-device
# the cost per parameter: 390 parameters of 4,096 elements (GPT-2 350M has ~390), torch's optimizer beside
$PY benchmarks/update_rate_bench.py --params 1597440 --param-elems 4096 --rounds 3 --steps 10 --warmup 3 --swap-dir /tmp \
  --systems torch-bare,torch-adamw,$ALL --before-src $B --before-systems $ALL \
  --json $R/${P}per_param.json > $R/${P}per_param.txt
# the same apart: the training thread's queueing with the worker held, then the worker alone, alternating trees
for r in 1 2 3; do for t in ram device; do for tree in $B $A; do
  echo -n "$tree "; LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=$tree $PY docs/history/results/update_batch_2026-12-06/per_param_split.py 390 4096 $t 2>/dev/null | tail -1
done; done; done > $R/${P}per_param_split.txt
# large parameters (64M, 16 MiB chunks): nothing slower
for dtype in bf16 fp32; do
  $PY benchmarks/update_rate_bench.py --dtype $dtype --rounds 3 --steps 5 --swap-dir /tmp \
    --systems torch-bare,fuyou-exact,fuyou-speculative --before-src $B --json $R/${P}rate_$dtype.json > $R/${P}rate_$dtype.txt
done
[ -n "$P" ] && exit 0
$PY benchmarks/update_rate_bench.py --dtype bf16 --rounds 3 --steps 5 --swap-dir /tmp \
  --systems torch-bare,fuyou-exact-device,fuyou-speculative-device --before-src $B \
  --before-systems fuyou-exact-device,fuyou-speculative-device --json $R/device.json > $R/device.txt
# GPT-2 350M training with the state in RAM (next_forward): the tree before against this one, torch beside
$PY -m benchmarks.ab --old-src $B --new-src $A --system fuyou-lightning --size 350M \
  --rounds 3 --out $R/ab_350M_fuyou-lightning > $R/ab_350M_fuyou-lightning.txt 2>&1
