import torch, time
from fuyou_strategy.optim import onepass
one, why = onepass.load()
n = 64 * 2**20
def mk(): return torch.randn(n) * 0.01
p, m, v, g = mk(), torch.zeros(n), torch.zeros(n).abs(), mk()
p2, m2, v2 = torch.empty(n), torch.empty(n), torch.empty(n)
w32, w16 = torch.empty(n), torch.empty(n, dtype=torch.bfloat16)
g16 = g.bfloat16()
step = torch.tensor(0.0)
kw = dict(step=step, inv_scale=None, coef=None, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
def bare(): torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
cases = {
 "torch bare in place": bare,
 "pass in place, no weight": lambda: one.update(p, m, v, g, p, m, v, None, **kw),
 "pass in place, fp32 weight": lambda: one.update(p, m, v, g, p, m, v, w32, **kw),
 "pass out of place (NT), no weight": lambda: one.update(p, m, v, g, p2, m2, v2, None, **kw),
 "pass out of place, fp32 weight": lambda: one.update(p, m, v, g, p2, m2, v2, w32, **kw),
 "pass out of place, bf16 grad, bf16 weight": lambda: one.update(p, m, v, g16, p2, m2, v2, w16, **kw),
 "pass in place, bf16 grad, bf16 weight": lambda: one.update(p, m, v, g16, p, m, v, w16, **kw),
}
res = {k: [] for k in cases}
for f in cases.values(): f()
for r in range(5):
    for k, f in cases.items():
        t0 = time.perf_counter(); f(); res[k].append(time.perf_counter() - t0)
b = sorted(res["torch bare in place"])[2]
print(why, "threads", torch.get_num_threads())
for k, ts in res.items():
    t = sorted(ts)[2]; print(f"{k:45s} {t*1e3:7.1f} ms  x bare {b/t:.2f}")
# out of place with ordinary stores: outputs misaligned by one element, so `streams` is false
P, M, V = torch.empty(n + 1)[1:], torch.empty(n + 1)[1:], torch.empty(n + 1)[1:]
W = torch.empty(n + 1)[1:]
c2 = {
 "torch bare in place": bare,
 "pass out of place (NT), no weight": cases["pass out of place (NT), no weight"],
 "pass out of place, ordinary stores, no weight": lambda: one.update(p, m, v, g, P, M, V, None, **kw),
 "pass out of place, ordinary stores, fp32 weight": lambda: one.update(p, m, v, g, P, M, V, W, **kw),
 "pass in place, 4M chunks, fp32 weight": lambda: [one.update(p[i:i+2**22], m[i:i+2**22], v[i:i+2**22], g[i:i+2**22], p[i:i+2**22], m[i:i+2**22], v[i:i+2**22], w32[i:i+2**22], **kw) for i in range(0, n, 2**22)],
}
res = {k: [] for k in c2}
for f in c2.values(): f()
for r in range(5):
    for k, f in c2.items():
        t0 = time.perf_counter(); f(); res[k].append(time.perf_counter() - t0)
b = sorted(res["torch bare in place"])[2]
print("--")
for k, ts in res.items():
    t = sorted(ts)[2]; print(f"{k:45s} {t*1e3:7.1f} ms  x bare {b/t:.2f}")
