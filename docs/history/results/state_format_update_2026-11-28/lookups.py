import time, torch, statistics
from fuyou_strategy.optim import formats
q = formats._torchao(); Q = q.quantiser[True]
n=1<<22
x,scale = q.scale_tensor(torch.randn(n), 256)
def med(fn, r=9):
    fn(); ts=[]
    for _ in range(r):
        a=time.perf_counter(); fn(); ts.append(time.perf_counter()-a)
    return statistics.median(ts)*1e3
base_rot = torch.roll(Q.base, 32768)
k = x.view(torch.int32) >> 16; k += 32768
code = base_rot.index_select(0, k)
for th in (1,2):
    torch.set_num_threads(th)
    print(th, "shift", round(med(lambda: x.view(torch.int32) >> 16),2),
          "base idxsel", round(med(lambda: base_rot.index_select(0, k)),2),
          "base adv", round(med(lambda: base_rot[k]),2),
          "ahead idxsel", round(med(lambda: Q.ahead.index_select(0, code)),2),
          "ahead adv", round(med(lambda: Q.ahead[code]),2),
          "cmp", round(med(lambda: x >= x),2),
          "toU8", round(med(lambda: code.to(torch.uint8)),2))
