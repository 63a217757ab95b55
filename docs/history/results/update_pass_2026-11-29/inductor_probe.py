"""Can torch.compile's CPU code generation give torch's fused AdamW bits, out of place? And how fast?"""
import time, statistics, torch
torch.manual_seed(0)
lr, beta1, beta2, wd, eps = 1e-3, 0.9, 0.999, 0.01, 1e-8

def adamw_out(master, m, v, g, step):
    # torch's fused CPU kernel's formulas (ADAMW): decay, lerp, square average, denominator, update
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    step_size = lr / bc1
    bc2_sqrt = bc2 ** 0.5
    p = master * (1 - lr * wd)
    m2 = torch.lerp(m, g, 1 - beta1)
    v2 = v * beta2 + (1 - beta2) * g * g
    denom = v2.sqrt() / bc2_sqrt + eps
    p2 = p + (-step_size) * m2 / denom
    return p2, m2, v2, p2.to(torch.bfloat16)

compiled = torch.compile(adamw_out, dynamic=False)
n = 680_000
res = {}
for trial in range(5):
    scale = 10.0 ** (-trial)
    master, m, v, g = torch.randn(n), torch.randn(n) * scale * .1, torch.rand(n) * scale * scale, torch.randn(n) * scale
    step = float(trial + 1)
    want = [master.clone(), m.clone(), v.clone()]
    torch._fused_adamw_([want[0]], [g], [want[1]], [want[2]], [], [torch.tensor(step)], lr=lr, beta1=beta1, beta2=beta2,
                        weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
    t = time.time(); got = compiled(master, m, v, g, step); c = time.time() - t
    diff = [int((a != b).sum()) for a, b in zip(got[:3], want)]
    ulps = [int((a.view(torch.int32) - b.view(torch.int32)).abs().max()) for a, b in zip(got[:3], want)]
    print(f"trial {trial}: elements differing (master, exp_avg, exp_avg_sq) {diff} of {n}; max ulps {ulps}; call {c:.2f}s")
