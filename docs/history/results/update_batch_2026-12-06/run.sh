#!/usr/bin/env bash
# The batched update of state in RAM (ChunkJob.batch) against the tree before it (a worktree of its parent commit
# at $BEFORE), interleaved, one run after another with nothing else running. From the repository root:
#   BEFORE=/work/before/src BEFORE_LENT=/work/before_lent/src AFTER=/work/after/src bash docs/history/results/update_batch_2026-12-06/run.sh
set -e
R=docs/history/results/update_batch_2026-12-06
B=${BEFORE:?a checkout of the parent commit\'s src}
PY=.venv/bin/python
for dtype in bf16 fp32; do
  $PY benchmarks/update_rate_bench.py --dtype $dtype --rounds 3 --steps 5 --swap-dir /tmp \
    --systems torch-bare,fuyou-exact,fuyou-speculative --before-src $B --json $R/rate_$dtype.json > $R/rate_$dtype.txt
done
# the worker's cost per chunk: 64 KiB chunks of state (5,461 parameters), where the pass itself is a few microseconds
$PY benchmarks/update_rate_bench.py --dtype bf16 --params 8e6 --state-chunk 64KiB --rounds 3 --steps 5 --swap-dir /tmp \
  --systems torch-bare,fuyou-exact,fuyou-speculative --before-src $B --json $R/chunks_64k.json > $R/chunks_64k.txt
# a thread issuing small torch ops beside the update (one intra-op thread each: a core for the loop)
$PY benchmarks/update_rate_bench.py --dtype bf16 --rounds 3 --steps 5 --swap-dir /tmp --threads 1 --beside-python \
  --systems torch-bare,fuyou-exact,fuyou-speculative --before-src $B --json $R/beside.json > $R/beside.txt
# GPT-2 350M training with the state in RAM (next_forward): the tree before against this one ($AFTER: a copy of this
# commit's src, so the checkout may change while the rounds run), torch beside
$PY -m benchmarks.ab --old-src $B --new-src ${AFTER:?a copy of this commit\'s src} --system fuyou-lightning --size 350M \
  --rounds 3 --out $R/ab_350M_fuyou-lightning > $R/ab_350M_fuyou-lightning.txt 2>&1
# the device tier's updates (on the CPU the device is host RAM), batched too: 64 KiB chunks, then 16 MiB
$PY benchmarks/update_rate_bench.py --dtype bf16 --params 8e6 --state-chunk 64KiB --rounds 3 --steps 5 --swap-dir /tmp \
  --systems torch-bare,fuyou-exact-device,fuyou-speculative-device --before-src $B \
  --before-systems fuyou-exact-device,fuyou-speculative-device --json $R/device_64k.json > $R/device_64k.txt
$PY benchmarks/update_rate_bench.py --dtype bf16 --rounds 3 --steps 5 --swap-dir /tmp \
  --systems torch-bare,fuyou-exact-device,fuyou-speculative-device --before-src $B \
  --before-systems fuyou-exact-device,fuyou-speculative-device --json $R/device.json > $R/device.txt
# the cost per parameter, after the batch: 390 parameters of 4,096 elements (GPT-2 350M has ~390), torch's optimizer beside
$PY benchmarks/update_rate_bench.py --params 1597440 --param-elems 4096 --rounds 3 --steps 10 --warmup 3 --swap-dir /tmp \
  --systems torch-bare,torch-adamw,fuyou-exact,fuyou-speculative,fuyou-exact-device,fuyou-speculative-device \
  --json $R/per_param.json > $R/per_param.txt
# the same apart: the training thread's queueing with the worker held, then the worker alone
for t in ram device ram device; do
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 $PY $R/per_param_split.py 390 4096 $t 2>/dev/null | tail -1
done > $R/per_param_split.txt
# after ChunkJob.lent (a one-chunk parameter's lend without a future): the split, this tree against the commit before
# it ($BEFORE_LENT: a worktree of 7f91f9b's src), alternating, three rounds; and the bench again
for r in 1 2 3; do for t in ram device; do for tree in ${BEFORE_LENT:?} src; do
  echo -n "$tree "; LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=$tree $PY $R/per_param_split.py 390 4096 $t 2>/dev/null | tail -1
done; done; done > $R/per_param_split_lent_ab.txt
$PY benchmarks/update_rate_bench.py --params 1597440 --param-elems 4096 --rounds 3 --steps 10 --warmup 3 --swap-dir /tmp \
  --systems torch-bare,torch-adamw,fuyou-exact,fuyou-speculative,fuyou-exact-device,fuyou-speculative-device \
  --json $R/per_param_lent.json > $R/per_param_lent.txt
