# What this folder's files came from (run from the repository root, the venv at /work/main/.venv).
PY=/work/main/.venv/bin/python
$PY tests/mutation_check.py --new-only --no-baseline --only device-no-regrow --only device-cache-kept \
  --only device-regrow-each-step --only device-headroom --only state-split-before-streaming \
  --only batch-guard-unarmed --only batch-guard-every-batch --only batch-guard-eval \
  --json docs/history/results/device_tier_growth_2026-12-07/mutants.json > docs/history/results/device_tier_growth_2026-12-07/mutants.txt 2>&1
$PY docs/history/results/device_tier_growth_2026-12-07/pose_cuda_test.py . /tmp/posed
(cd /tmp/posed && PYTHONPATH=/tmp/posed/src:/tmp/posed $PY -m pytest -q -p no:cacheprovider tests/test_on_device.py \
  -k grows_after -rA) > docs/history/results/device_tier_growth_2026-12-07/posed_cuda_test.txt 2>&1
# the same posed test with the growth removed (mutant device-no-regrow applied by hand): it must fail
sed -i 's/            if self._device_tier_asked is not None:/            if False:/' /tmp/posed/src/fuyou_strategy/engine.py
(cd /tmp/posed && PYTHONPATH=/tmp/posed/src:/tmp/posed $PY -m pytest -q -p no:cacheprovider tests/test_on_device.py \
  -k grows_after 2>&1 | grep -E "^E  |passed|failed" | head -6) > docs/history/results/device_tier_growth_2026-12-07/posed_cuda_test_no_regrow.txt
# the data-parallel mutant (all of test_distributed.py; the growth test's ranks time out after 120 s when one rank
# skips the growth's landing, a collective)
$PY tests/mutation_check.py --new-only --no-baseline --only device-regrow-where-room \
  --json docs/history/results/device_tier_growth_2026-12-07/mutant_dp.json > docs/history/results/device_tier_growth_2026-12-07/mutant_dp.txt 2>&1
$PY tests/mutation_check.py --new-only --no-baseline --only device-regrow-compared-early \
  --json docs/history/results/device_tier_growth_2026-12-07/mutant_compared.json > docs/history/results/device_tier_growth_2026-12-07/mutant_compared.txt 2>&1
$PY tests/mutation_check.py --new-only --no-baseline --only device-pinned-unmeasured \
  --json docs/history/results/device_tier_growth_2026-12-07/mutant_pinned.json > docs/history/results/device_tier_growth_2026-12-07/mutant_pinned.txt 2>&1
$PY tests/mutation_check.py --new-only --no-baseline --only act-median \
  --json docs/history/results/device_tier_growth_2026-12-07/mutant_act.json > docs/history/results/device_tier_growth_2026-12-07/mutant_act.txt 2>&1
# the GPU lease's script rehearsed on the CPU at toy sizes, after every change above (torch's start-up warnings left out)
SMOKE=1 bash benchmarks/gpu_quick.sh 2>&1 | grep -v "W1208\|torchao/_C" > docs/history/results/device_tier_growth_2026-12-07/gpu_quick_smoke.txt
