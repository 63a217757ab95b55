"""The pass alone (`OnePass.update_chunks`, 5.44M elements in 4 chunks, no norms) and the norm alone (`OnePass.norms`),
on the intra-op threads given (argv[1]), medians of 50 calls after 10, each twice: whether a build runs them at
the same speed.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=<a tree's src> python parts.py 1
"""
import statistics, sys, time, torch
from fuyou_strategy.optim import onepass
torch.set_num_threads(int(sys.argv[1]))
one, why = onepass.load()
gen = torch.Generator().manual_seed(0)
n, chunk = 5_440_000, 1398101
grad = (torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
weight = torch.empty(n, dtype=torch.bfloat16)
spans = [(s, min(chunk, n - s)) for s in range(0, n, chunk)]
outs = [torch.cat([torch.randn(m, generator=gen), torch.zeros(m), torch.zeros(m)]) for _s, m in spans]
hyper = dict(lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
def pass_():
    one.update_chunks(outs, [None] * len(outs), [grad[s:s+m] for s, m in spans], [weight[s:s+m] for s, m in spans],
                      [m for _s, m in spans], counts=[1.0] * len(outs), inv_scale=None, coef=None, **hyper)
def norm():
    one.norms([grad], None)
for name, fn in (("pass", pass_), ("norm", norm), ("pass", pass_), ("norm", norm)):
    ts = []
    for i in range(60):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    print(name, f"{statistics.median(ts[10:]) * 1e3:.3f}", end="  ")
print()
