#!/bin/bash
# The README's test command three times in a row on the fresh clone while two busy loops keep both cores busy.
cd /work/fresh
python3 -c 'while True: pass' & b1=$!
python3 -c 'while True: pass' & b2=$!
trap 'kill $b1 $b2' EXIT
for i in 1 2 3; do
  s=$(date +%s.%N)
  .venv/bin/python -m pytest -q -n 2 --dist load -p no:cacheprovider > stress$i.log 2>&1; rc=$?
  echo "run $i: rc=$rc wall_s=$(echo "$(date +%s.%N) - $s" | bc) $(tail -1 stress$i.log)"
done
