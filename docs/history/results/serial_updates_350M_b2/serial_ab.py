"""A/B: next_forward's updates beside forward (today) vs all of them before forward with every core (serial).
argv: torch | overlap | serial | serial1. 350M fp32 batch 2x256, state in RAM. Prints the median step of steps 4..11.
Run (serial_ab.txt, 2026-11-27, AMD EPYC 2 cores, jemalloc defaults, two interleaved rounds, nothing else running):
  for r in 1 2; do for m in torch overlap serial; do
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 python serial_ab.py $m; done; done
overlap: optimizer_schedule="next_forward", optimizer_threads="auto" (1 on 2 cores), the updates land per module
beside forward. serial: the same with optimizer_threads=2 and engine.flush() before forward, so that every update
runs on both cores while the training thread waits, as torch's step() does.
serial1: the same with optimizer_threads=1 (the worker's one thread: no second OpenMP team of two).
CLIP=0: no clipping in either loop (max_grad_norm=None).
DROPOUT=0: dropout off, as the peers harness builds its models (serial_ab_no_dropout.txt); by default GPT2Config's 0.1."""
import os, statistics, sys, time
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from fuyou_strategy import FuyouConfig, FuyouEngine
mode = sys.argv[1]
clip_off = os.environ.get("CLIP") == "0"
torch.manual_seed(0)
p = float(os.environ.get("DROPOUT", 0.1))
model = GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=256,
                                   resid_pdrop=p, embd_pdrop=p, attn_pdrop=p))
x = torch.randint(0, 50257, (2, 256), generator=torch.Generator().manual_seed(0))
if mode == "torch":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True); begin = lambda: None
else:
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True), max_grad_norm=None if clip_off else 1.0,
                         config=FuyouConfig(optimizer_schedule="next_forward", host_state="auto",
                                            host_memory_budget="14GiB", swap_dirs=["/tmp/iocpu"],
                                            optimizer_threads={"serial": 2, "serial1": 1}.get(mode, "auto")))
    opt = engine.optimizer
    def begin():
        engine.begin_micro_batch(update=True)
        if mode.startswith("serial"):
            engine.flush()
times, fl, phases = [], [], []
for i in range(12):
    t = time.perf_counter()
    begin()
    t1 = time.perf_counter()
    loss = model(input_ids=x, labels=x).loss
    t2 = time.perf_counter()
    loss.backward()
    t3 = time.perf_counter()
    if mode == "torch" and not clip_off:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad()
    times.append(time.perf_counter() - t); fl.append(t1 - t)
    phases.append((t2 - t1, t3 - t2, time.perf_counter() - t3))
m = lambda i: statistics.median(ph[i] for ph in phases[4:])
print(f"{mode} dropout={p} clip={not clip_off}: median {statistics.median(times[4:]):.3f} s (flush {statistics.median(fl[4:]):.3f}, "
      f"forward {m(0):.3f}, backward {m(1):.3f}, clip+step+zero_grad {m(2):.3f}) all {[round(v,2) for v in times]}", flush=True)
if mode != "torch":
    s = engine.summary(); print("   ssd state bytes", s["ssd_bytes_optimizer_state"], "threads", s["optimizer_threads"], s["schedule_steps"])
    engine.close()
