"""Side-by-side sequential bandwidth: fuyou's `IOEngine` against ``fio``, O_DIRECT.

What it measures
----------------
For each block size, on the same directory, with the same file size and parallelism:

* engine      -- `fuyou_strategy.storage.probe.measure_bandwidth`: ``--threads`` worker
  threads ``os.pwritev`` / ``os.preadv`` ``--block-size`` blocks of ONE ``O_DIRECT`` file,
  taking them from a shared queue; the write pass ends with ``fdatasync``, then the file
  is read back. Each engine measurement runs in a fresh Python process.
* fio psync   -- ``--ioengine=psync --numjobs=T --size=SIZE/T --offset_increment=SIZE/T``
  on one ``--filename``: T synchronous jobs, each streaming its own slice of one file.
* fio libaio  -- ``--ioengine=libaio --iodepth=T --numjobs=1``: one job keeping T requests
  in flight, sequentially, on one file.

Both fio variants use ``--direct=1``; writes use ``--end_fsync=1`` (the engine fdatasyncs
at the end too) on a fresh file (fio preallocates it, as the engine does with
``posix_fallocate``); reads run on the file that fio just wrote. ``ratio`` is
engine / max(fio psync, fio libaio): the stricter comparison. Engine and fio runs are
interleaved for ``--repeats`` rounds (the order alternates each round so slow drift of a
shared disk does not favour one side) and medians are reported. MB/s = 10**6 bytes/s.

How to run (from the repository root)
-------------------------------------
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 .venv/bin/python benchmarks/io_bench.py

Options: ``--dir`` (default: a fresh temporary directory, removed afterwards), ``--size``
(1GiB), ``--block-sizes`` ("1MiB,4MiB"), ``--threads`` (4), ``--repeats`` (3), ``--json``
(benchmarks/results/io_bench.json). It prints a paste-able table and a summary line per
op (minimum ratio over block sizes >= 1 MiB against the 0.90 target), and writes every
raw repeat, the medians, the ratios and machine information to the JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import allocator, run_fresh  # noqa: E402
from fuyou_strategy.config import format_bytes, parse_bytes  # noqa: E402

FIO = shutil.which("fio") or "/usr/bin/fio"
TARGET = 0.90
OPS = ("write", "read")
FIO_VARIANTS = ("psync", "libaio")
MB = 1e6


# -- one engine measurement, in its own process -------------------------------------------------
def _engine_worker(args: argparse.Namespace) -> None:
    from fuyou_strategy.storage.probe import measure_bandwidth

    before = disk_stat(args.dir)
    bw = measure_bandwidth(args.dir, size=args.size, block_size=args.block_size, threads=args.threads, direct_io="on")
    out = bw.as_dict()
    out["avg_request_kib"] = request_kib(before, disk_stat(args.dir))
    out["jemalloc_mapped"] = _jemalloc_mapped()
    print(json.dumps(out))


def _jemalloc_mapped() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "jemalloc" in f.read()
    except OSError:
        return False


def disk_stat(directory: str) -> tuple[int, int, int, int] | None:
    """(reads, read sectors, writes, write sectors) completed by the block device holding ``directory``."""
    dev = os.stat(directory).st_dev
    try:
        with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat") as f:
            v = [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return None
    return v[0], v[2], v[4], v[6]


def request_kib(before, after) -> dict[str, float | None]:
    """Average request size (KiB) the device completed per op between two `disk_stat` snapshots.

    A diagnostic: with O_DIRECT, a block whose user buffer is not physically contiguous
    needs one segment per page and is split when it exceeds the queue's ``max_segments``,
    so the same block size can reach the drive as fewer, larger requests for one side.
    """
    if before is None or after is None:
        return {"write": None, "read": None}
    d = [a - b for a, b in zip(after, before)]
    return {
        "read": d[1] * 512 / 1024 / d[0] if d[0] else None,
        "write": d[3] * 512 / 1024 / d[2] if d[2] else None,
    }


def run_engine(directory: str, size: int, block_size: int, threads: int) -> dict:
    argv = ["--_engine-worker", "--dir", directory, "--size", str(size), "--block-size", str(block_size),
            "--threads", str(threads)]
    return run_fresh(os.path.abspath(__file__), argv)


# -- fio -------------------------------------------------------------------------------------------
def fio_cmd(path: str, op: str, variant: str, size: int, block_size: int, threads: int) -> list[str]:
    cmd = [
        FIO, f"--name=io-bench-{variant}-{op}", f"--filename={path}", f"--rw={op}", f"--bs={block_size}",
        "--direct=1", "--invalidate=1", "--group_reporting", "--output-format=json",
    ]
    if variant == "psync":
        part = size // threads
        cmd += ["--ioengine=psync", f"--numjobs={threads}", f"--size={part}", f"--offset_increment={part}"]
    else:
        cmd += ["--ioengine=libaio", f"--iodepth={threads}", "--numjobs=1", f"--size={size}"]
    if op == "write":
        cmd.append("--end_fsync=1")
    return cmd


def run_fio(path: str, op: str, variant: str, size: int, block_size: int, threads: int) -> tuple[float, float | None]:
    """fio's bandwidth (bytes/s) and the average device request size (KiB) during the run."""
    cmd = fio_cmd(path, op, variant, size, block_size, threads)
    before = disk_stat(os.path.dirname(path))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    req = request_kib(before, disk_stat(os.path.dirname(path)))[op]
    if proc.returncode != 0:
        raise SystemExit(f"fio failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}{proc.stdout}")
    # fio may print warnings before the JSON object.
    data = json.loads(proc.stdout[proc.stdout.index("{"):])
    job = data["jobs"][0]
    if job.get("error"):
        raise SystemExit(f"fio job error {job['error']}: {' '.join(cmd)}")
    moved = job[op]["io_bytes"]
    if moved != size:
        raise SystemExit(f"fio moved {moved} bytes, expected {size}: {' '.join(cmd)}")
    return float(job[op]["bw_bytes"]), req


