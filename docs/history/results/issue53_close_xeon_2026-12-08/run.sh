#!/bin/bash
# issue 53's changes together on the Xeon (AVX-512, AMX): before = 0095b14 (worktree /work/before), after = main 6538e1d
set -x
cd /work/main
O=/tmp/s21/out
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
for d in fp32 bf16; do
  .venv/bin/python benchmarks/update_rate_bench.py --dtype $d --rounds 3 --steps 5 --deepspeed-python /tmp/dsv/bin/python \
    --systems bandwidth,torch-bare,torch-norm+bare,fuyou-exact,fuyou-speculative,deepspeed,deepspeed-offload \
    --before-src /work/before/src --json $O/update_rate_$d.json > $O/update_rate_$d.txt 2>$O/update_rate_$d.err
done
for g in fp32 bf16; do
  LD_PRELOAD=$J PYTHONPATH=src .venv/bin/python benchmarks/update_phases_bench.py --params 60e6 --grad-dtype $g --rounds 3 \
    --out $O/update_phases_$g.json > $O/update_phases_$g.txt 2>&1
done
for s in fuyou-lightning fuyou-state-ssd; do
  .venv/bin/python -m benchmarks.ab --old-src /work/before/src --system $s --size 350M --rounds 3 --out $O/ab_350M_$s > $O/ab_350M_$s.txt 2>&1
done
echo finished > $O/finished
