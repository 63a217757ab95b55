"""GPT-2 124M (fp32, batch 2 x 128, the planner's warm-up of 2 steps, activations and weights "auto") under a
host_memory_budget, with state_slots 2, 1 or "auto": what the warm-up measured, the plan's predicted step, the
one-slot plan solved from the warm-up (``one_slot``, wrapped here to print it), the slots kept, each step's time and
schedule, and the median of steps 4-8. Runs on any tree's src (before the change: no ``next_forward_timings``).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=<a tree's src> python probe.py 1792MiB auto
"""
import json, statistics, sys, tempfile, time
import torch
from transformers import GPT2Config, GPT2LMHeadModel
import fuyou_strategy.engine as E
from fuyou_strategy import FuyouConfig, FuyouEngine

budget, slots = sys.argv[1], sys.argv[2]
slots = slots if slots == "auto" else int(slots)
solved, seen = E.one_slot, {}


def figures(fwd, bwd, other, adam):
    return {"fwd_s": round(sum(fwd), 3), "bwd_s": round(sum(bwd), 3), "other_s": round(other, 3),
            "adam_M_per_s": round(adam / 1e6)}


def one_slot(profile, **how):
    plan = solved(profile, **how)
    seen["one_slot_predicted_s"] = plan and round(plan.predicted_step_s, 3)
    t = getattr(profile, "next_forward_timings", None)
    if t is not None:
        seen["next_forward_window"] = figures(t.fwd_s, t.bwd_s, t.other_fwd_s + t.other_bwd_s, t.adam_params_per_s)
        seen["next_forward_window"]["step_s"] = [round(x, 3) for x in profile.notes["next_forward_step_s"]]
    return plan


E.one_slot = one_slot
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_embd=768, n_layer=12, n_head=12, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
cfg = FuyouConfig(swap_dirs=[tempfile.mkdtemp(dir="/tmp")], activations="auto", weights="auto", planner_warmup_steps=2,
                  host_memory_budget=budget, state_slots=slots)
engine = FuyouEngine(model, opt, config=cfg, report=lambda m: None)
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
f, p = engine.optimizer.control.figures(), engine.plan.profile
history = [s for s, _ in engine.optimizer.stats.history]
after = [t for t, s in zip(ts[4:], history[4:])]
print(json.dumps({
    "state_slots": slots, "kept": engine.optimizer.control.state_slots, "budget": budget,
    "why": (getattr(engine, "choices", {}).get("state_slots") or [None, None])[1],
    "warm_up": figures([b["fwd_s"] for b in p["blocks"]], [b["bwd_s"] for b in p["blocks"]],
                       p["other_fwd_s"] + p["other_bwd_s"], p["adam_params_per_s"]) | {
        "step_s": [round(x, 3) for x in p["notes"]["measured_step_s"]]},
    **seen, "predicted_s": round(engine.plan.predicted_step_s, 3),
    "predicted_by_schedule": {k: round(v, 3) for k, v in engine.plan.predicted_by_schedule().items()},
    "median_step_4_8_s": round(statistics.median(ts[4:]), 3),
    "steps_s": [round(t, 3) for t in ts], "schedules": [s[0] for s in history],
    "state_ram_GiB": round(f.state_ram_bytes / 2**30, 2), "state_ssd_GiB": round(f.state_ssd_bytes / 2**30, 2),
    "loss": round(loss.item(), 6)}), flush=True)
engine.close()
