#!/bin/bash
# the master updated in place (branch inplace) against main (b235284); nothing else running
set -x
O=/tmp/s15/res
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
cd /work/inplace
# the whole update of 64M parameters, fp32 weights (the path that changed) and bf16 (unchanged: a check), DeepSpeed beside
for d in fp32 bf16; do
  /work/main/.venv/bin/python benchmarks/update_rate_bench.py --dtype $d --rounds 3 --steps 5 --deepspeed-python /tmp/dsv/bin/python \
    --systems bandwidth,torch-bare,torch-norm+bare,fuyou-exact,fuyou-speculative,deepspeed \
    --before-src /work/main/src --before-systems fuyou-exact --json $O/update_rate_$d.json > $O/update_rate_$d.txt 2>$O/update_rate_$d.err
done
# 350M fp32 in RAM (next_forward: the exact update in place), torch beside, before and after alternating
/work/main/.venv/bin/python -m benchmarks.ab --old-src /work/main/src --new-src /work/inplace/src --system fuyou-lightning --size 350M \
  --rounds 2 --out $O/ab_350M_fuyou-lightning > $O/ab_350M_fuyou-lightning.txt 2>&1
echo finished > $O/finished
