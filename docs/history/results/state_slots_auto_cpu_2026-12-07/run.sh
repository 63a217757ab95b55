#!/bin/bash
# state_slots 2, 1 and "auto" under host_memory_budget=1792MiB, 2 rounds alternating, a fresh process each;
# nothing else running; jemalloc. Code: this commit's src.
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
cd /work/w17
for r in 1 2; do
  for s in 2 1 auto; do
    echo "== round $r, state_slots=$s"
    LD_PRELOAD=$J PYTHONPATH=src /work/main/.venv/bin/python docs/history/results/state_slots_auto_cpu_2026-12-07/probe.py 1792MiB $s 2>&1 \
      | grep "fuyou planner: plan\|one-slot plan\|state_slots=\|took 1\|predicted .* measured"
  done
done
# The switch itself on this model (the decision forced to one slot in a copy of probe.py), once:
LD_PRELOAD=$J PYTHONPATH=src /work/main/.venv/bin/python docs/history/results/state_slots_auto_cpu_2026-12-07/probe.py 1792MiB auto --force 2>&1 \
  | grep "fuyou planner: plan\|one-slot plan\|state_slots=\|took 1\|predicted .* measured"  # out_forced.txt
# The rates each warm-up measured (out_rates.txt, first part): probe.py 1792MiB {1,2} --detail; and with
# rates_split.diff applied to the src (second part): probe.py 1792MiB auto --detail, twice.
