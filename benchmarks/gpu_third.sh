#!/usr/bin/env bash
# The third GPU lease's second call (2026-11-26): the device suite on CUDA after the asynchronous publish of
# resident weights (device.when_landed) and the auto schedule's measured window times, then the peers at 350M
# bf16 with enough warm-up steps for `auto` to have measured both schedules (8 windows after the plan, then two
# of next_forward) before the timed steps. Results under $OUT.
OUT=${OUT:-$PWD/gpu-third}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
W=$(mktemp -d)
FUYOU_TEST_DEVICE=cuda timeout -k 5 "${T_TESTS:-110}" python3 -m pytest -q -p no:cacheprovider -rfs -m device \
  > "$OUT/tests.log" 2>&1
echo "tests exit $?"; tail -4 "$OUT/tests.log"
timeout -k 5 "${T_BENCH:-170}" python3 -m benchmarks.peers --device cuda --arch gpt2 --sizes 350M \
  --systems "${SYSTEMS:-torch,fuyou-hf,fuyou-hf-next-forward}" --dtype bf16 --batch 8 --seq 1024 --steps 4 \
  --warmup 14 --rounds 1 --swap-dir "$W/swap" --out "$OUT/bench" --trace "$OUT/trace" > "$OUT/bench.log" 2>&1
echo "bench exit $?"; grep -E "^\| (torch|fuyou)" "$OUT/bench.log"
rm -rf "$W"
