#!/bin/sh
# The norm carried across a job's calls (this tree, /work/resume: `--calls carried`) against the norm beside the
# first chunk's pass only (the tree before, d027efe in /work/main, and this tree's `--calls first`), 5 rounds, the
# three in a rotating order, a fresh process each, jemalloc, 60 timed steps after 5. Chunks of 256K elements (21
# calls: a 16-core host passes its 1.4M-element chunk in about that share of a large gradient's norm) and of 1.4M
# (the default 16 MiB of state: 4 calls), on 2 threads and on 1; or CHUNKS, THREADS as given (carried_grain.txt:
# `CHUNKS=65536 THREADS=2 ./run.sh`: chunks of one grain, 84 calls, where the norm lasts ~10 chunks' passes, as a
# large gradient's norm lasts many 1.4M-element chunks' passes on a 16-core host).
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
PY=/work/main/.venv/bin/python
one() {  # name
  case $1 in
    before) echo "before:         $(LD_PRELOAD=$J PYTHONPATH=/work/main/src $PY carried.py --steps 60 --calls first --chunk $chunk --threads $threads)";;
    first) echo "after, first:   $(LD_PRELOAD=$J PYTHONPATH=/work/resume/src $PY carried.py --steps 60 --calls first --chunk $chunk --threads $threads)";;
    carried) echo "after, carried: $(LD_PRELOAD=$J PYTHONPATH=/work/resume/src $PY carried.py --steps 60 --calls carried --chunk $chunk --threads $threads)";;
  esac
}
for r in 1 2 3 4 5; do
  echo "round $r"
  case $((r % 3)) in 1) order="before first carried";; 2) order="carried before first";; 0) order="first carried before";; esac
  for chunk in ${CHUNKS:-262144 1398101}; do
    for threads in ${THREADS:-2 1}; do
      for name in $order; do one $name; done
    done
  done
done
