#!/bin/bash
# before (57f6b83) and after, alternating: A B A B; each run: torch, fuyou-lightning (state in RAM), fuyou-state-ssd
for r in 1 2; do
  for tree in before main; do
    cd /work/$tree
    PYTHONPATH=/work/$tree/src /work/main/.venv/bin/python -m benchmarks.peers --sizes 350M --batch 2 --rounds 1 \
      --systems torch,fuyou-lightning,fuyou-state-ssd --out /tmp/peers/$tree-r$r > /tmp/peers/$tree-r$r.txt 2>&1
  done
done
echo done > /tmp/peers/finished
