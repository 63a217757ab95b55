import torch, time
from fuyou_strategy.optim import onepass
one, why = onepass.load()
n = 32 * 2**20
gs = [torch.randn(n // 4) for _ in range(8)]  # 64M total in 8 tensors
def t(f, r=7):
    f(); ts=[]
    for _ in range(r):
        a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
    return sorted(ts)[r//2]*1e3
for th in (1, 2):
    torch.set_num_threads(th)
    print(th, "threads: kernel norms of 64M in 8 tensors %.1f ms" % t(lambda: one.norms(gs, None)),
          " torch.sum each %.1f ms" % t(lambda: [g.sum() for g in gs]),
          " torch vector_norm each %.1f ms" % t(lambda: [torch.linalg.vector_norm(g) for g in gs]))
