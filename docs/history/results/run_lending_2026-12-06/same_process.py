# fuyou's step() and torch's bare kernel in one process, alternating: python same_process.py {fp32,bf16} {next_forward,backward}
import sys, time, statistics, torch, tempfile
from fuyou_strategy import FuyouAdamW, FuyouConfig
torch.manual_seed(0)
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1]]
sched = sys.argv[2]
n, each, chunk = 64_000_000, 5_440_000, 680_000
params = [torch.nn.Parameter(torch.randn(min(each, n - i), dtype=dtype)) for i in range(0, n, each)]
grads = [(torch.randn_like(p) * 1e-3) for p in params]
state = 2 * 12 * n + 2**30
cfg = FuyouConfig(swap_dirs=[tempfile.mkdtemp()], host_memory_budget=state + 2**30, optimizer_schedule=sched,
                  optimizer_threads=torch.get_num_threads(), host_state=state)
opt = FuyouAdamW(params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, config=cfg)
m, g, a, s = (torch.randn(n), torch.randn(n) * 1e-3, torch.zeros(n), torch.zeros(n))
stp = torch.tensor(0.0)
k = dict(lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
def bare():
    stp.add_(1)
    for i in range(0, n, chunk):
        e = min(n, i + chunk)
        torch._fused_adamw_([m[i:e]], [g[i:e]], [a[i:e]], [s[i:e]], [], [stp], **k)
def fy():
    for p, gr in zip(params, grads): p.grad = gr
    opt.step(); opt.flush()
res = {"bare": [], "fuyou": [], "upd": []}
for r in range(8):
    for name, fn in (("bare", bare), ("fuyou", fy)):
        b0 = opt.control.figures().update_total[0]
        t = time.perf_counter(); fn(); dt = time.perf_counter() - t
        if r >= 2:
            res[name].append(dt)
            if name == "fuyou": res["upd"].append(opt.control.figures().update_total[0] - b0)
B = statistics.median(res["bare"])
print(sys.argv[1:], {k: f"{statistics.median(v)*1e3:.1f} ms x{B/statistics.median(v):.2f}" for k, v in res.items()})
opt.close()
