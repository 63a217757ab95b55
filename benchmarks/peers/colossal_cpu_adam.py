"""Build Colossal-AI's CPU Adam kernel on a machine without CUDA.

Colossal-AI 0.5's x86 CPU Adam (``extensions/csrc/kernel/x86/cpu_adam.{h,cpp}``) is pure C++ with
AVX intrinsics, but its header includes ``cublas_v2.h``, ``cuda.h``, ``cuda_fp16.h`` and
``cuda_runtime_api.h`` and its loader only offers it as a CUDA extension, so ``HybridAdam`` fails
with "No usable kernel found for CPUAdamLoader" where CUDA is absent. The only CUDA symbol the
kernel uses is the ``__half`` type (for fp16 parameters), which ``c10::Half`` provides with the same
layout and float conversions. This copies the two sources, replaces those four includes with
``c10/util/Half.h`` and a ``__half`` alias, and JIT-builds them with torch's C++ extension loader
(about 30 s, cached under ``~/.cache/torch_extensions``). The optimizer's arithmetic is unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path

CUDA_INCLUDES = re.compile(r"#include <(cublas_v2|cuda|cuda_fp16|cuda_runtime_api)\.h>\n")


def build_without_cuda():
    """The compiled kernel module (it has ``CPUAdamOptimizer``), built once per machine."""
    import colossalai
    from torch.utils.cpp_extension import load

    src = Path(colossalai.__file__).parent / "kernel" / "extensions" / "csrc" / "kernel" / "x86"
    if not (src / "cpu_adam.h").exists():
        raise FileNotFoundError(f"{src}/cpu_adam.h: Colossal-AI's kernel sources are not installed with it")
    build = Path.home() / ".cache" / "fuyou-peers" / "colossal_cpu_adam"
    build.mkdir(parents=True, exist_ok=True)
    header = CUDA_INCLUDES.sub("", (src / "cpu_adam.h").read_text())
    header = header.replace("#include <torch/extension.h>",
                            "#include <torch/extension.h>\n#include <c10/util/Half.h>\ntypedef c10::Half __half;", 1)
    for name, text in (("cpu_adam.h", header), ("cpu_adam.cpp", (src / "cpu_adam.cpp").read_text())):
        path = build / name
        if not path.exists() or path.read_text() != text:  # rewriting unchanged files would force a rebuild
            path.write_text(text)
    return load(name="colossal_cpu_adam_nocuda", sources=[str(build / "cpu_adam.cpp")],
                extra_cflags=["-O3", "-std=c++17", "-fopenmp", "-march=native"], extra_ldflags=["-fopenmp"])
