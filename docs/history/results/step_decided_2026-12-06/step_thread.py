"""The training thread's step() over N small parameters (gradients set by hand): ``step()`` timed with the updates
left for the next forward (``landing.gated``, as when the engine attached the model), then landed (``flush``) outside
the clock; medians of 50 steps after 10; the garbage collector frozen after set-up (its full collections, ~100 ms,
land in whichever step they fall in).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=<a tree's src> python step_thread.py 390 16 {ram,device} next_forward
"""
import gc, sys, time, statistics, torch, tempfile
from fuyou_strategy import FuyouAdamW, FuyouConfig
torch.manual_seed(0)
nparams, size, tier, sched = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
params = [torch.nn.Parameter(torch.randn(size)) for _ in range(nparams)]
grads = [torch.randn_like(p) * 1e-3 for p in params]
state = 2 * 12 * nparams * size + 2**28
t = dict(device_state=state, host_state=0) if tier == "device" else dict(host_state=state)
cfg = FuyouConfig(swap_dirs=[tempfile.mkdtemp()], host_memory_budget=state + 2**30, optimizer_schedule=sched,
                  optimizer_threads=torch.get_num_threads(), **t)
opt = FuyouAdamW(params, lr=1e-4, weight_decay=0.01, max_grad_norm=1.0, config=cfg)
opt.landing.gated = True
gc.collect()
gc.freeze()
ss = []
for i in range(60):
    for p, g in zip(params, grads): p.grad = g
    t0 = time.perf_counter(); opt.step(); t1 = time.perf_counter()
    opt.flush()
    if i >= 10: ss.append(t1 - t0)
print(tier, sched, size, f"step() on the training thread {statistics.median(ss)*1e3:.2f} ms")
opt.close()
