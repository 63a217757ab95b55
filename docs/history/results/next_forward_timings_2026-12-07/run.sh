#!/bin/bash
# Before (b94a942, /work/main) and after (this branch, /work/w18), alternating, 2 rounds, a fresh process each;
# jemalloc; nothing else running. Output: out.jsonl (one line per run, "tree" added).
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
HERE=$(cd "$(dirname "$0")" && pwd)
for r in 1 2; do
  for run in "1792MiB 1" "1792MiB auto" "1792MiB 2" "8GiB 2"; do
    for tree in /work/main /work/w18; do
      line=$(LD_PRELOAD=$J PYTHONPATH=$tree/src /work/main/.venv/bin/python "$HERE/probe.py" $run 2>/dev/null | tail -1)
      echo "{\"round\": $r, \"tree\": \"$(basename $tree)\", ${line:1}"
    done
  done
done
