"""The planner on this machine: its chosen plan against uniform plans, measured side by side.

1. A planning run: ``Trainer(strategy=FuyouStrategy(activations="auto", device_memory_budget=B))``
   profiles the warm-up, solves and applies the plan; it reports the plan, its predicted
   step time and the measured profile. ``B`` is set (``--device-fraction``) so that keeping
   every block's activations does not fit.
2. Fresh processes, interleaved over ``--rounds``, train with pinned policies: the chosen
   plan, all-``keep`` (over the budget: shown for reference), all-``recompute`` and all-``ssd``.
   Each reports the median step time after warm-up.
3. The cost model predicts each of those plans from the same measured profile.

The table gives, per plan, measured and predicted step time and their ratio, and whether it
fits the budget. Targets: the chosen plan within 5% of the best measured plan that fits (or
better), and measured within ±15% of predicted.

    .venv/bin/python benchmarks/planner_bench.py      # preloads jemalloc itself when installed

Prints a table and writes ``benchmarks/results/planner_bench.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (add_gpt2_arguments, allocator, fit_gpt2_lightning, parse_or_work, peak_rss_bytes,  # noqa: E402
                    run_fresh, temporary_swap_dir, worker_argv, write_results)

UNIFORM = ("keep", "recompute", "ssd")


def worker(args: argparse.Namespace) -> dict:
    import fuyou_strategy

    config = args.worker
    fields = dict(swap_dirs=[args.swap_dir], host_memory_budget=args.host_budget, host_state=args.host_state, planner_warmup_steps=args.warmup)
    if config == "auto":
        fields.update(activations="auto", device_memory_budget=args.device_budget)
    elif config.startswith("plan:"):
        fields.update(plan=config[len("plan:"):])
    else:
        fields.update(activations=config)
    strategy = fuyou_strategy.FuyouStrategy(**fields)
    # auto: the warm-up, one step on the new plan, then the measured steps (the others discard as many).
    steps, _ = fit_gpt2_lightning(args, strategy, args.warmup + 1 + args.steps)
    engine = strategy.engine
    result = {"step_s": steps[-args.steps:], "peak_rss": peak_rss_bytes()}
    if config == "auto":
        result.update(plan=engine.plan.policies, predicted=engine.plan.predicted_step_s, profile=engine.plan.profile,
                      table=engine.plan.table(compact=True))
    engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_gpt2_arguments(parser, "planner_bench", layers=12, hidden=256, vocab=4096, seq=1024, batch=2, steps=4, warmup=3,
                       rounds=2)
    parser.add_argument("--device-fraction", type=float, default=0.6,
                        help="device budget = weights and gradients + this share of all-keep activations")
    parser.add_argument("--device-budget", type=int, help=argparse.SUPPRESS)
    args = parse_or_work(parser, worker)
    if args is None:
        return
    temporary_swap_dir(args, "fuyou-planbench-")
    jemalloc = not args.no_jemalloc
    from fuyou_strategy.planner import Profile, fixed_plan

    # 0. Size the budget from an all-keep profile (planning with no limit keeps everything).
    probe = run_fresh(__file__, ["--worker", "auto", *worker_argv(args, parent_only=("device_fraction",))], jemalloc)
    profile = Profile.from_dict(probe["profile"])
    acts = sum(b.act_bytes for b in profile.blocks)
    args.device_budget = int(profile.device_base_bytes + args.device_fraction * acts)
    argv = worker_argv(args, parent_only=("device_fraction",))
    # 1. The planning run.
    print("running auto (planning) ...", file=sys.stderr, flush=True)
    planned = run_fresh(__file__, ["--worker", "auto", *argv], jemalloc)
    print(planned["table"], file=sys.stderr)
    plan_path = Path(args.swap_dir) / "chosen-plan.json"
    profile = Profile.from_dict(planned["profile"])
    chosen = fixed_plan(profile, planned["plan"], reason="chosen by the planner")
    chosen.save(plan_path)
    # 2. Pinned plans, interleaved, fresh processes.
    configs = {"chosen": f"plan:{plan_path}", **{f"all-{p}": p for p in UNIFORM}}
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for name, config in configs.items():
            print(f"running {name} ...", file=sys.stderr, flush=True)
            runs.setdefault(name, []).append(run_fresh(__file__, ["--worker", config, *argv], jemalloc))
    # 3. Predictions from the planning run's measured profile.
    rows = {}
    for name in configs:
        policies = planned["plan"] if name == "chosen" else [name.removeprefix("all-")] * profile.num_blocks
        plan = fixed_plan(profile, policies)
        measured = statistics.median(t for r in runs[name] for t in r["step_s"])
        rows[name] = {"measured_s": measured, "predicted_s": plan.predicted_step_s,
                      "fits": plan.device_peak <= args.device_budget, "device_peak": plan.device_peak,
                      "peak_rss": statistics.median(r["peak_rss"] for r in runs[name])}
    best = min(r["measured_s"] for n, r in rows.items() if r["fits"] and n != "chosen")
    counts = ", ".join(f"{planned['plan'].count(p)} {p}" for p in dict.fromkeys(planned["plan"]))
    lines = [
        f"model: GPT-2 {args.layers} layers x {args.hidden} hidden, vocab {args.vocab}; batch {args.batch} x seq {args.seq}; "
        f"device budget {args.device_budget / 2**20:.0f} MiB (weights+grads + {args.device_fraction:.0%} of all-keep "
        f"activations, {acts / 2**20:.0f} MiB); allocator: {allocator(jemalloc)}; medians of {args.steps} steps x "
        f"{args.rounds} rounds, each run a fresh process, plans interleaved",
        f"chosen plan: {counts}; "
        f"in the planning run: predicted {planned['predicted']:.2f} s, measured "
        f"{statistics.median(planned['step_s']):.2f} s",
        "",
        f"{'plan':<15} {'fits':>5} {'measured s':>11} {'predicted s':>12} {'meas/pred':>10} {'x best fitting':>15}",
        "-" * 72,
    ]
    for name, r in rows.items():
        lines.append(f"{name:<15} {'yes' if r['fits'] else 'no':>5} {r['measured_s']:>11.2f} {r['predicted_s']:>12.2f} "
                     f"{r['measured_s'] / r['predicted_s']:>10.2f} {r['measured_s'] / best:>15.2f}")
    lines.append("targets: chosen <= 1.05x the best fitting uniform plan; measured within 0.85-1.15x of predicted")
    table = "\n".join(lines)
    write_results(args.json, {"args": vars(args), "planned": planned, "runs": runs, "rows": rows, "table": table})


if __name__ == "__main__":
    main()
