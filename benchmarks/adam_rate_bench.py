"""The planner's CPU AdamW rate: the warm-up's own updates against the old micro-benchmark.

One process (jemalloc when installed) trains a GPT-2 (``--layers``/``--hidden``, fp32) with
``FuyouEngine(activations="auto")`` through the planner's warm-up, then reads the rate the plan used:
the arithmetic of the warm-up's own chunk updates after its first step (``UpdateMeter``). Beside it,
``adam_throughput``, the micro-benchmark the planner used before: three updates of one 16 MiB buffer,
which stays in the cache, measured ``--repeats`` times. The table gives both and their ratio.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 .venv/bin/python benchmarks/adam_rate_bench.py

Measured 2026-11-26 on this project's 2-core CPU (300 MiB L3), GPT-2 124M fp32, ``next_forward``, three
times: the warm-up's updates ran at 372, 421 and 417 M parameters/s, the micro-benchmark said 1,213, 2,404
and 2,169 (3.3x, 5.7x and 5.2x too fast; ``docs/history/results/adam_rate_bench.json`` is the third, dropout off).
On the second GPU run the plan's AdamW took 0.07-0.14 s a step where the worker was busy 0.5 s.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import allocator, gpt2_model, write_results  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--schedule", default="next_forward", help="FuyouConfig.optimizer_schedule")
    parser.add_argument("--repeats", type=int, default=3, help="micro-benchmark runs (median)")
    parser.add_argument("--out", default="benchmarks/results/adam_rate_bench.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)

    import torch

    from fuyou_strategy import FuyouConfig, FuyouEngine
    from fuyou_strategy.planner.profile import adam_throughput

    model = gpt2_model(args.layers, args.hidden, args.seq)
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(prefix="fuyou-adam-rate-") as swap:
        config = FuyouConfig(swap_dirs=[swap], activations="auto", planner_warmup_steps=2, progress=False,
                             optimizer_schedule=args.schedule)
        engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), max_grad_norm=1.0,
                             config=config)
        try:
            ids = torch.randint(0, 50257, (args.batch, args.seq))
            while engine.plan is None:
                engine.begin_micro_batch(update=True)
                model(input_ids=ids, labels=ids).loss.backward()
                engine.optimizer.step()
                engine.optimizer.zero_grad()
            warm_up = engine.plan.profile["adam_params_per_s"]
        finally:
            engine.close()
    micro = statistics.median(adam_throughput(True) for _ in range(args.repeats))
    table = (f"# CPU AdamW rate, GPT-2 {params / 1e6:.0f}M fp32, {args.schedule}; allocator: {allocator()}\n\n"
             "| rate source | M parameters/s | x the warm-up's |\n|---|---|---|\n"
             f"| the warm-up's own updates (the plan's, now) | {warm_up / 1e6:.0f} | 1.00 |\n"
             f"| 16 MiB micro-benchmark (the plan's, before; median of {args.repeats}) | {micro / 1e6:.0f} | "
             f"{micro / warm_up:.2f} |")
    write_results(args.out, {"table": table, "params": params, "schedule": args.schedule,
                             "warm_up_params_per_s": warm_up, "micro_benchmark_params_per_s": micro,
                             "allocator": allocator()})


if __name__ == "__main__":
    main()
