"""fuyou's step() over N small parameters (gradients set by hand) and, apart, the worker's time inside its jobs (each
`ChunkPipeline._process` call timed), medians of 50 steps after 10:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=<a tree's src> python time_worker.py 390 4096 {ram,device} {next_forward,backward}
"""
import sys, time, statistics, torch, tempfile, gc
from fuyou_strategy import FuyouAdamW, FuyouConfig
from fuyou_strategy.optim import pipeline
torch.manual_seed(0)
nparams, size, tier, sched = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
params = [torch.nn.Parameter(torch.randn(size)) for _ in range(nparams)]
grads = [torch.randn_like(p) * 1e-3 for p in params]
state = 2 * 12 * nparams * size + 2**28
t = dict(device_state=state, host_state=0) if tier == "device" else dict(host_state=state)
cfg = FuyouConfig(swap_dirs=[tempfile.mkdtemp()], host_memory_budget=state + 2**30, optimizer_schedule=sched,
                  optimizer_threads=torch.get_num_threads(), **t)
opt = FuyouAdamW(params, lr=1e-4, weight_decay=0.01, config=cfg)
real = pipeline.ChunkPipeline._process
acc = [0.0]
def proc(self, *a, **k):
    t0 = time.perf_counter()
    try: return real(self, *a, **k)
    finally: acc[0] += time.perf_counter() - t0
pipeline.ChunkPipeline._process = proc
ws, ss = [], []
for i in range(60):
    for p, g in zip(params, grads): p.grad = g
    acc[0] = 0.0
    t0 = time.perf_counter(); opt.step(); opt.flush(); t1 = time.perf_counter()
    if i >= 10: ws.append(acc[0]); ss.append(t1 - t0)
print(tier, sched, f"step {statistics.median(ss)*1e3:.1f} ms, worker in jobs {statistics.median(ws)*1e3:.1f} ms")
opt.close()
