#!/bin/bash
# Interleaved fresh-process runs of optimizer_bench workers; each item side:config (side base = HEAD before the change).
cd /work/main
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
ROUNDS=$1; ITEMS=$2; shift 2
mkdir -p /work/main/.devrun/swapab
for r in $(seq 1 $ROUNDS); do
  for item in ${ITEMS//,/ }; do
    side=${item%%:*}; cfg=${item#*:}
    if [ $side = base ]; then PP=/work/base/src; else PP=/work/main/src; fi
    PYTHONPATH=$PP .venv/bin/python benchmarks/optimizer_bench.py --worker $cfg --swap-dir /work/main/.devrun/swapab --io-size 0 "$@" 2>/dev/null | tail -1 | python3 -c "
import json,sys,statistics; d=json.load(sys.stdin); print(json.dumps(dict(side='$side', config=d['config'], round=$r, params=d['params'], step_s=d['step_s'], peak_rss=d['peak_rss'], stats=d.get('stats',{}).get('schedules'))))"
  done
done
