"""One speculative update's worker work, timed alone: its gradient's norm, then its pass over the state (the tree
before), or the norm taken beside the pass in one parallel region (`gradients.Beside`, the tree after).

One parameter of ``--elems`` elements, its fp32 state in RAM in chunks of ``--chunk`` elements (16 MiB of state:
the default ``chunk_size``), a bf16 gradient and bf16 weight, ``--threads`` intra-op threads. ``--calls``:
``run`` passes every chunk in one call (`OnePass.update_chunks`: a grouped job, `OptimizerState.group_job`, what a
CPU run takes); ``chunk`` one call per chunk, the norm beside the first (`update_job`, what a GPU run takes with its
staged weights). The same state is updated every step (its values drift; the arithmetic per element does not
change). Prints the median of ``--steps`` timed steps after ``--warmup``, in ms.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=<a tree's src> python beside.py --calls run
"""
import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from fuyou_strategy.optim import gradients, onepass

p = argparse.ArgumentParser()
p.add_argument("--elems", type=int, default=5_440_000)
p.add_argument("--chunk", type=int, default=16 * 2**20 // 12)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--calls", choices=["run", "chunk"], default="run")
p.add_argument("--steps", type=int, default=30)
p.add_argument("--warmup", type=int, default=5)
args = p.parse_args()
torch.set_num_threads(args.threads)
one, why = onepass.load()
assert one is not None and one.norm_layout is not None, why
beside_kind = getattr(gradients, "Beside", None)
gen = torch.Generator().manual_seed(0)
n = args.elems
grad = (torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
weight = torch.empty(n, dtype=torch.bfloat16)
spans = [(s, min(args.chunk, n - s)) for s in range(0, n, args.chunk)]
outs = [torch.cat([torch.randn(m, generator=gen), torch.zeros(m), torch.zeros(m)]) for _s, m in spans]
grads = [grad[s : s + m] for s, m in spans]
weights = [weight[s : s + m] for s, m in spans]
hyper = dict(lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
norms = {}


def step(i: int) -> None:
    pending = gradients.PendingNorms()
    g = gradients.Grad(SimpleNamespace(param=torch.nn.Parameter(torch.empty(n, dtype=torch.bfloat16))), grad)
    pending.keep(0, g, None, lambda v: norms.__setitem__(i, v))
    beside = None
    if beside_kind is not None:
        beside = beside_kind.claim([gradients.NormTake(pending, 0, one)], one)
    else:
        pending.take(0, one)
    count = float(i + 1)
    if args.calls == "run":
        kw = dict(beside=beside) if beside is not None else {}
        taken = one.update_chunks(outs, [None] * len(outs), grads, weights, [m for _s, m in spans],
                                  counts=[count] * len(outs), inv_scale=None, coef=None, **hyper, **kw)
        if kw:
            beside.record(taken)
        return
    for k, (out, g_k, w_k, (_s, m)) in enumerate(zip(outs, grads, weights, spans)):
        kw = dict(beside=beside) if beside is not None and k == 0 else {}
        taken = one.update_chunk(out, None, None, g_k, w_k, n=m, step=torch.tensor(count - 1), count=count,
                                 inv_scale=None, coef=None, **hyper, **kw)
        if kw:
            beside.record(taken)


times = []
for i in range(args.warmup + args.steps):
    t = time.perf_counter()
    step(i)
    if i >= args.warmup:
        times.append(time.perf_counter() - t)
norm_alone = []
for _ in range(10):  # the norm alone on this thread, for scale
    t = time.perf_counter()
    one.norms([grad], None)
    norm_alone.append(time.perf_counter() - t)
tree = "after (beside)" if beside_kind is not None else "before (norm, then pass)"
print(f"{tree}: calls={args.calls} threads={args.threads} elems={n} chunks={len(spans)}: "
      f"step {statistics.median(times) * 1e3:.2f} ms; the norm alone {statistics.median(norm_alone) * 1e3:.2f} ms")
