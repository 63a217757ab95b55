"""Run as `python docs/history/results/fuyou_ssd_located_2026-11-28/prior/profile_350m.py [SWAP_DIR]`.

Capture the planner's warm-up profile at GPT-2 350M fp32 b2x256 with the state on the SSD (plain loop +
FuyouEngine, as the peers harness's fuyou-engine@host_state=0), then print what the cost model predicts under
each schedule: for the plan, and for the same profile with every block's activations and weights on the SSD
(fuyou-ssd's configuration)."""
import json, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[5]))  # the repository root: benchmarks.peers
import torch
from benchmarks.peers.systems import Job, _fuyou_fields, LR, BETAS, EPS
from fuyou_strategy import FuyouConfig, FuyouEngine
from fuyou_strategy.activations import Policy
from fuyou_strategy.planner import Profile, predict

job = Job(arch="gpt2", size="350M", model=None, dtype="fp32", batch=2, seq=256, steps=4, swap_dir=sys.argv[1] if len(sys.argv) > 1 else "/tmp/iocpu/prof")
model = job.build_model()
opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)
engine = FuyouEngine(model, opt, config=FuyouConfig(**_fuyou_fields(job, False, host_state=0)))
try:
    for i, batch in enumerate(job.batches(model.config.vocab_size)):
        t = time.perf_counter()
        engine.begin_micro_batch(update=True)
        model(input_ids=batch, labels=batch).loss.backward()
        engine.optimizer.step(); engine.optimizer.zero_grad(set_to_none=True)
        print(f"step {i}: {time.perf_counter() - t:.2f} s, {engine.optimizer.stats.last_schedule}", flush=True)
        if engine.plan is not None and i >= 2:
            break
    plan = engine.plan
    out = {"plan": plan.predicted_by_schedule(), "policies": plan.policies, "weight_tiers": plan.weight_tiers}
    profile = Profile.from_dict(plan.profile)
    n = profile.num_blocks
    for name, flags in (("this runtime", {}), ("paper runtime", dict(tail_read_ahead=False, writes_behind=False))):
        import dataclasses
        p = dataclasses.replace(profile, **flags)
        for what, pol, tiers in (("plan", [Policy(x) for x in plan.policies], plan.weight_tiers),
                                 ("everything on SSD", [Policy.SSD] * n, ["ssd"] * n)):
            pred = {s: predict(p, pol, weight_tiers=tiers, schedule=s).step_s for s in ("backward", "next_forward")}
            out[f"{name}: {what}"] = pred
            print(f"{name:14s} {what:18s} backward {pred['backward']:.2f} s, next_forward {pred['next_forward']:.2f} s"
                  f" ({pred['next_forward'] / pred['backward']:.2f}x)")
    out["profile"] = plan.profile
    json.dump(out, open(Path(__file__).with_suffix(".json"), "w"), indent=1)
finally:
    engine.close()
