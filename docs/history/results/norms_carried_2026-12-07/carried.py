"""One speculative update's worker work on a job whose chunks come one call each (`update_job`, what a GPU run
takes with its staged weights), timed alone: its gradient's norm beside the first chunk's pass only (``--calls
first``: the tree before), or carried from call to call beside every chunk's pass, each pausing where that call's
blocks end, the last call finishing it (``--calls carried``: `OnePass.update_chunk`'s ``last``, this tree).

One parameter of ``--elems`` elements, its fp32 state in RAM in chunks of ``--chunk`` elements, a bf16 gradient and
bf16 weight, ``--threads`` intra-op threads. The same state is updated every step (its values drift; the arithmetic
per element does not change). Prints the median of ``--steps`` timed steps after ``--warmup``, in ms, and each
norm's bits against torch's; ``--per-call``: also each call's time in the last step (the first 16, and their sum).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=<a tree's src> python carried.py --calls carried
"""
import argparse
import inspect
import statistics
import time
from types import SimpleNamespace

import torch

from fuyou_strategy.optim import gradients, onepass

p = argparse.ArgumentParser()
p.add_argument("--elems", type=int, default=5_440_000)
p.add_argument("--chunk", type=int, default=16 * 2**20 // 12)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--calls", choices=["first", "carried"], default="carried")
p.add_argument("--steps", type=int, default=30)
p.add_argument("--warmup", type=int, default=5)
p.add_argument("--per-call", action="store_true")
args = p.parse_args()
torch.set_num_threads(args.threads)
one, why = onepass.load()
assert one is not None and one.norm_layout is not None, why
if args.calls == "carried":
    assert "last" in inspect.signature(one.update_chunk).parameters, "this tree has no carried norms"
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
    beside = gradients.Beside.claim([gradients.NormTake(pending, 0, one)], one)
    count = float(i + 1)
    last_k = len(spans) - 1
    for k, (out, g_k, w_k, (_s, m)) in enumerate(zip(outs, grads, weights, spans)):
        kw = {}
        if beside is not None:  # as `update_job` passes it: until the call that returns the norms
            kw = dict(beside=beside) if args.calls == "first" else dict(beside=beside, last=k == last_k)
        t0 = time.perf_counter()
        taken = one.update_chunk(out, None, None, g_k, w_k, n=m, step=torch.tensor(count - 1), count=count,
                                 inv_scale=None, coef=None, **hyper, **kw)
        if i == args.warmup + args.steps - 1:
            calls_t.append(time.perf_counter() - t0)
        if taken:
            beside.record(taken)
            beside = None


calls_t = []  # each call's seconds in the last step
times = []
for i in range(args.warmup + args.steps):
    t = time.perf_counter()
    step(i)
    if i >= args.warmup:
        times.append(time.perf_counter() - t)
want = torch.linalg.vector_norm(grad.float())
same = all(torch.equal(v.view(torch.int32), want.view(torch.int32)) for v in norms.values())
norm_alone = []
for _ in range(10):  # the norm alone on this thread, for scale
    t = time.perf_counter()
    one.norms([grad], None)
    norm_alone.append(time.perf_counter() - t)
print(f"calls={args.calls} threads={args.threads} elems={n} chunks={len(spans)}: "
      f"step {statistics.median(times) * 1e3:.2f} ms; the norm alone {statistics.median(norm_alone) * 1e3:.2f} ms; "
      f"every norm torch's bits: {same}")
if args.per_call:
    print(" ".join(f"{x * 1e3:.2f}" for x in calls_t[:16]), "... sum", f"{sum(calls_t) * 1e3:.2f}")
