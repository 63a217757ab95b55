"""The norms of a model's gradients at an exact step() (`OnePass.norms`: `Gradients.resident_norms` takes them so,
several at once, one thread per gradient), in the parameters' order, on 2 threads: a Llama-like stack scaled down,
whose untied output layer is as large as its embedding and comes last. Median of 20 calls after 3, in ms.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=<a tree's src> python norms_order.py
"""
import statistics
import time

import torch

from fuyou_strategy.optim import onepass

torch.set_num_threads(2)
one, why = onepass.load()
assert one is not None and one.norm_layout is not None, why
vocab, hidden, inter, layers = 32000, 1024, 2816, 8
shapes = [(vocab, hidden)]
for _ in range(layers):
    shapes += [(hidden,), (hidden, hidden), (hidden, hidden), (hidden, hidden), (hidden, hidden), (hidden,),
               (inter, hidden), (inter, hidden), (hidden, inter)]
shapes += [(hidden,), (vocab, hidden)]
gen = torch.Generator().manual_seed(0)
grads = [(torch.randn(s, generator=gen) * 1e-3).to(torch.bfloat16).view(-1) for s in shapes]
times = []
for i in range(23):
    t = time.perf_counter()
    one.norms(grads, None)
    if i >= 3:
        times.append(time.perf_counter() - t)
alone = []
for _ in range(5):
    t = time.perf_counter()
    one.norms([grads[-1]], None)
    alone.append(time.perf_counter() - t)
print(f"{len(grads)} gradients, {sum(g.numel() for g in grads) / 1e6:.1f}M elements (bf16), 2 threads: "
      f"{statistics.median(times) * 1e3:.2f} ms; the output layer's alone {statistics.median(alone) * 1e3:.2f} ms")
