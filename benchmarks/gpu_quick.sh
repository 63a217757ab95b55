#!/usr/bin/env bash
# The GPU check that fits one lease of this project's device tool (15 minutes of device time, start included):
# the environment, the device-dependent suite on CUDA, then the peers harness at one size with a step trace of
# each fuyou system (one with its optimizer state on the device: device_state), after the one-pass update's phases
# on CUDA (its build and bitwise check included) and a large gradient's norm beside its job's calls on the host's
# threads (first call only, and carried across them). Everything lands under $OUT (default ./gpu-quick): env.txt,
# update_phases.{log,json}, norms_carried.log, tests.log, bench.log and results.tgz
# (the harness's table, JSON and PNG, the traces, each run's stderr log). About 7 minutes on an H200.
#   bash benchmarks/gpu_quick.sh                      # on the GPU machine, from the repository root
#   T_TESTS=150 T_BENCH=270 SIZE=350M SYSTEMS=torch,fuyou-hf bash benchmarks/gpu_quick.sh
#   BATCH=32 SYSTEMS=torch,fuyou-engine bash benchmarks/gpu_quick.sh  # more tokens per step (GPU memory allows)
#   WARMUP=14 STEPS=4 SYSTEMS=torch,fuyou-hf,fuyou-hf-backward bash benchmarks/gpu_quick.sh  # auto has measured both
#                                                     # schedules (8 windows after the plan, 2 of next_forward) by then
#   The peers' 5 unmeasured steps (WARMUP) are the planner's 3 profiled steps and the first 2 under its plan: the
#   device tier takes the state at the plan and grows after the first planned step, so a timed step is a planned one.
#   SMOKE=1 bash benchmarks/gpu_quick.sh               # on any machine, before a lease: every step on the CPU at
#                                                     # toy sizes (tests collected, not run), so a broken call is
#                                                     # found here rather than in the device's 15 minutes
# The full check with DeepSpeed and two models is `python -m benchmarks.gpu_check` (30 minutes; docs/gpu.md).
OUT=${OUT:-$PWD/gpu-quick}; mkdir -p "$OUT"
DEV=cuda ELEMS=51463168 COLLECT=
if [ -n "$SMOKE" ]; then  # the same calls, small: the CPU, a toy model in fp32, a 1M-parameter update
  DEV=cpu ELEMS=1048576 COLLECT=--collect-only PASS_PARAMS=1e6 SIZE=tiny DTYPE=fp32 BATCH=2 SEQ=64
fi
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
WORK=$(mktemp -d)
S=$(date +%s)
{ nvidia-smi -L; echo "cores $(nproc)"; free -g | head -2; df -h "$WORK" | tail -1
  echo "avx512_bf16 cores: $(grep -c avx512_bf16 /proc/cpuinfo)"
  $PY -c "import sys, torch, lightning, transformers, peft, accelerate; print(sys.version); print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0)); print('lightning', lightning.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)"
  $PY -c "import torchao" 2>&1 | tail -1; ls /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 2>&1
  echo "c++: $(c++ --version 2>&1 | head -1); ninja: $(ninja --version 2>&1)"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
echo "== the one-pass update: build, check, an update's phases on $DEV (at $(( $(date +%s) - S )) s)"
timeout -k 5 "${T_PASS:-90}" $PY benchmarks/update_phases_bench.py --device $DEV --params "${PASS_PARAMS:-355e6}" \
  --rounds 1 --out "$OUT/update_phases.json" > "$OUT/update_phases.log" 2>&1
echo "phases exit $?"; tail -14 "$OUT/update_phases.log"
echo "== a speculative update's norm beside its job's calls, $(nproc) threads (at $(( $(date +%s) - S )) s)"
for calls in first carried first carried; do  # GPT-2's embedding in 1.4M-element chunks; docs/one-pass-update.md
  timeout -k 5 "${T_NORMS:-30}" $PY docs/history/results/norms_carried_2026-12-07/carried.py --threads "$(nproc)" \
    --elems $ELEMS --calls $calls --steps 20 --per-call
done > "$OUT/norms_carried.log" 2>&1
echo "norms exit $?"; cat "$OUT/norms_carried.log"
echo "== tests on $DEV (at $(( $(date +%s) - S )) s)"
FUYOU_TEST_DEVICE=$DEV timeout -k 5 "${T_TESTS:-150}" $PY -m pytest -q -p no:cacheprovider -rfs -m "device and not late_copies" --durations=15 $COLLECT > "$OUT/tests.log" 2>&1
echo "tests exit $?"; tail -25 "$OUT/tests.log"
echo "== peers at ${SIZE:-350M} (at $(( $(date +%s) - S )) s)"
timeout -k 5 "${T_BENCH:-270}" $PY -m benchmarks.peers --device $DEV --arch gpt2 --sizes "${SIZE:-350M}" \
  --systems "${SYSTEMS:-torch,fuyou-hf,fuyou-lightning,fuyou-lightning@device_state=12GiB,fuyou-state-ssd,fuyou-ssd}" --dtype "${DTYPE:-bf16}" \
  --batch "${BATCH:-8}" --seq "${SEQ:-1024}" --steps "${STEPS:-3}" --warmup "${WARMUP:-5}" --rounds 1 --swap-dir "$WORK/swap" --out "$WORK/bench" \
  --trace "$WORK/trace" > "$OUT/bench.log" 2>&1
echo "bench exit $?"; tail -30 "$OUT/bench.log"
(cd "$WORK" && tar czf "$OUT/results.tgz" bench trace swap/*.log 2>/dev/null)
rm -rf "$WORK"
echo "total $(( $(date +%s) - S )) s; files in $OUT"
