#!/bin/bash
# The whole step over 292 parameters of 64 elements (GPT-2 350M's count of tensors, arithmetic negligible), clipping
# at work, before (b152f45's src, copied to /tmp/s17/base/src) and after (47049c0) the grouped job's per-parameter
# bookkeeping was cut: torch, the state on the device tier and in RAM, 3 rounds alternating; then the device tier's
# step timed from inside (phases_device.py), 3 rounds alternating. Nothing else running; jemalloc.
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
PY=/work/main/.venv/bin/python
CLIP=docs/history/results/per_param_2026-12-06b/clip_step.py
PH=docs/history/results/device_tier_small_2026-12-07/phases_device.py
cd /work/w17
for r in 1 2 3; do
  echo "round $r"
  LD_PRELOAD=$J PYTHONPATH=src $PY $CLIP 292 64 torch 2>&1 | tail -1
  for t in device ram; do
    for s in before after; do
      src=$([ $s = before ] && echo /tmp/s17/base/src || echo src)
      echo -n "$s: "; LD_PRELOAD=$J PYTHONPATH=$src $PY $CLIP 292 64 $t 2>&1 | tail -1
    done
  done
done
for r in 1 2 3; do
  for s in before after; do
    src=$([ $s = before ] && echo /tmp/s17/base/src || echo src)
    echo -n "$s: "; LD_PRELOAD=$J PYTHONPATH=$src $PY $PH 2>&1 | tail -1
  done
done
