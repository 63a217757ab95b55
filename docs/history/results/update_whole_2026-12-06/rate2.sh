#!/bin/bash
cd /work/main
O=/tmp/w53/rate2; mkdir -p $O
for d in fp32 bf16; do
  .venv/bin/python benchmarks/update_rate_bench.py --dtype $d --rounds 3 --steps 5 --deepspeed-python /tmp/dsv/bin/python \
    --systems bandwidth,torch-bare,torch-norm+bare,fuyou-exact,fuyou-speculative,deepspeed \
    --before-src /work/before/src --json $O/update_rate_$d.json > $O/update_rate_$d.txt 2>$O/update_rate_$d.err
done
echo finished > $O/finished
