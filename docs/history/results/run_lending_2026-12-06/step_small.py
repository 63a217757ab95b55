# fuyou's step() over N small parameters, gradients set by hand: python step_small.py 390 4096 {ram,device} {next_forward,backward} STEPS
import sys, time, statistics, torch, tempfile
from fuyou_strategy import FuyouAdamW, FuyouConfig
torch.manual_seed(0)
nparams, size, tier, sched, iters = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
params = [torch.nn.Parameter(torch.randn(size)) for _ in range(nparams)]
grads = [torch.randn_like(p) * 1e-3 for p in params]
state = 2 * 12 * nparams * size + 2**28
t = dict(device_state=state, host_state=0) if tier == "device" else dict(host_state=state)
cfg = FuyouConfig(swap_dirs=[tempfile.mkdtemp()], host_memory_budget=state + 2**30, optimizer_schedule=sched,
                  optimizer_threads=torch.get_num_threads(), **t)
opt = FuyouAdamW(params, lr=1e-4, weight_decay=0.01, config=cfg)
ts = []
for i in range(iters):
    for p, g in zip(params, grads): p.grad = g
    t0 = time.perf_counter(); opt.step(); opt.flush(); ts.append(time.perf_counter() - t0)
print(tier, sched, f"{statistics.median(ts[5:])*1e3:.1f} ms")
opt.close()
