"""Helpers that `gpu_check` runs in child processes (so that its own process never touches CUDA).

    python -m benchmarks.gpu_check_env OUT.json SWAP_DIR                       # the environment
    python -m benchmarks.gpu_check_env --plan ARCH SIZE BATCH SEQ OUT.json     # fuyou plan for a peers model
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def environment(out: str, swap: str) -> None:
    import torch

    from fuyou_strategy.device import accelerator
    Path(swap).mkdir(parents=True, exist_ok=True)
    found = accelerator()
    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "gpu": found[0] if found else None, "gpu_bytes": found[1] if found else None,
            "gpus": torch.cuda.device_count() if found else 0, "cpus": os.cpu_count(),
            "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "swap_dir": swap, "swap_free_bytes": shutil.disk_usage(swap).free}
    try:
        import deepspeed
        info["deepspeed"] = deepspeed.__version__
    except Exception as e:  # noqa: BLE001 - reported, not fatal: the bench row will say it too
        info["deepspeed"] = f"not importable: {type(e).__name__}: {e}"
    Path(out).write_text(json.dumps(info, indent=1))
    print(json.dumps(info, indent=1))


def plan(arch: str, size: str, batch: str, seq: str, out: str) -> None:
    """``fuyou plan`` on the peers' model config, with this machine's GPU, RAM and the H100 preset."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
    from systems import Job
    import torch
    job = Job(arch=arch, size=size, model=None, dtype="bf16", batch=int(batch), seq=int(seq), steps=1, swap_dir="")
    gpu = "h100" if torch.cuda.is_available() else "cpu"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with tempfile.TemporaryDirectory() as d:
        job.hf_config().save_pretrained(d)
        subprocess.run([sys.executable, "-m", "fuyou_strategy.cli", "plan", str(Path(d) / "config.json"), "--gpu", gpu,
                        "--host-memory", str(ram), "--batch", batch, "--seq", seq, "--host-state", "auto",
                        "--json", out], check=True)


if __name__ == "__main__":
    if sys.argv[1] == "--plan":
        plan(*sys.argv[2:7])
    else:
        environment(sys.argv[1], sys.argv[2])
