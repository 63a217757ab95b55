#!/bin/bash
# DeepSpeed ZeRO-2 Offload's host work per step beside fuyou's exact and speculative steps; nothing else running
set -x
O=/tmp/s16/res
cd /work/dso  # a worktree of the commit that added deepspeed-offload
for d in fp32 bf16; do
  /work/main/.venv/bin/python benchmarks/update_rate_bench.py --dtype $d --rounds 3 --steps 5 --deepspeed-python /tmp/dsv/bin/python \
    --systems bandwidth,torch-bare,torch-norm+bare,fuyou-exact,fuyou-speculative,deepspeed,deepspeed-offload \
    --json $O/update_rate_$d.json > $O/update_rate_$d.txt 2>$O/update_rate_$d.err
done
echo finished > $O/finished
