"""Python's garbage collections over 100 whole steps (``step()`` + ``flush()``) of 390 parameters of 4,096
elements, clipping on, after 10 steps, the collector left as a process has it (not frozen): how many of each
generation, and the full ones' total time.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=<a tree's src> python gc_counts.py {ram,device}
"""
import gc, sys, time, tempfile, torch
from fuyou_strategy import FuyouAdamW, FuyouConfig
nparams, size, tier = 390, 4096, sys.argv[1]
params = [torch.nn.Parameter(torch.randn(size)) for _ in range(nparams)]
grads = [torch.randn_like(p) * 1e-3 for p in params]
state = 2 * 12 * nparams * size + 2**28
t = dict(device_state=state, host_state=0) if tier == "device" else dict(host_state=state)
cfg = FuyouConfig(swap_dirs=[tempfile.mkdtemp()], host_memory_budget=state + 2**30, optimizer_schedule="next_forward",
                  **t)
opt = FuyouAdamW(params, lr=1e-3, max_grad_norm=1.0, config=cfg)


def run():
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    opt.flush()


for _ in range(10):
    run()
counts, full_s, began = [0, 0, 0], [0.0], [0.0]


def seen(phase, info):
    if phase == "start":
        began[0] = time.perf_counter()
        return
    counts[info["generation"]] += 1
    if info["generation"] == 2:
        full_s[0] += time.perf_counter() - began[0]


gc.callbacks.append(seen)
for _ in range(100):
    run()
gc.callbacks.remove(seen)
print(tier, f"collections in 100 steps: young {counts[0]}, middle {counts[1]}, full {counts[2]} "
      f"({full_s[0]*1e3:.0f} ms in full ones)")
