#!/usr/bin/env bash
# Install the peers the benchmark compares against (DeepSpeed, Colossal-AI) into the current
# Python environment without changing its torch. Tested with torch 2.13.0 (CPU), Python 3.11:
#   bash benchmarks/peers/install.sh            # or PYTHON=/path/to/python bash ...
# - DeepSpeed comes from the `peers` extra (deepspeed==0.19.8), with torch pinned to the installed one.
# - Colossal-AI 0.5.0 pins torch<=2.5.1 and transformers==4.51.3, so pip would replace both (and pull
#   CUDA wheels): it is installed without its dependencies, plus what HybridAdam and Gemini import.
#   Its CPU Adam kernel does not build without CUDA; colossal_cpu_adam.py builds it at run time.
# - tensornvme (Colossal-AI's NVMe optimizer) is built with its libaio backend.
# - libaio-dev (DeepSpeed's async I/O and tensornvme) comes from apt when missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
TORCH=$("$PY" -c "import torch; print(torch.__version__)")
PIN=$(mktemp)
trap 'rm -f "$PIN"' EXIT
echo "torch==${TORCH%%+*}" > "$PIN"

if [ ! -e /usr/include/libaio.h ]; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get install -y libaio-dev
fi
"$PY" -m pip install -c "$PIN" -e ".[peers]"
"$PY" -m pip install --no-deps colossalai==0.5.0 galore-torch==1.0
"$PY" -m pip install -c "$PIN" einops==0.8.2 contexttimer==0.3.3 rich click bitsandbytes==0.50.2
DISABLE_URING=1 "$PY" -m pip install --no-build-isolation --no-deps tensornvme==0.1.0

AFTER=$("$PY" -c "import torch; print(torch.__version__)")
if [ "$AFTER" != "$TORCH" ]; then
    echo "install.sh: torch changed from $TORCH to $AFTER; reinstall torch==${TORCH%%+*}" >&2
    exit 1
fi
"$PY" -c "import deepspeed, colossalai, tensornvme; print('peers installed: deepspeed', deepspeed.__version__, \
'colossalai', colossalai.__version__, 'torch', '$TORCH')" 2>/dev/null
