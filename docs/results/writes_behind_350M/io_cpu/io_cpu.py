"""CPU seconds this process spends per GB moved through TensorStore (O_DIRECT, 16 MiB chunks, 4 GiB each way): writes
(twice: the second is the steady state, the pool warm), reads, and the copies that fill the write buffers alone.
Usage: python io_cpu.py <directory on the drive>"""
import os, sys, time, resource
import torch
from fuyou_strategy import FuyouConfig
from fuyou_strategy.storage import TensorStore

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_utime, r.ru_stime

cfg = FuyouConfig(swap_dirs=[sys.argv[1]], chunk_size="16MiB", host_memory_budget="1GiB", host_state=0)
n = 4 << 30
with TensorStore(cfg) as store:
    store.create("x", (n,), torch.uint8, slots=1)
    buf_src = torch.zeros(16 << 20, dtype=torch.uint8)
    ent = store.entry("x")
    for what in ("write", "write", "read"):
        c0, w0 = cpu(), time.perf_counter()
        futs = []
        for k in range(ent.nchunks):
            if what == "write":
                b = store.pool.acquire(ent.chunk_len(k)); b.view().copy_(buf_src[: ent.chunk_len(k)])
                futs.append(store.write_chunk("x", k, b))
            else:
                futs.append(store.read_chunk("x", k))
                if len(futs) > 8:
                    futs.pop(0).result().release()
            if what == "write" and len(futs) > 8:
                futs.pop(0).result()
        for f in futs:
            r = f.result()
            if what == "read": r.release()
        c1, w1 = cpu(), time.perf_counter()
        gb = n / 1e9
        print(f"{what}: {gb / (w1 - w0):.2f} GB/s, CPU {(c1[0]-c0[0]) / gb:.3f} s/GB (user {(c1[1]-c0[1]) / gb:.3f}, sys {(c1[2]-c0[2]) / gb:.3f})" + (" incl. the 16 MiB fill copies" if what == "write" else ""))
    c0, w0 = cpu(), time.perf_counter()
    for k in range(ent.nchunks):
        b = store.pool.acquire(ent.chunk_len(k)); b.view().copy_(buf_src[: ent.chunk_len(k)]); b.release()
    c1 = cpu()
    print(f"the fill copies alone: CPU {(c1[0]-c0[0]) / (n / 1e9):.3f} s/GB")
