"""What the benchmarks share: fresh-process runs, the allocator, peak RSS, medians."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

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


def run_interleaved(script: str, once: list[str], repeated: list[str], rounds: int, argv: list[str],
                    use_jemalloc: bool = True) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """Run ``once`` configurations once, then ``repeated`` ones ``rounds`` times, interleaved.

    Each run is a fresh process (``script --worker CONFIG argv``). Returns every run, and per
    configuration one merged result: all timed steps (``step_s``) of all rounds, and the
    median of the processes' ``peak_rss``.
    """
    runs: dict[str, list[dict]] = {}
    for config in once + repeated * rounds:
        print(f"running {config} ...", file=sys.stderr, flush=True)
        runs.setdefault(config, []).append(run_fresh(script, ["--worker", config, *argv], use_jemalloc))
    merged = {}
    for config, rs in runs.items():
        result = dict(rs[-1])
        if "step_s" in result:
            result["step_s"] = [t for r in rs for t in r["step_s"]]
            result["peak_rss"] = statistics.median(r["peak_rss"] for r in rs)
        merged[config] = result
    return runs, merged


def worker_argv(args: argparse.Namespace, parent_only: tuple[str, ...]) -> list[str]:
    """The parent's options, as ``--name=value`` for its workers, less those only the parent uses."""
    skip = {"worker", "json", "no_jemalloc", "rounds", *parent_only}
    return [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in skip and v is not None]


def temporary_swap_dir(args: argparse.Namespace, prefix: str) -> tempfile.TemporaryDirectory | None:
    """Set ``args.swap_dir`` to a fresh temporary directory unless one was given; the caller cleans it up."""
    if args.swap_dir is not None:
        return None
    tmp = tempfile.TemporaryDirectory(prefix=prefix, dir=os.environ.get("TMPDIR", "/tmp"))
    args.swap_dir = tmp.name
    return tmp
