#!/bin/sh
# An experiment, not kept: the norm on a thread of its own beside a job's per-chunk passes (`norm_task.patch`, applied
# to /work/beside, whose beside.py then has `--calls thread`) against the norm beside the first chunk's pass (the
# committed tree, /work/main, `--calls chunk`) and the tree before either (a126fcb in /work/before_a126: norm, then
# passes). Chunks of 256K elements, so that one chunk's pass is shorter than the norm (a 16-core host's 1.4M-element
# chunk passes in about that share of a large gradient's norm). 2 threads, and 1; jemalloc; a fresh process each.
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
PY=/work/main/.venv/bin/python
for r in 1 2 3; do
  echo "round $r"
  LD_PRELOAD=$J PYTHONPATH=/work/before_a126/src $PY beside.py --calls chunk --chunk 262144
  LD_PRELOAD=$J PYTHONPATH=/work/main/src $PY beside.py --calls chunk --chunk 262144
  LD_PRELOAD=$J PYTHONPATH=/work/beside/src $PY beside.py --calls thread --chunk 262144
  LD_PRELOAD=$J PYTHONPATH=/work/beside/src $PY beside.py --calls thread --chunk 262144 --threads 1
  LD_PRELOAD=$J PYTHONPATH=/work/main/src $PY beside.py --calls chunk --chunk 262144 --threads 1
done > beside_thread.txt 2>&1
