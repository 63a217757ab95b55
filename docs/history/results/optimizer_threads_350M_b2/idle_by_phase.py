"""Where are the cores idle? /proc/stat sampled per phase of the plain loop (argv: mode schedule host_state [350M]).
Env: OPT_THREADS=n sets FuyouConfig.optimizer_threads (else "auto"); EXTRA_TEAM=1 starts, beside torch's loop, a
thread that runs one parallel op (an OpenMP team of its own) and then sleeps."""
import os, statistics, sys, time
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from fuyou_strategy import FuyouConfig, FuyouEngine
mode, schedule, host_state = sys.argv[1], sys.argv[2], sys.argv[3]
big = len(sys.argv) > 4 and sys.argv[4] == "350M"
layers, hidden = (24, 1024) if big else (12, 768)
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=hidden, n_head=hidden // 64, n_positions=256))
x = torch.randint(0, 50257, (2, 256), generator=torch.Generator().manual_seed(0))
if os.environ.get("EXTRA_TEAM"):
    import threading
    def team():
        torch.randn(1 << 22).mul_(2)  # one parallel op: this thread's own OpenMP team
        time.sleep(1e6)
    threading.Thread(target=team, daemon=True).start(); time.sleep(1)
if mode == "torch":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True); begin = lambda: None
else:
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True), max_grad_norm=1.0,
                         config=FuyouConfig(optimizer_schedule=schedule, host_state=host_state if host_state != "0" else 0,
                                            host_memory_budget="12GiB", swap_dirs=["/tmp/iocpu"],
                                            optimizer_threads=int(os.environ.get("OPT_THREADS", 0)) or "auto"))
    opt, begin = engine.optimizer, lambda: engine.begin_micro_batch(update=True)
import resource, threading
def stat():
    f = open("/proc/stat").readline().split()[1:]
    v = list(map(int, f))
    r = resource.getrusage(resource.RUSAGE_SELF)
    return v[3] + v[4], sum(v[:8]), r.ru_minflt, r.ru_stime  # idle+iowait, total (jiffies, all cores)
phases = {"fwd": [0, 0, 0, 0], "head+bwd": [0, 0, 0, 0], "clip+step": [0, 0, 0, 0]}
# forward ends when the lm_head starts
marks = {}
model.lm_head.register_forward_pre_hook(lambda m, a: marks.__setitem__("fwd", (time.perf_counter(), stat())))
times = []
for i in range(12):
    t = time.perf_counter(); s0 = stat()
    begin()
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    s2 = stat()
    if mode == "torch":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad()
    s3 = stat()
    times.append(time.perf_counter() - t)
    if i >= 4:
        s1 = marks["fwd"][1]
        for name, a, b in (("fwd", s0, s1), ("head+bwd", s1, s2), ("clip+step", s2, s3)):
            for j in range(4): phases[name][j] += b[j] - a[j]
tck = os.sysconf("SC_CLK_TCK")
desc = " ".join(f"{k}: {v[1]/tck/8/2:.2f}s idle {100*v[0]/max(1,v[1]):.0f}% flt {v[2]/8/1e3:.0f}k sys {v[3]/8:.2f}s" for k, v in phases.items())
label = f"optimizer_threads={os.environ.get('OPT_THREADS', 'auto')}" if mode == "fuyou" else f"extra_team={bool(os.environ.get('EXTRA_TEAM'))}"
print(f"{mode} {schedule} {label} os_threads={len(os.listdir('/proc/self/task'))}: median {statistics.median(times[4:]):.3f} s | {desc}", flush=True)
