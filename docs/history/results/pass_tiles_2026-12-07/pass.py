"""The compiled pass alone over 64M parameters (state in RAM in 16 MiB chunks, one call for all of them, bf16 gradient
and bf16 weight written), against torch's bare `_fused_adamw_` on fp32 tensors of the same count in the same process,
alternating, medians of 6 after 1. ``--mode inplace`` (an exact update: the chunk updated where it is),
``outofplace`` (a speculative update: read one slot, write another) or ``param`` (with ``--dtype fp32``: the master
read from the parameter, which holds it, and written into it and the chunk). Run with a tree's ``src`` on PYTHONPATH; the
pass is built from that tree's source.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=<tree>/src python pass.py --mode inplace
"""
import argparse, statistics, time
import torch
from fuyou_strategy.optim import onepass

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["inplace", "outofplace", "param"], default="inplace")
p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
args = p.parse_args()
one, why = onepass.load()
torch.manual_seed(0)
n = 64 * 2**20
chunk = (16 * 2**20) // 12 // 16 * 16
dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
ns = [min(chunk, n - s) for s in range(0, n, chunk)]
starts = list(range(0, n, chunk))
outs = [torch.randn(3 * k).abs_() for k in ns]
srcs = [None if args.mode == "inplace" else torch.randn(3 * k).abs_() for k in ns]
grad, weight = torch.randn(n, dtype=dt) * 1e-3, torch.randn(n, dtype=dt)
gs = [grad[s:s + k] for s, k in zip(starts, ns)]
ws = [weight[s:s + k] for s, k in zip(starts, ns)]
# "param": an fp32 parameter that holds its master (fuyou's fp32 exact update): the master read from the parameter
# and written into it and into the state chunk, the moments in place
ins = ws if args.mode == "param" else None
m, g, a, v = torch.randn(n), torch.randn(n) * 1e-3, torch.zeros(n), torch.zeros(n)
step = torch.tensor(0.0)
k = dict(lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)


def bare():
    step.add_(1)
    for s, e in zip(starts, ns):
        torch._fused_adamw_([m[s:s + e]], [g[s:s + e]], [a[s:s + e]], [v[s:s + e]], [], [step], **k)


def one_pass():
    one.update_chunks(outs, srcs, gs, ws, ns, counts=[2.0] * len(ns), inv_scale=None, coef=None, lr=1e-4,
                      beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, master_ins=ins)


took = {"bare": [], "pass": []}
for r in range(7):
    for name, fn in (("bare", bare), ("pass", one_pass)):
        t = time.perf_counter()
        fn()
        took[name].append(time.perf_counter() - t)
b, q = (statistics.median(took[x][1:]) for x in ("bare", "pass"))
print(f"{args.mode} {args.dtype}: bare {b * 1e3:.1f} ms, pass {q * 1e3:.1f} ms, pass x bare {b / q:.2f} "
      f"({torch.get_num_threads()} threads; {why})")
