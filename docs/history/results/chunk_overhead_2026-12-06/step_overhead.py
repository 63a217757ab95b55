import sys, time, torch, tempfile
from fuyou_strategy import FuyouAdamW, FuyouConfig
import os
from fuyou_strategy.optim import onepass
if os.environ.get('NO_KNORM'): onepass.OnePass.reads = lambda self, g: False
dtype = torch.float32 if sys.argv[1] == "fp32" else torch.bfloat16
n, chunk = int(sys.argv[3]), int(sys.argv[4])
params = [torch.nn.Parameter(torch.randn(min(chunk * 8, n - i), dtype=dtype)) for i in range(0, n, chunk * 8)]
grads = [(torch.randn_like(p) * 1e-3) for p in params]
state = 2 * 12 * n + 2**30
cfg = FuyouConfig(chunk_size=sys.argv[5], swap_dirs=[tempfile.mkdtemp()], host_memory_budget=state + 2**30, optimizer_schedule=os.environ.get("SCHED", "next_forward"),
                  optimizer_threads=int(os.environ.get('OT', torch.get_num_threads())), host_state=state)
opt = FuyouAdamW(params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, config=cfg)
ts = []
for i in range(int(sys.argv[2])):
    for p, g in zip(params, grads):
        p.grad = g
    t = time.perf_counter(); opt.step(); t1 = time.perf_counter(); opt.flush(); ts.append((t1 - t, time.perf_counter() - t))
import statistics; print("median step ms", round(statistics.median(t[0] for t in ts[3:])*1e3,2), "flush ms", round(statistics.median(t[1]-t[0] for t in ts[3:])*1e3,2))
opt.close() if hasattr(opt, "close") else None
