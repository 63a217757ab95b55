"""Exploration: does the optimizer worker's intra-op threading cost the step on 2 cores? fresh process per run.
argv: mode (torch | fuyou | fuyou1), schedule, host_state"""
import statistics, sys, time
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from fuyou_strategy import FuyouConfig, FuyouEngine
from fuyou_strategy.optim import pipeline as pl

mode, schedule, host_state = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=256))
x = torch.randint(0, 50257, (2, 256), generator=torch.Generator().manual_seed(0))
if mode == "fuyou1":
    real = pl.ChunkPipeline._run
    def run(self):
        torch.set_num_threads(1)
        real(self)
    pl.ChunkPipeline._run = run
if mode == "torch":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    begin = lambda: None
else:
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True), max_grad_norm=1.0,
                         config=FuyouConfig(optimizer_schedule=schedule, host_state=host_state if host_state != "0" else 0,
                                            host_memory_budget="6GiB", swap_dirs=["/tmp/iocpu"]))
    opt, begin = engine.optimizer, lambda: engine.begin_micro_batch(update=True)
    if mode == "fuyou1":
        torch.set_num_threads(2)  # the global count back for threads made later; the worker keeps its own 1
times, cpu0 = [], time.process_time()
for i in range(10):
    t = time.perf_counter()
    begin()
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    if mode == "torch":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad()
    times.append(time.perf_counter() - t)
print(f"{mode} {schedule} host_state={host_state}: median {statistics.median(times[4:]):.3f} s, cpu/step "
      f"{(time.process_time() - cpu0) / 10:.2f} s, loss {loss.item():.6f}, steps {[round(t, 2) for t in times]}", flush=True)
