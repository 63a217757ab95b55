# Python's garbage collections inside FuyouAdamW.step() while step_small.py runs (390 parameters of 4,096 elements,
# 40 steps): python gc_probe.py {ram,device} {next_forward,backward}
import collections
import gc
import os
import sys
import time

sys.argv = ["step_small.py", "390", "4096", sys.argv[1], sys.argv[2], "40"]
stats, start = collections.defaultdict(list), {}


def timed(phase, info):
    if phase == "start":
        start["t"] = time.perf_counter()
    elif start.get("in_step"):
        stats[info["generation"]].append(time.perf_counter() - start["t"])


from fuyou_strategy import FuyouAdamW  # noqa: E402

real_step = FuyouAdamW.step


def step(self, *args, **kwargs):
    start["in_step"] = True
    try:
        return real_step(self, *args, **kwargs)
    finally:
        start["in_step"] = False


FuyouAdamW.step = step
gc.callbacks.append(timed)
print("thresholds", gc.get_threshold())
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "step_small.py")).read())
for g, v in sorted(stats.items()):
    print(f"gen {g}: {len(v)} collections in 40 steps, {sum(v) * 1e3:.1f} ms in all, the longest {max(v) * 1e3:.2f} ms")
