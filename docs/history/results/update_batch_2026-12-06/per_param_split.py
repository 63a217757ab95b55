"""The per-parameter cost of each thread alone: the worker held until step() has queued every update.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 .venv/bin/python per_param_split.py 390 4096 {ram,device}
"""
import sys, time, statistics, threading, torch, tempfile
from fuyou_strategy import FuyouAdamW, FuyouConfig
from fuyou_strategy.optim import schedule, ChunkJob, gradients
torch.manual_seed(0)
nparams, size, tier = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
params = [torch.nn.Parameter(torch.randn(size)) for _ in range(nparams)]
grads = [torch.randn_like(p) * 1e-3 for p in params]
state = 2 * 12 * nparams * size + 2**28
t = dict(device_state=state, host_state=0) if tier == "device" else dict(host_state=state)
cfg = FuyouConfig(swap_dirs=[tempfile.mkdtemp()], host_memory_budget=state + 2**30, optimizer_schedule="next_forward",
                  optimizer_threads=torch.get_num_threads(), **t)
opt = FuyouAdamW(params, lr=1e-4, weight_decay=0.01, config=cfg)
gate, marks = threading.Event(), {}
real = schedule.Parts.updated
def updated(self, norms):
    marks["queued"] = time.perf_counter(); gate.set()
    return real(self, norms)
schedule.Parts.updated = updated
real_norms = gradients.Gradients.resident_norms
def resident_norms(self, *a, **k):
    out = real_norms(self, *a, **k)
    opt.adam_state.pipeline.submit(ChunkJob(None, 1, lambda k: gate.wait(60) and None))  # held until all is queued
    marks["t0"] = time.perf_counter()
    return out
gradients.Gradients.resident_norms = resident_norms
pipe = opt.adam_state.pipeline
res = {"main": [], "worker": []}
for i in range(25):
    for p, g in zip(params, grads): p.grad = g
    gate.clear()
    t0 = time.perf_counter(); opt.step(); opt.flush(); t1 = time.perf_counter()
    if i >= 5:
        res["main"].append(marks["queued"] - marks["t0"]); res["worker"].append(t1 - marks["queued"])
print(tier, ", ".join(f"{k}: {statistics.median(v)*1e3:.1f} ms ({statistics.median(v)/nparams*1e6:.0f} us/param)" for k, v in res.items()))
opt.close()