def run_fio_pair(directory: str, variant: str, size: int, block_size: int, threads: int) -> tuple[dict, dict]:
    """Write a fresh file with fio, read it back, delete it: ({op: bytes/s}, {op: avg request KiB})."""
    path = os.path.join(directory, f"fio-{variant}-{os.getpid()}.bin")
    try:
        write, write_req = run_fio(path, "write", variant, size, block_size, threads)
        read, read_req = run_fio(path, "read", variant, size, block_size, threads)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return {"write": write, "read": read}, {"write": write_req, "read": read_req}


# -- machine info ----------------------------------------------------------------------------------
def machine_info(directory: str) -> dict:
    from fuyou_strategy.storage.aio import filesystem_type

    preload = os.environ.get("LD_PRELOAD", "")
    fio_version = subprocess.run([FIO, "--version"], capture_output=True, text=True).stdout.strip()
    dev = os.stat(directory).st_dev
    block = f"{os.major(dev)}:{os.minor(dev)}"
    queue = {}
    for attr in ("scheduler", "max_segments", "max_sectors_kb", "nr_requests", "rotational"):
        for q in (f"/sys/dev/block/{block}/queue", f"/sys/dev/block/{block}/../queue"):  # disk, or partition's disk
            try:
                with open(os.path.join(q, attr)) as f:
                    queue[attr] = f.read().strip()
                break
            except OSError:
                pass
    return {
        "nproc": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0)),
        "filesystem": filesystem_type(directory),
        "directory": directory,
        "block_device": block,
        "io_scheduler": queue.get("scheduler"),
        "queue": queue,
        "allocator": allocator(),  # of the engine processes; run_fresh preloads jemalloc when installed
        "ld_preload": preload,
        "fio_version": fio_version,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "loadavg_start": os.getloadavg(),
    }


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="directory to test (default: fresh temp dir, removed afterwards)")
    p.add_argument("--size", default="1GiB", help="file size per measurement (default 1GiB)")
    p.add_argument("--block-sizes", default="1MiB,4MiB", help="comma-separated block sizes (default 1MiB,4MiB)")
    p.add_argument("--threads", type=int, default=4, help="engine threads = fio numjobs = fio iodepth (default 4)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "io_bench.json"))
    p.add_argument("--_engine-worker", dest="engine_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--block-size", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.size = parse_bytes(args.size, name="--size")
    return args


def spread(values: list[float]) -> float:
    """(max - min) / median, as a fraction."""
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med else 0.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine_worker:
        _engine_worker(args)
        return 0

    block_sizes = [parse_bytes(b.strip(), name="--block-sizes") for b in args.block_sizes.split(",") if b.strip()]
    threads = args.threads
    own_dir = args.dir is None
    directory = tempfile.mkdtemp(prefix="fuyou-io-bench-") if own_dir else os.path.abspath(args.dir)

    try:
        info = machine_info(directory)
        print(f"dir={directory}  fs={info['filesystem']}  nproc={info['nproc']}  allocator={info['allocator']}"
              f"  {info['fio_version']}  scheduler={info['io_scheduler']}"
              f"  max_segments={info['queue'].get('max_segments')}")
        print(f"threads={threads}  repeats={args.repeats}  O_DIRECT  block sizes="
              f"{', '.join(format_bytes(b) for b in block_sizes)}")

        rows = []
        for bs in block_sizes:
            # Whole blocks, and an equal whole number of blocks per fio psync job.
            unit = bs * threads
            size = max(unit, args.size // unit * unit)
            if size != args.size:
                print(f"note: size rounded to {format_bytes(size)} for block size {format_bytes(bs)}")
            raw = {"engine": {op: [] for op in OPS}, **{v: {op: [] for op in OPS} for v in FIO_VARIANTS}}
            req = {who: {op: [] for op in OPS} for who in raw}
            engine_meta = None
            for r in range(args.repeats):
                order = ["engine", *FIO_VARIANTS] if r % 2 == 0 else [*FIO_VARIANTS, "engine"]
                for who in order:
                    if who == "engine":
                        res = run_engine(directory, size, bs, threads)
                        if not res["direct"]:
                            raise SystemExit("engine did not use O_DIRECT")
                        engine_meta = res
                        got = {"write": res["write_bps"], "read": res["read_bps"]}
                        kib = res["avg_request_kib"]
                    else:
                        got, kib = run_fio_pair(directory, who, size, bs, threads)
                    for op in OPS:
                        raw[who][op].append(got[op])
                        req[who][op].append(kib[op])
                print(f"  {format_bytes(bs)} round {r + 1}/{args.repeats}: "
                      + "  ".join(f"{who} w={raw[who]['write'][-1] / MB:.0f} r={raw[who]['read'][-1] / MB:.0f}"
                                  for who in raw), flush=True)
            for op in OPS:
                med = {who: statistics.median(raw[who][op]) for who in raw}
                best = max(med[v] for v in FIO_VARIANTS)
                rows.append({
                    "block_size": bs, "op": op, "size": size,
                    "raw_bps": {who: raw[who][op] for who in raw},
                    "median_bps": med,
                    "spread": {who: spread(raw[who][op]) for who in raw},
                    "avg_request_kib": {who: req[who][op] for who in raw},
                    "best_fio": max(FIO_VARIANTS, key=lambda v: med[v]),
                    "ratio": med["engine"] / best if best else float("nan"),
                })
            info["engine_jemalloc_mapped"] = engine_meta["jemalloc_mapped"] if engine_meta else None

        # -- table -----------------------------------------------------------------------------
        print()
        print("| block size | op    | engine MB/s | fio psync MB/s | fio libaio MB/s | ratio engine/best-fio |")
        print("|-----------:|-------|------------:|---------------:|----------------:|----------------------:|")
        for row in rows:
            m = row["median_bps"]
            print(f"| {format_bytes(row['block_size']):>10} | {row['op']:<5} | {m['engine'] / MB:11.0f} |"
                  f" {m['psync'] / MB:14.0f} | {m['libaio'] / MB:15.0f} | {row['ratio']:21.2f} |")
        print()
        noisy = [
            f"{format_bytes(r['block_size'])} {r['op']} {who} {s * 100:.0f}%"
            for r in rows for who, s in r["spread"].items() if s > 0.15
        ]
        if noisy:
            print("high variance ((max-min)/median > 15%): " + "; ".join(noisy))

        def kib(values: list) -> str:
            values = [v for v in values if v is not None]
            return f"{statistics.median(values):.0f}" if values else "?"

        print("median device request size, KiB (engine / psync / libaio) -- smaller than the block size"
              " means the kernel split blocks:")
        for r in rows:
            k = r["avg_request_kib"]
            print(f"  {format_bytes(r['block_size'])} {r['op']:<5}: " + " / ".join(kib(k[w]) for w in k))
        print()

        summary = {}
        for op in OPS:
            ratios = [r["ratio"] for r in rows if r["op"] == op and r["block_size"] >= 2**20]
            if not ratios:
                continue
            worst = min(ratios)
            ok = worst >= TARGET
            summary[op] = {"min_ratio": worst, "target": TARGET, "meets_target": ok}
            print(f"{op:<5}: min ratio engine/best-fio over block sizes >= 1 MiB = {worst:.2f}"
                  f"  -> {'MEETS' if ok else 'MISSES'} target >= {TARGET:.2f}")

        info["loadavg_end"] = os.getloadavg()
        out = {
            "config": {
                "size": args.size, "block_sizes": block_sizes, "threads": threads, "repeats": args.repeats,
                "direct": True, "fio_commands": {
                    f"{v}-{op}": fio_cmd("<file>", op, v, rows[0]["size"], block_sizes[0], threads)
                    for v in FIO_VARIANTS for op in OPS
                } if rows else {},
            },
            "machine": info,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "rows": rows,
            "summary": summary,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")
        return 0
    finally:
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
