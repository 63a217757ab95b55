"""What the state's I/O costs the compute beside it: fp32 matmuls timed alone and with swap I/O running.

Why: with the optimizer state on the SSD, the training step on a 2-core machine can be slower than the
drive's time explains. The drive moves bytes without the CPU, but the operating system (and, in a virtual
machine, the hypervisor emulating the disk) spends CPU per request and per byte. With every core busy
computing, that CPU comes out of the compute: ``sy`` in ``/proc/stat``, and ``steal`` where the hypervisor
takes the virtual CPU away to serve the disk.

What it measures: one fresh Python process per configuration and round, rounds interleaved, each calling
`fuyou_strategy.storage.probe.measure_io_cpu_cost` (what ``fuyou doctor`` runs): fp32 matmuls on every core timed
alone, then beside fuyou's own `IOEngine` streaming ``O_DIRECT`` writes and reads of a swap file from page-aligned
host buffers (the optimizer's pattern: a chunk written while another is read), then alone again. Per
configuration (medians over the rounds):

* ``compute × alone``: the matmuls' time beside the stream against alone, in the same process;
* ``GB/s moved``: bytes written plus read while the matmuls ran, per second;
* ``lost s/GB``: compute seconds lost per GB moved, ``(beside - alone) / GB``;
* the shares of the machine's CPU time (``/proc/stat``) in system and steal while they ran.

Run (from the repository root, nothing else running; jemalloc as everywhere):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 .venv/bin/python benchmarks/io_cpu_bench.py \\
        --dir /tmp/iocpu --configs 1MiB/2,4MiB/2,16MiB/2,1MiB/1,1MiB/2/w,1MiB/2/r,1MiB/2@0.1 --rounds 3 --json out.json

A configuration is ``BLOCK/THREADS[/MODE][@RATE]``: `FuyouConfig.io_block_size` / ``io_threads``; ``MODE`` ``rw``
(default: a write and a read in flight together), ``w`` (writes only) or ``r`` (reads only); ``@RATE`` caps the
stream at RATE GB/s (does the compute lose per byte moved, or per second of I/O?).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from fuyou_strategy.config import parse_bytes


def worker(config: str, directory: str, seconds: float, size: int) -> dict:
    """One configuration, measured in this process."""
    from fuyou_strategy.storage.probe import measure_io_cpu_cost

    spec, _, cap = config.partition("@")
    block, threads, mode = (spec + "/rw").split("/")[:3]
    cost = measure_io_cpu_cost(directory, seconds=seconds, size=size, block_size=parse_bytes(block),
                               io_threads=int(threads), mode=mode, rate=float(cap) * 1e9 if cap else None)
    return {"config": config, **cost.as_dict()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/tmp/iocpu")
    p.add_argument("--configs", default="1MiB/2,4MiB/2,16MiB/2,1MiB/1,1MiB/2/w,1MiB/2/r,1MiB/2@0.1")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=6.0, help="about how long the matmuls take alone, per run")
    p.add_argument("--size", default="2GiB", help="swap file size the stream cycles over")
    p.add_argument("--json", default="benchmarks/results/io_cpu_bench.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.dir, args.seconds, parse_bytes(args.size))))
        return

    configs = args.configs.split(",")
    runs: list[dict] = []
    for rnd in range(args.rounds):
        for config in (configs if rnd % 2 == 0 else configs[::-1]):
            out = subprocess.run([sys.executable, __file__, "--worker", config, "--dir", args.dir,
                                  "--seconds", str(args.seconds), "--size", args.size],
                                 capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                sys.exit(f"configuration {config!r}, round {rnd + 1}, failed:\n{out.stderr[-4000:]}")
            r = {**json.loads(out.stdout.strip().splitlines()[-1]), "round": rnd}
            runs.append(r)
            print(f"round {rnd + 1} {config:>12}: alone {r['alone_s']:.2f} s, beside {r['beside_s']:.2f} s, "
                  f"{r['bytes_moved'] / 1e9:.1f} GB moved", flush=True)

    rows = []
    for config in configs:
        mine = [r for r in runs if r["config"] == config]
        med = lambda key: statistics.median(key(r) for r in mine)  # noqa: E731
        rows.append({"config": config, "compute_ratio": med(lambda r: r["beside_s"] / r["alone_s"]),
                     "gb_per_s": med(lambda r: r["bytes_moved"] / r["beside_s"] / 1e9),
                     "lost_s_per_gb": med(lambda r: r["lost_s_per_gb"]),
                     "system_share": med(lambda r: r["system_share"] or 0.0),
                     "steal_share": med(lambda r: r["steal_share"] or 0.0)})

    print(f"\n{'config':>12} {'compute × alone':>16} {'GB/s moved':>11} {'lost s/GB':>10} {'system':>7} {'steal':>6}")
    for r in rows:
        print(f"{r['config']:>12} {r['compute_ratio']:>16.3f} {r['gb_per_s']:>11.2f} {r['lost_s_per_gb']:>10.2f} "
              f"{r['system_share']:>7.0%} {r['steal_share']:>6.0%}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "allocator": os.environ.get("LD_PRELOAD", "system malloc")},
        "args": vars(args), "rows": rows, "runs": runs}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
