"""fuyou-exact at 64M fp32 (update_rate_bench's setup): where step() spends its time."""
import statistics, sys, time, torch
from fuyou_strategy import FuyouAdamW, FuyouConfig
from fuyou_strategy.optim import gradients as G
dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1] if len(sys.argv) > 1 else "fp32"]
n, each = 64 * 10**6, 8 * 680_000
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(min(each, n - i), dtype=dt)) for i in range(0, n, each)]
grads = [(torch.randn_like(p) * 1e-3) for p in params]
state = 2 * 12 * n + 2**30
cfg = FuyouConfig(swap_dirs=["/tmp"], host_memory_budget=state + 2**30, optimizer_schedule="next_forward",
                  optimizer_threads=torch.get_num_threads(), host_state=state)
opt = FuyouAdamW(params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, config=cfg)
spent = {"norms": [], "step": [], "update": [], "sum": [], "kernel_norms": []}
orig = G.Gradients.resident_norms
def timed_norms(self, *a, **k):
    t = time.perf_counter(); r = orig(self, *a, **k); spent["norms"].append(time.perf_counter() - t); return r
G.Gradients.resident_norms = timed_norms
for i in range(7):
    for p, g in zip(params, grads):
        p.grad = g
    began = opt.control.figures().update_total[0]
    t = time.perf_counter(); opt.step(); opt.flush(); spent["step"].append(time.perf_counter() - t)
    spent["update"].append(opt.control.figures().update_total[0] - began)
    t = time.perf_counter(); [g.sum() for g in grads]; spent["sum"].append(time.perf_counter() - t)
    k = opt.gradients.norm_kernel
    t = time.perf_counter(); k.norms(grads, None); spent["kernel_norms"].append(time.perf_counter() - t)
print({k: round(statistics.median(v[1:]) * 1e3, 1) for k, v in spent.items()}, len(params), "params")
opt.close()
