"""GPT-2 124M (fp32, batch 2 x 128, the planner's warm-up of 2 steps, activations and weights "auto") under a
host_memory_budget, with state_slots 2, 1 or "auto": the plan's predicted step, the one-slot plan the engine solved
from the warm-up (``one_slot``, wrapped here to print it), the slots kept, and the median of steps 4-8.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=<a tree's src> python probe.py 1792MiB auto

``--force``: the engine's decision forced to one slot (``worth_one_slot`` always true), to run the switch itself
(out_forced.txt). ``--detail``: the applied plan's update rate and predictions per schedule, and beside the one-slot
plan, the warm-up's rate in RAM (with rates_split.diff applied), two slots' predictions and one slot's
(out_rates.txt; those lines were printed by copies of this script that differed only in them).
"""
import statistics, sys, tempfile, time
import torch
from transformers import GPT2Config, GPT2LMHeadModel
import fuyou_strategy.engine as E
from fuyou_strategy import FuyouConfig, FuyouEngine

budget, slots, flags = sys.argv[1], sys.argv[2], set(sys.argv[3:])
slots = slots if slots == "auto" else int(slots)
solved = E.one_slot


def one_slot(profile, **how):
    plan = solved(profile, **how)
    detail = ""
    if "--detail" in flags and plan is not None:
        detail = (f"; in RAM {(getattr(profile, 'adam_ram_params_per_s', None) or 0) / 1e6:.0f}M; two-slot pred "
                  f"{E.solve(profile, **how).predicted_by_schedule()}; one: {plan.profile['schedule']}, "
                  f"{plan.profile['state_slots']}, {plan.predicted_by_schedule()}, state_in_ram "
                  f"{plan.state_in_ram / 2**30:.2f} GiB, ssd {plan.ssd_peak / 2**30:.2f}")
    print(f"one-slot plan solved from the warm-up: {plan and round(plan.predicted_step_s, 3)} s; the warm-up's CPU "
          f"AdamW {profile.adam_params_per_s / 1e6:.0f}M params/s{detail}", flush=True)
    return plan


E.one_slot = one_slot
if "--force" in flags:
    E.worth_one_slot = lambda two, one: True  # forced: the switch itself under test
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_embd=768, n_layer=12, n_head=12, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
cfg = FuyouConfig(swap_dirs=[tempfile.mkdtemp(dir="/tmp")], activations="auto", weights="auto", planner_warmup_steps=2,
                  host_memory_budget=budget, state_slots=slots)
engine = FuyouEngine(model, opt, config=cfg, report=lambda m: print(m.splitlines()[0][:200], flush=True))
ts = []
for step in range(9):
    x = torch.randint(0, 50257, (2, 128), generator=torch.Generator().manual_seed(step))
    t = time.perf_counter()
    engine.begin_micro_batch(update=True)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    engine.optimizer.step()
    engine.optimizer.zero_grad()
    ts.append(time.perf_counter() - t)
engine.flush()
f = engine.optimizer.control.figures()
print(f"state_slots={slots!r}: kept {engine.optimizer.control.state_slots}; plan {engine.plan.predicted_step_s:.3f} s; "
      f"median step 4-8 {statistics.median(ts[4:]):.3f} s; state in RAM {f.state_ram_bytes / 2**30:.2f} GiB, on the "
      f"SSD {f.state_ssd_bytes / 2**30:.2f} GiB; loss {loss.item():.6f}")
if "--detail" in flags:
    print("plan profile adam rate", engine.plan.profile["adam_params_per_s"] / 1e6, "M/s; schedule",
          engine.plan.profile["schedule"], "pred by schedule", engine.plan.predicted_by_schedule())
engine.close()
