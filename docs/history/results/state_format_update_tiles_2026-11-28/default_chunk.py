import time, statistics, sys, torch
from fuyou_strategy.optim.formats import StateFormat, update_compact, Moment8bit, BLOCK
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
def tiled(state, grad, step, tile, **h):
    m = state["master"]; n = m.numel(); padded = state["exp_avg"].numel()
    for a in range(0, padded, tile):
        b = min(a + tile, padded)
        def cut(x):
            if isinstance(x, Moment8bit):
                return Moment8bit(x.codes[a:b], x.scale[a // BLOCK:b // BLOCK], x.signed)
            return x[a:b]
        sub = {"master": m[a:min(b, n)], "exp_avg": cut(state["exp_avg"]), "exp_avg_sq": cut(state["exp_avg_sq"])}
        update_compact(sub, grad[a:min(b, n)], step, **h)
n = 1396736 - 1000
h = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
res = {}
for tile in [None, 1 << 18]:
    layout = StateFormat("8bit").layout(n)
    buf = torch.zeros(layout.nbytes(n), dtype=torch.uint8)
    st = layout.views(buf, n); st["master"].copy_(torch.randn(n, generator=torch.Generator().manual_seed(1)))
    g = torch.Generator().manual_seed(0); ts = []
    for s in range(8):
        grad = torch.randn(n, generator=g) * 1e-3
        t0 = time.perf_counter()
        if tile is None: update_compact(st, grad, torch.tensor(float(s)), **h)
        else: tiled(st, grad, torch.tensor(float(s)), tile, **h)
        if s: ts.append(time.perf_counter() - t0)
    res[tile] = buf.clone()
    print(tile, f"{n / statistics.median(ts) / 1e6:.1f} M/s", "bitwise" if torch.equal(res[tile], res[None]) else "DIFFERS")
