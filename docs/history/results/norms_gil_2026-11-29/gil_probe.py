import torch, threading, time
from fuyou_strategy.optim import onepass
one, why = onepass.load(); print(why)
n = 64*2**20
m, a, s, g = torch.randn(n), torch.zeros(n), torch.zeros(n), torch.randn(n)
step = torch.tensor(0.0)
def work():
    for _ in range(5):
        one.update(m, a, s, g, m, a, s, None, step=step, inv_scale=None, coef=None, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8)
torch.set_num_threads(1)
t0=time.perf_counter(); work(); alone=time.perf_counter()-t0
th = threading.Thread(target=work); 
count=0; t0=time.perf_counter(); th.start()
while th.is_alive():
    count += 1
el=time.perf_counter()-t0
print(f"pass alone {alone:.3f}s; with a python loop beside: {el:.3f}s, python loop iterations {count} ({count/el:.0f}/s)")
t0=time.perf_counter(); c2=0
while time.perf_counter()-t0 < 0.5: c2+=1
print(f"python loop alone {c2/0.5:.0f}/s")
