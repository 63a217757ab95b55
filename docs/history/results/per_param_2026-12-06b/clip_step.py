"""The whole step over N small parameters with clipping at work (max norm 1.0, every step clipped): fuyou's
``step()`` + ``flush()`` (the updates landed), or torch's ``clip_grad_norm_`` + ``AdamW(fused=True).step()``. Each
step's gradients are fresh copies made outside the clock (a clip in place, as torch's and now the device tier's,
would otherwise shrink them step after step). Medians of 50 steps after 10; the garbage collector frozen after set-up.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=<a tree's src> python clip_step.py 390 4096 {ram,device,torch}
"""
import gc, sys, time, statistics, tempfile, torch
from fuyou_strategy import FuyouAdamW, FuyouConfig
torch.manual_seed(0)
nparams, size, tier = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
params = [torch.nn.Parameter(torch.randn(size)) for _ in range(nparams)]
fresh = [torch.randn_like(p) * 1e-3 for p in params]
grads = [g.clone() for g in fresh]
hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
if tier == "torch":
    opt = torch.optim.AdamW(params, **hyper, fused=True)

    def run():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
else:
    state = 2 * 12 * nparams * size + 2**28
    t = dict(device_state=state, host_state=0) if tier == "device" else dict(host_state=state)
    cfg = FuyouConfig(swap_dirs=[tempfile.mkdtemp()], host_memory_budget=state + 2**30,
                      optimizer_schedule="next_forward", optimizer_threads=torch.get_num_threads(), **t)
    opt = FuyouAdamW(params, **hyper, max_grad_norm=1.0, config=cfg)

    def run():
        opt.step()
        opt.flush()
gc.collect()
gc.freeze()
ts = []
for i in range(60):
    for g, f, p in zip(grads, fresh, params):
        g.copy_(f)
        p.grad = g
    t0 = time.perf_counter()
    run()
    if i >= 10:
        ts.append(time.perf_counter() - t0)
print(tier, size, f"whole step {statistics.median(ts)*1e3:.2f} ms")
