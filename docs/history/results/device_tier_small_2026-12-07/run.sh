#!/bin/bash
# The whole step over 292 parameters of 64 elements (GPT-2 350M's count of tensors; elements few enough that the
# arithmetic is negligible), clipping at work: torch, fuyou's state on the device tier and in RAM, 3 rounds
# alternating; then the device tier's step timed from inside (phases_device.py), 3 times. Nothing else running.
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
cd /work/main  # f6b6345's src (dff0035 changed no src)
for r in 1 2 3; do
  for t in torch device ram; do
    LD_PRELOAD=$J PYTHONPATH=src .venv/bin/python docs/history/results/per_param_2026-12-06b/clip_step.py 292 64 $t 2>&1 | tail -1
  done
done
for r in 1 2 3; do LD_PRELOAD=$J PYTHONPATH=src .venv/bin/python docs/history/results/device_tier_small_2026-12-07/phases_device.py 2>&1 | tail -1; done
for r in 1 2 3; do LD_PRELOAD=$J .venv/bin/python docs/history/results/device_tier_small_2026-12-07/torch_split.py; done
