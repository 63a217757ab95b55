"""CPU seconds per GB that moving data through TensorStore (O_DIRECT, 16 MiB chunks, 4 GiB each way) costs, per
thread (/proc/self/task/*/stat), in the steady state (the pool's buffers warm): writes of pool buffers as they
are, then reads. Usage: python io_cpu.py <directory on the drive>"""
import glob
import os
import sys
import time

import torch

from fuyou_strategy import FuyouConfig
from fuyou_strategy.storage import TensorStore

TICK = os.sysconf("SC_CLK_TCK")


def per_thread() -> dict:
    out = {}
    for task in glob.glob("/proc/self/task/*"):
        try:
            comm = open(task + "/comm").read().strip()
            fields = open(task + "/stat").read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        out[task.rsplit("/", 1)[1]] = (comm, int(fields[11]) / TICK, int(fields[12]) / TICK)
    return out


cfg = FuyouConfig(swap_dirs=[sys.argv[1]], chunk_size="16MiB", host_memory_budget="1GiB", host_state=0)
n, gb = 4 << 30, (4 << 30) / 1e9
with TensorStore(cfg) as store:
    store.create("x", (n,), torch.uint8, slots=1)
    entry = store.entry("x")

    def move(write: bool) -> None:
        futures = []
        for k in range(entry.nchunks):
            if write:
                futures.append(store.write_chunk("x", k, store.pool.acquire(entry.chunk_len(k))))
            else:
                futures.append(store.read_chunk("x", k))
            if len(futures) > 8:
                out = futures.pop(0).result()
                if out is not None:
                    out.release()
        for f in futures:
            out = f.result()
            if out is not None:
                out.release()

    move(True)  # the pool's buffers allocated and touched once
    for what, write in (("write", True), ("read", False)):
        before, began = per_thread(), time.perf_counter()
        move(write)
        after, wall = per_thread(), time.perf_counter() - began
        rows = [(comm, u - before[t][1], s - before[t][2]) for t, (comm, u, s) in after.items() if t in before]
        user, sys_ = sum(r[1] for r in rows), sum(r[2] for r in rows)
        print(f"{what}: {gb / wall:.2f} GB/s; CPU {(user + sys_) / gb:.3f} s/GB (user {user / gb:.3f}, sys {sys_ / gb:.3f}); "
              "per thread: " + ", ".join(f"{c} {(u + s) / gb:.3f}" for c, u, s in rows if u + s > 0))
