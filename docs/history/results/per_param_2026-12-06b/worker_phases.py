"""Where the worker's time goes in a grouped device-tier job on the CPU (the device is host RAM): each phase timed
inside 100 whole steps of 390 parameters of 4,096 elements (clipping at work, fresh gradients outside the clock),
with ``optimizer_threads`` (the worker's intra-op threads) as given; then torch's ``_fused_adamw_`` over the same lists
alone on one thread and on the machine's threads, nothing beside it.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=src python worker_phases.py {1,2}
"""
import gc, statistics, sys, tempfile, time, torch
from fuyou_strategy import FuyouAdamW, FuyouConfig
import fuyou_strategy.optim.state as state_mod
import fuyou_strategy.optim.updates as updates_mod
from fuyou_strategy.storage import TensorStore

phases: dict[str, list[float]] = {}


def timed(owner, name, label):
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            phases.setdefault(label, []).append(time.perf_counter() - began)

    setattr(owner, name, wrapper)


timed(TensorStore, "lend_chunks", "lend the chunks")
timed(state_mod, "fp32_gradients", "clip the gradients")
timed(state_mod, "fused_adamw", "torch's fused AdamW")
timed(updates_mod.Publisher, "many", "publish the weights")
timed(TensorStore, "give_back", "give the chunks back")
threads = int(sys.argv[1])
nparams, size = 390, 4096
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(size)) for _ in range(nparams)]
fresh = [torch.randn_like(p) * 1e-3 for p in params]
grads = [g.clone() for g in fresh]
nbytes = 2 * 12 * nparams * size + 2**28
cfg = FuyouConfig(swap_dirs=[tempfile.mkdtemp()], host_memory_budget=nbytes + 2**30, optimizer_schedule="next_forward",
                  optimizer_threads=threads, device_state=nbytes, host_state=0)
opt = FuyouAdamW(params, lr=1e-3, max_grad_norm=1.0, config=cfg)
gc.collect()
gc.freeze()
steps = []
for i in range(110):
    if i == 10:
        phases.clear()
    for g, f, p in zip(grads, fresh, params):
        g.copy_(f)
        p.grad = g
    t0 = time.perf_counter()
    opt.step()
    opt.flush()
    if i >= 10:
        steps.append(time.perf_counter() - t0)
opt.close()
print(f"optimizer_threads={threads}: whole step {statistics.median(steps)*1e3:.2f} ms; per step, medians:")
for label, times in phases.items():
    print(f"  {label:24s} {statistics.median(times)*1e3:6.2f} ms")
m = [torch.randn(size) for _ in range(nparams)]
a = [torch.zeros(size) for _ in range(nparams)]
s = [torch.zeros(size) for _ in range(nparams)]
counts = [torch.tensor(1.0) for _ in range(nparams)]
for n in (1, torch.get_num_threads()):
    torch.set_num_threads(n)
    alone = []
    for _ in range(60):
        t0 = time.perf_counter()
        torch._fused_adamw_(m, fresh, a, s, [], counts, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
                            amsgrad=False, maximize=False)
        alone.append(time.perf_counter() - t0)
    print(f"  torch's fused AdamW alone on {n} thread(s): {statistics.median(alone[10:])*1e3:.2f} ms")
