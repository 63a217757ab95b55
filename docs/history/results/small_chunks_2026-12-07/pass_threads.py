"""The compiled pass over a run of 390 chunks of 4,096 fp32 elements (`OnePass.update_chunks`, in place, fp32
weights) on 1 and 2 intra-op threads, alternating: medians of 25 calls after 5.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=<a tree's src> python pass_threads.py
"""
import time, torch, statistics
from fuyou_strategy.optim import onepass
one = onepass.load()[0]
n, m = 4096, 390
outs = [torch.cat([torch.randn(n), torch.zeros(n), torch.zeros(n)]) for _ in range(m)]
grads = [torch.randn(n) * 1e-3 for _ in range(m)]
weights = [torch.empty(n) for _ in range(m)]
hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
for th in (1, 2, 1, 2):
    torch.set_num_threads(th)
    ts = []
    for i in range(30):
        t = time.perf_counter()
        one.update_chunks(outs, [None]*m, grads, weights, [n]*m, counts=[float(i+1)]*m, inv_scale=None, coef=None, **hyper)
        ts.append(time.perf_counter() - t)
    print(th, f"{statistics.median(ts[5:])*1e3:.2f} ms")
