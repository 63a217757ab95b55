"""One gradient's norm by the one pass's norm kernel (`OnePass.norms`), torch's `vector_norm` and `sum`, on one
thread: medians of 20 calls after one, per dtype, 5.44M elements (a 350M-model block's weight).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=<a tree's src> python norm_rate.py
"""
import statistics, time, torch
from fuyou_strategy.optim import onepass

torch.set_num_threads(1)
kernel = onepass.load()[0]
n = 5_440_000
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    g = torch.randn(n).to(dtype) * 1e-3
    calls = {"kernel": lambda: kernel.norms([g], None),
             "torch vector_norm": lambda: torch.linalg.vector_norm(g, 2, dtype=torch.float32),
             "torch sum": lambda: g.sum()}
    for name, fn in calls.items():
        fn()
        ts = []
        for _ in range(20):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        m = statistics.median(ts)
        print(f"{str(dtype):15s} {name:18s} {m * 1e3:6.2f} ms  {n / m / 1e9:5.2f} G elements/s")
