# The same, in the cache on one thread (64M element-updates over one 32K chunk): the arithmetic's cost alone
import time, torch, statistics
from fuyou_strategy.optim import onepass
op, why = onepass.load(); mod = op.module
torch.set_num_threads(1)
c = 32768; reps = 2000  # 64M element-updates in cache
s = torch.randn(3 * c).abs_(); g32 = torch.randn(c) * 1e-3; g16 = g32.bfloat16(); w16 = torch.empty(c, dtype=torch.bfloat16); w32 = torch.empty(c)
step = torch.tensor(5.0); k = dict(lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
def bare():
    for _ in range(reps): torch._fused_adamw_([s[:c]], [g32], [s[c:2*c]], [s[2*c:]], [], [step], **k)
def ours(g, w):
    def f():
        for _ in range(reps): mod.adamw_chunk(s, None, None, g, w, c, 1e-4, 0.9, 0.999, 0.01, 1e-8, 5.0, None, None)
    return f
for name, fn in (("bare", bare), ("g32", ours(g32, None)), ("g16", ours(g16, None)), ("g32w32", ours(g32, w32)), ("g16w16", ours(g16, w16))):
    fn(); ts = []
    for _ in range(5):
        a = time.perf_counter(); fn(); ts.append(time.perf_counter() - a)
    print(f"{name:8s} {min(ts)*1e3:6.1f} ms per 64M element-updates, 1 thread, in cache")
