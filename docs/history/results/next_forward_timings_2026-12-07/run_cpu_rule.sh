#!/bin/bash
# The CPU rule (one slot where it holds the whole state in RAM and two do not; 2nd commit of this folder), on
# /work/w18: state_slots "auto", 2 and 1 alternating, 3 rounds, a fresh process each; jemalloc; nothing else
# running. Output: out_cpu_rule.jsonl. (probe.py's "why" field was added for this run.)
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
HERE=$(cd "$(dirname "$0")" && pwd)
for r in 1 2 3; do
  for slots in auto 2 1; do
    line=$(LD_PRELOAD=$J PYTHONPATH=/work/w18/src /work/main/.venv/bin/python "$HERE/probe.py" 1792MiB $slots 2>/dev/null | tail -1)
    echo "{\"round\": $r, \"tree\": \"cpu-rule\", ${line:1}"
  done
done
