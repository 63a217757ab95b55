"""Where the whole step over 292 parameters of 64 elements goes with the whole state on the device tier (on the CPU,
host RAM), ``next_forward``, clipping at work: `../per_param_2026-12-06b/clip_step.py`'s set-up, timed from inside
(`../small_step_phases_2026-12-07/phases.py` with the device tier's calls wrapped: ``fused_adamw``, ``fp32_gradients``
and ``Publisher.many`` instead of the one pass). The wrapped calls nest (``finish`` holds the rest; ``updated`` waits
for the worker); ``lend_chunks``, ``fp32_gradients``, ``fused_adamw``, ``many`` and ``give_back`` run on the
optimizer's worker, the rest on the training thread. Medians of 50 steps after 10.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=<a tree's src> python phases_device.py
"""
import gc, statistics, tempfile, time
import torch
import fuyou_strategy.optim.adamw as A
import fuyou_strategy.optim.gradients as G
import fuyou_strategy.optim.onepass as OP
import fuyou_strategy.optim.schedule as S
import fuyou_strategy.optim.state as ST
import fuyou_strategy.optim.updates as U
import fuyou_strategy.storage.store as SS
from fuyou_strategy import FuyouAdamW, FuyouConfig

T: dict[str, list[float]] = {}


def wrap(cls, name):
    f = getattr(cls, name)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            T.setdefault(name, []).append(time.perf_counter() - t)
    setattr(cls, name, timed)


for cls, name in [(A.FuyouAdamW, "step"), (S.Exact, "finish"), (ST.OptimizerState, "drain"),
                  (G.Gradients, "resident_norms"), (S.Parts, "total_norm"), (U.Updater, "queue_many"),
                  (U.Updater, "_flush_run"), (S.Parts, "advance"), (S.Parts, "updated"),
                  (SS.TensorStore, "lend_chunks"), (ST, "fused_adamw"), (U.Publisher, "many"), (ST, "fp32_gradients"), (SS.TensorStore, "give_back")]:
    wrap(cls, name)
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(64)) for _ in range(292)]
fresh = [torch.randn_like(p) * 1e-3 for p in params]
grads = [g.clone() for g in fresh]
state = 2 * 12 * 292 * 64 + 2**28
cfg = FuyouConfig(swap_dirs=[tempfile.mkdtemp()], host_memory_budget=state + 2**30, optimizer_schedule="next_forward",
                  device_state=state, host_state=0, optimizer_threads=torch.get_num_threads())
opt = FuyouAdamW(params, lr=1e-3, max_grad_norm=1.0, config=cfg)
gc.collect()
gc.freeze()
whole = []
for i in range(60):
    for g, f, p in zip(grads, fresh, params):
        g.copy_(f)
        p.grad = g
    t = time.perf_counter()
    opt.step()
    opt.flush()
    whole.append(time.perf_counter() - t)
med = lambda xs: statistics.median(xs[10:]) * 1e3  # noqa: E731
print(f"whole step {med(whole):.2f} ms; " + "; ".join(f"{k} {med(v):.2f}" for k, v in T.items()))
