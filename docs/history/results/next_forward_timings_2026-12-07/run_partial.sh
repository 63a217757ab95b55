#!/bin/bash
# Where one slot still leaves state on the SSD (host_memory_budget=1280MiB: one slot's 1.39 GiB does not fit), so the
# CPU rule does not apply: "auto", 2 and 1 alternating, 2 rounds, a fresh process each, on /work/w18 (0a6504b);
# jemalloc; nothing else running. Output: out_partial.jsonl.
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
HERE=$(cd "$(dirname "$0")" && pwd)
for r in 1 2; do
  for slots in auto 2 1; do
    line=$(LD_PRELOAD=$J PYTHONPATH=/work/w18/src /work/main/.venv/bin/python "$HERE/probe.py" 1280MiB $slots 2>/dev/null | tail -1)
    echo "{\"round\": $r, \"tree\": \"cpu-rule\", ${line:1}"
  done
done
