"""What making a Lightning ``.ckpt`` durable costs: Lightning's own write against `DurableCheckpointIO`.

What it measures
----------------
A ``.ckpt`` of ``--ckpt-bytes`` (default 1.4 GB: the fp32 weights of a 350M model, the size of the
``.ckpt`` beside a 350M fuyou save) is written into ``--dir`` by

* before -- Lightning's `TorchCheckpointIO` (a temporary file, renamed into place, no fsync);
* after  -- `DurableCheckpointIO` (written beside the old file, fsynced, renamed over it, folder fsynced).

Each write replaces the previous one, as ``last.ckpt`` is replaced. Two times per write: ``return``,
what the training loop waits for, and ``+sync``, the write followed by ``os.sync()`` (the work the
drive does either way: without the fsync the kernel writes the pages back later, during training).
fuyou's own state files were fsynced before this change and still are: their cost does not change.
Rounds alternate the order; medians are reported with the ratio after / before.

How to run (an idle machine: a shared or nice'd one gives no valid timings)
---------------------------------------------------------------------------
    .venv/bin/python benchmarks/save_durability_bench.py --dir /nvme/scratch

Options: ``--ckpt-bytes``, ``--rounds`` (3), ``--json`` (benchmarks/results/save_durability_bench.json).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import torch

from common import write_results
from fuyou_strategy.integrations.lightning import DurableCheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

WRITERS = {"before": TorchCheckpointIO, "after": DurableCheckpointIO}


def timed_write(io, checkpoint: dict, path: str) -> dict[str, float]:
    os.sync()  # start from clean pages: neither writer pays for the other's write-back
    start = time.perf_counter()
    io.save_checkpoint(checkpoint, path)
    returned = time.perf_counter() - start
    os.sync()
    return {"return_s": returned, "sync_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", help="where to write (default: a fresh temporary directory)")
    parser.add_argument("--ckpt-bytes", type=float, default=1.4e9)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "save_durability_bench.json"))
    args = parser.parse_args()
    folder = args.dir or tempfile.mkdtemp(prefix="fuyou-durability-")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "last.ckpt")
    checkpoint = {"state_dict": {"weights": torch.randn(int(args.ckpt_bytes) // 4)}}  # random: nothing compresses
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in WRITERS}
    try:
        for r in range(args.rounds):
            for name in (WRITERS if r % 2 == 0 else reversed(list(WRITERS))):
                samples[name].append(timed_write(WRITERS[name](), checkpoint, path))
    finally:
        if args.dir is None:
            for name in os.listdir(folder):
                os.unlink(os.path.join(folder, name))
            os.rmdir(folder)
    medians = {name: {k: statistics.median(s[k] for s in runs) for k in ("return_s", "sync_s")}
               for name, runs in samples.items()}
    ratios = {k: medians["after"][k] / medians["before"][k] for k in ("return_s", "sync_s")}
    rows = [f"{'writer':<8} {'return s':>9} {'+sync s':>9}"]
    rows += [f"{name:<8} {m['return_s']:>9.3f} {m['sync_s']:>9.3f}" for name, m in medians.items()]
    rows.append(f"{'ratio':<8} {ratios['return_s']:>9.2f} {ratios['sync_s']:>9.2f}   (after / before, medians of "
                f"{args.rounds}; {args.ckpt_bytes / 1e9:.2f} GB .ckpt in {folder})")
    write_results(args.json, {"table": "\n".join(rows), "ckpt_bytes": args.ckpt_bytes, "rounds": args.rounds,
                              "dir": folder, "samples": samples, "medians": medians, "ratios": ratios,
                              "machine": platform.platform(), "cpus": os.cpu_count()})


if __name__ == "__main__":
    main()
