"""The ``fuyou`` command: ``fuyou io-bench`` and ``fuyou clean``."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from typing import Sequence

from .config import PAGE, ConfigError, format_bytes, parse_bytes

__all__ = ["main"]


def _size(text: str) -> int:
    try:
        return parse_bytes(text, name="--size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _block_sizes(text: str) -> list[int]:
    try:
        sizes = [parse_bytes(part, name="--block-sizes") for part in text.split(",")]
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    for size in sizes:
        if size < PAGE or size % PAGE:
            raise argparse.ArgumentTypeError(f"got {size} bytes; each block size must be a positive multiple of 4 KiB (O_DIRECT)")
    return sizes


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _cmd_io_bench(args: argparse.Namespace) -> int:
    from .storage.probe import measure_bandwidth

    dirs = args.dir or [None]
    rows = []
    header = f"{'directory':<32} {'fs':<6} {'direct':<6} {'block':>9} {'threads':>7} {'write MB/s':>11} {'read MB/s':>10}"
    print(header)
    print("-" * len(header))
    for d in dirs:
        with tempfile.TemporaryDirectory(prefix="fuyou-iobench-") as tmp:
            where = d if d is not None else tmp
            for block in args.block_sizes:
                for threads in args.threads:
                    bw = measure_bandwidth(where, size=args.size, block_size=block, threads=threads, direct_io=args.direct_io)
                    rows.append(bw.as_dict())
                    print(
                        f"{where[-32:]:<32} {bw.filesystem:<6} {str(bw.direct):<6} {format_bytes(block):>9} "
                        f"{threads:>7} {bw.write_bps / 1e6:>11.0f} {bw.read_bps / 1e6:>10.0f}",
                        flush=True,
                    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _cmd_clean(args: argparse.Namespace) -> int:
    from .storage.rundir import find_stale_runs, remove_run_dir

    dirs = args.dir or [tempfile.gettempdir()]
    if args.dir is None:  # default swap dirs are fuyou-swap-* folders in the temp dir
        import glob

        dirs += glob.glob(f"{tempfile.gettempdir()}/fuyou-swap-*")
    stale = find_stale_runs(dirs)
    if not stale:
        print(f"no stale fuyou run directories in {', '.join(dirs)}")
        return 0
    for run in stale:
        action = "would remove" if args.dry_run else "removing"
        print(f"{action} {run.path} ({format_bytes(run.nbytes)}; {run.reason})")
        if not args.dry_run:
            remove_run_dir(run.path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fuyou", description="fuyou-strategy tools")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("io-bench", help="sequential read/write bandwidth of swap directories")
    bench.add_argument("--dir", action="append", help="directory to measure (repeatable; default: a temporary one)")
    bench.add_argument("--size", type=_size, default=parse_bytes("1GiB"),
                       help="bytes written and read per measurement (default 1GiB)")
    bench.add_argument("--block-sizes", type=_block_sizes, default=_block_sizes("1MiB,4MiB"), help="comma list (default 1MiB,4MiB)")
    bench.add_argument("--threads", type=_ints, default=[1, 4], help="comma list of threads per dir (default 1,4)")
    bench.add_argument("--direct-io", choices=["auto", "on", "off"], default="auto")
    bench.add_argument("--json", help="also write the rows to this JSON file")
    bench.set_defaults(func=_cmd_io_bench)

    clean = sub.add_parser("clean", help="remove run directories left behind by crashed fuyou processes")
    clean.add_argument("--dir", action="append", help="swap directory to scan (repeatable; default: the temp dir)")
    clean.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    clean.set_defaults(func=_cmd_clean)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, OSError) as exc:
        print(f"fuyou {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
