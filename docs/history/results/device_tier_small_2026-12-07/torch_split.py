"""torch's step over 292 parameters of 64 elements split: clip_grad_norm_ and AdamW(fused=True).step(), medians of
50 steps after 10, jemalloc, the garbage collector frozen (clip_step.py's set-up)."""
import gc, statistics, time, torch
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(64)) for _ in range(292)]
fresh = [torch.randn_like(p) * 1e-3 for p in params]
grads = [g.clone() for g in fresh]
opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
gc.collect(); gc.freeze()
clip, step = [], []
for i in range(60):
    for g, f, p in zip(grads, fresh, params):
        g.copy_(f); p.grad = g
    t0 = time.perf_counter(); torch.nn.utils.clip_grad_norm_(params, 1.0); t1 = time.perf_counter(); opt.step(); t2 = time.perf_counter()
    if i >= 10:
        clip.append(t1 - t0); step.append(t2 - t1)
print(f"torch: clip_grad_norm_ {statistics.median(clip)*1e3:.2f} ms; AdamW(fused=True).step() {statistics.median(step)*1e3:.2f} ms")
