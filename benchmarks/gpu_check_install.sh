#!/usr/bin/env bash
# gpu_check's install step: the CUDA build of the torch version already installed (PyPI's Linux wheels are
# CUDA builds), then DeepSpeed, with torch held at that version so that no extra ever replaces it.
# Nothing is installed when both are there already.
set -euo pipefail
PY=${PYTHON:-python}
version=$($PY -c 'import torch; print(torch.__version__.split("+")[0])')
if ! $PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "torch $version has no CUDA here: installing PyPI's torch==$version (a CUDA build)"
  $PY -m pip install -q --force-reinstall --no-deps "torch==$version"
  $PY -m pip install -q "torch==$version"
fi
$PY -c 'import torch; assert torch.cuda.is_available(), "torch sees no GPU after the install"; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))'
# Wheels carried to a machine with no network (docs/gpu.md says how to make them): installed as they are.
WHEELS=${FUYOU_WHEELS:-$(dirname "$0")/../.whl}
if ! $PY -c 'import deepspeed' 2>/dev/null && compgen -G "$WHEELS/*.whl" > /dev/null; then
  echo "installing the carried wheels in $WHEELS"
  $PY -m pip install -q --no-index --no-deps "$WHEELS"/*.whl
fi
if ! $PY -c 'import deepspeed' 2>/dev/null; then
  echo "torch==$version" > /tmp/gpu-check-constraints.txt
  DS_BUILD_OPS=0 $PY -m pip install -q -c /tmp/gpu-check-constraints.txt deepspeed
fi
$PY -c 'import deepspeed; print("deepspeed", deepspeed.__version__)'
