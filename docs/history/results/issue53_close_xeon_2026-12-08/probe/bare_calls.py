"""torch's bare _fused_adamw_ over 64M fp32 parameters, 2 threads, weight decay 0.01 (update_rate_bench's
hyperparameters): called per 680K-element chunk (update_rate_bench's torch-bare), per 5.44M-element parameter, and
once over the list of parameters. Rounds interleaved, median of 7 steps each."""
import statistics, time, torch
n, chunk = 64_000_000, 680_000
each = 8 * chunk
torch.manual_seed(0)
m, g, a, s = (torch.randn(n), torch.randn(n) * 1e-3, torch.zeros(n), torch.zeros(n))
step = torch.tensor(0.0)
k = dict(lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
def calls(size):
    return [(m[i:i + size], g[i:i + size], a[i:i + size], s[i:i + size]) for i in range(0, n, size)]
def per(size):
    parts = calls(size)
    def run():
        step.add_(1)
        for x in parts:
            torch._fused_adamw_([x[0]], [x[1]], [x[2]], [x[3]], [], [step], **k)
    return run
def listed():
    parts = calls(each)
    ms, gs, as_, ss = (list(t) for t in zip(*parts))
    def run():
        step.add_(1)
        torch._fused_adamw_(ms, gs, as_, ss, [], [step] * len(ms), **k)
    return run
ways = {"per 680K chunk": per(chunk), "per 5.44M parameter": per(each), "one call, list of parameters": listed(),
        "one call, one 64M tensor": per(n)}
res = {w: [] for w in ways}
for r in range(3):
    for w, fn in ways.items():
        fn()
        for _ in range(7):
            t = time.perf_counter(); fn(); res[w].append(time.perf_counter() - t)
base = statistics.median(res["per 680K chunk"])
for w, ts in res.items():
    med = statistics.median(ts)
    print(f"{w:<32} {med * 1e3:6.1f} ms  {n / med / 1e6:6.0f} M params/s  x per-chunk {base / med:.2f}")
