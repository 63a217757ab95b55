#!/bin/bash
# Three source trees, fuyou-state-ssd (the speculative schedule on the CPU) at GPT-2 124M: before (8bfcb9f),
# the per-chunk path alone (c67ad11), and both changes (37611c1); each a fresh benchmarks.peers process,
# the order rotating between rounds. usage: ab3.sh ROUNDS OUT SYSTEM
R=$1; OUT=$2; SYSTEM=${3:-fuyou-state-ssd}
mkdir -p "$OUT"
cd /work/main
orders=("base perchunk main" "main base perchunk" "perchunk main base")
for r in $(seq $R); do
  for v in ${orders[$(( (r - 1) % 3 ))]}; do
    echo "round $r: $v"
    PYTHONPATH=/work/$v/src .venv/bin/python -m benchmarks.peers --sizes 124M --dtype fp32 --systems $SYSTEM \
      --batch 2 --rounds 1 --warmup 6 --steps 3 --out "$OUT/$v-r$r" > "$OUT/$v-r$r.log" 2>&1
    python3 -c "
import json, glob; d = json.load(open(glob.glob('$OUT/$v-r$r/peers-*.json')[0]))
x = list(d['sizes']['124M'].values())[0]; print('  $v r$r', [round(s, 2) for s in x['step_s']], x['losses'][-1])"
  done
done
