#!/bin/bash
# After the change only (/work/w18): "auto" and one slot from the start alternating, 3 more rounds; out_more.jsonl.
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
HERE=$(cd "$(dirname "$0")" && pwd)
for r in 3 4 5; do
  for slots in auto 1; do
    line=$(LD_PRELOAD=$J PYTHONPATH=/work/w18/src /work/main/.venv/bin/python "$HERE/probe.py" 1792MiB $slots 2>/dev/null | tail -1)
    echo "{\"round\": $r, \"tree\": \"w18\", ${line:1}"
  done
done
