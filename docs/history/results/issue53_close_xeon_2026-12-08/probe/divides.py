"""torch's fused AdamW kernel against DeepSpeedCPUAdam, in cache and in DRAM, on 1 and 2 threads (fp32 params)."""
import statistics, sys, time, torch
from deepspeed.ops.adam import DeepSpeedCPUAdam

def rate(n, threads, system, reps):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n, generator=g))
    p.grad = torch.randn(n, generator=g) * 1e-3
    if system == "torch-bare":
        m, v = torch.zeros(n), torch.zeros(n)
        st = torch.tensor(0.0)
        def step():
            st.add_(1)
            torch._fused_adamw_([p.data], [p.grad], [m], [v], [], [st], lr=1e-4, beta1=0.9, beta2=0.999,
                                weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    else:
        opt = DeepSpeedCPUAdam([p], lr=1e-4, weight_decay=0.0, adamw_mode=True)
        step = opt.step
    for _ in range(3):
        step()
    times = []
    for _ in range(reps):
        t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
    return n / statistics.median(times) / 1e6

for n, reps in ((1 << 20, 200), (64 << 20, 7)):
    for threads in (1, 2):
        row = {s: rate(n, threads, s, reps) for s in ("torch-bare", "deepspeed")}
        print(f"{n:>10} params, {threads} thread(s): torch-bare {row['torch-bare']:.0f} M/s, deepspeed "
              f"{row['deepspeed']:.0f} M/s, deepspeed / torch {row['deepspeed'] / row['torch-bare']:.2f}", flush=True)
