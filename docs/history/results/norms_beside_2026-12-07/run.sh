#!/bin/sh
# before = /work/main (a126fcb), after = /work/beside; jemalloc; nothing else running; a fresh process per line.
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
PY=/work/main/.venv/bin/python
for r in 1 2 3; do
  for calls in run chunk; do
    for tree in main beside; do
      echo "round $r: $tree"
      LD_PRELOAD=$J PYTHONPATH=/work/$tree/src $PY beside.py --calls $calls
    done
  done
done > beside.txt 2>&1
