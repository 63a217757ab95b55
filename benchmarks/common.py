"""What the benchmarks share: fresh-process runs, the allocator, peak RSS, medians."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"


def allocator(use_jemalloc: bool = True) -> str:
    """The allocator the child processes will use."""
    preloaded = "jemalloc" in os.environ.get("LD_PRELOAD", "")
    return "jemalloc" if preloaded or (use_jemalloc and os.path.exists(JEMALLOC)) else "glibc malloc"


def run_fresh(script: str, argv: list[str], use_jemalloc: bool = True) -> dict:
    """Run ``script argv`` in a new Python process (jemalloc preloaded when installed); parse its last line as JSON."""
    env = dict(os.environ)
    if use_jemalloc and os.path.exists(JEMALLOC) and "jemalloc" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = JEMALLOC
    proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{script} {' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def peak_rss_bytes() -> int:
    """This process's peak resident set size."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
