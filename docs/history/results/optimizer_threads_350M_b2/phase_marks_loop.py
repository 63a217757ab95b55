"""The plain loop with phase marks (CLOCK_MONOTONIC) written to MARKS: perf samples (perf_by_phase.py) are cut by them."""
import os, sys, time, threading
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from fuyou_strategy import FuyouConfig, FuyouEngine
mode, schedule = sys.argv[1], sys.argv[2]
big = len(sys.argv) > 3 and sys.argv[3] == "350M"
layers, hidden = (24, 1024) if big else (12, 768)
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=hidden, n_head=hidden // 64, n_positions=256))
x = torch.randint(0, 50257, (2, 256), generator=torch.Generator().manual_seed(0))
if mode == "torch":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True); begin = lambda: None
else:
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True), max_grad_norm=1.0,
                         config=FuyouConfig(optimizer_schedule=schedule, host_state="9GiB",
                                            host_memory_budget="12GiB", swap_dirs=["/tmp/iocpu"], progress=False))
    opt, begin = engine.optimizer, lambda: engine.begin_micro_batch(update=True)
mono = lambda: time.clock_gettime(time.CLOCK_MONOTONIC)
marks = {}
model.lm_head.register_forward_pre_hook(lambda m, a: marks.__setitem__("fwd", mono()))
out = open(os.environ.get("MARKS", "/tmp/marks.txt"), "w")
out.write(f"main {threading.get_native_id()}\n")
for i in range(10):
    t0 = mono()
    begin()
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    t2 = mono()
    if mode == "torch":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad()
    t3 = mono()
    if i >= 4:
        out.write(f"step {i} {t0} {marks['fwd']} {t2} {t3}\n")
for t in os.listdir("/proc/self/task"):
    out.write(f"task {t} {open(f'/proc/self/task/{t}/comm').read().strip()}\n")
out.close()
