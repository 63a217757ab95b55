"""serial_ab.py's loop (350M fp32, batch 2x256, dropout off, clipping on) with phase marks (CLOCK_MONOTONIC) for
perf: argv torch | serial1 | overlap. serial1 = FuyouEngine, next_forward, the whole state in RAM, optimizer_threads=1,
engine.flush() before forward (every update runs first, nothing beside forward or backward); overlap = the same
without the flush (the default: each module's updates land beside forward).
MARKS=<file>: 'step i t_begin t_fwd t_bwd t_step t_end' for steps >= 4. STEPS (default 14)."""
import os, statistics, sys, time, threading
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from fuyou_strategy import FuyouConfig, FuyouEngine
mode = sys.argv[1]
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=256,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
x = torch.randint(0, 50257, (2, 256), generator=torch.Generator().manual_seed(0))
if mode == "yield":  # prototype: while updates run beside forward, forward's team gives the worker its core
    from fuyou_strategy.optim.adamw import FuyouAdamW
    full, _land = torch.get_num_threads(), FuyouAdamW._land
    def land(self, params=None):
        _land(self, params)
        busy = any(not job.done.done() for job, _ in list(self.landing.jobs.values()))
        want = max(1, full - 1) if busy else full
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
    FuyouAdamW._land = land
    model.register_forward_hook(lambda *a: torch.set_num_threads(full) if torch.get_num_threads() != full else None)
if mode == "torch":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True); begin = lambda: None
else:
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True), max_grad_norm=1.0,
                         config=FuyouConfig(optimizer_schedule="next_forward", host_state="auto",
                                            host_memory_budget="14GiB", swap_dirs=["/tmp/iocpu"],
                                            optimizer_threads=1, progress=False))
    opt = engine.optimizer
    def begin():
        engine.begin_micro_batch(update=True)
        if mode == "serial1":
            engine.flush()
mono = lambda: time.clock_gettime(time.CLOCK_MONOTONIC)
out = open(os.environ.get("MARKS", "/tmp/marks.txt"), "w")
out.write(f"main {threading.get_native_id()}\n")
times, phases = [], []
for i in range(int(os.environ.get("STEPS", 14))):
    t0 = mono(); begin(); t1 = mono()
    loss = model(input_ids=x, labels=x).loss
    t2 = mono()
    loss.backward()
    t3 = mono()
    if mode == "torch":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad()
    t4 = mono(); times.append(t4 - t0); phases.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
    if i >= 4:
        out.write(f"step {i} {t0} {t1} {t2} {t3} {t4}\n")
for t in os.listdir("/proc/self/task"):
    out.write(f"task {t} {open(f'/proc/self/task/{t}/comm').read().strip()}\n")
out.close()
mean = lambda k: statistics.fmean(ph[k] for ph in phases[4:])
print(mode, "median step (4..)", round(statistics.median(times[4:]), 3), "mean", round(statistics.fmean(times[4:]), 3),
      "| mean update %.3f forward %.3f backward %.3f step %.3f" % tuple(mean(k) for k in range(4)),
      [round(v, 2) for v in times], flush=True)
if mode != "torch":
    engine.close()
