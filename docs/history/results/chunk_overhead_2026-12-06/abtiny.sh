#!/bin/bash
# usage: abtiny.sh rounds [args for step_overhead]; before = a worktree at /work/base, after = /work/main
R=$1; shift
for r in $(seq $R); do
 for s in base main; do
  printf "%s " $s; PYTHONPATH=/work/$s/src LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 /work/main/.venv/bin/python "$(dirname "$0")/step_overhead.py" "$@"
 done
done
