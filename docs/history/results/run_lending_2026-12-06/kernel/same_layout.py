# The one pass (adamw_chunk, adamw_chunks) and torch's bare _fused_adamw_ on the same state layout in one process, 64M
# elements in 47 chunks, with and without a gradient in bf16 and a weight written: python same_layout.py
import time, torch, statistics
from fuyou_strategy.optim import onepass
op, why = onepass.load()
mod = op.module
n, chunk = 64_000_000, 1_361_920
torch.manual_seed(0)
# state laid out per chunk: [master|avg|sq]
nch = (n + chunk - 1) // chunk
states = [torch.randn(3 * min(chunk, n - i*chunk)).abs_() for i in range(nch)]
g32 = [torch.randn(min(chunk, n - i*chunk)) * 1e-3 for i in range(nch)]
g16 = [g.bfloat16() for g in g32]
w16 = [torch.empty(g.numel(), dtype=torch.bfloat16) for g in g32]
w32 = [torch.empty(g.numel()) for g in g32]
step = torch.tensor(5.0)
k = dict(lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
def bare():
    for s, g in zip(states, g32):
        m = g.numel()
        torch._fused_adamw_([s[:m]], [g], [s[m:2*m]], [s[2*m:]], [], [step], **k)
def ours(gs, ws):
    def f():
        for s, g, w in zip(states, gs, ws):
            mod.adamw_chunk(s, None, None, g, w, g.numel(), 1e-4, 0.9, 0.999, 0.01, 1e-8, 5.0, None, None)
    return f
def ours_list(gs, ws):
    def f():
        mod.adamw_chunks(states, [None]*nch, gs, ws, [g.numel() for g in gs], [5.0]*nch, 1e-4, 0.9, 0.999, 0.01, 1e-8, None, None)
    return f
M, G, A, S = (torch.randn(n).abs_(), torch.randn(n) * 1e-3, torch.zeros(n), torch.zeros(n))
def sep():
    for i in range(0, n, 680000):
        e = min(n, i + 680000)
        torch._fused_adamw_([M[i:e]], [G[i:e]], [A[i:e]], [S[i:e]], [], [step], **k)
fns = {"bare": bare, "bare separate": sep, "ours g32": ours(g32, [None]*nch), "ours g16": ours(g16, [None]*nch),
       "ours g32 w32": ours(g32, w32), "ours g16 w16": ours(g16, w16), "list g16 w16": ours_list(g16, w16)}
res = {k: [] for k in fns}
for r in range(5):
    for name, fn in fns.items():
        fn()
        ts = []
        for _ in range(3):
            a = time.perf_counter(); fn(); ts.append(time.perf_counter() - a)
        res[name].append(min(ts))
b = statistics.median(res["bare"])
for name, v in res.items():
    print(f"{name:14s} {statistics.median(v)*1e3:6.1f} ms  x bare {b/statistics.median(v):.2f}")
