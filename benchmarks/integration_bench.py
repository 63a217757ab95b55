"""Lightning end to end: ``strategy="auto"`` (torch AdamW in RAM) vs ``strategy="fuyou"``, side by side.

The same LightningModule (a GPT-2 built from config, fused AdamW, warm-up schedule) is
trained by ``Trainer(strategy=...)`` in a fresh process per configuration; each process reports
the median optimizer-step time after warm-up (whole training steps: forward, backward,
optimizer) and its peak RSS. What this measures is the cost of the whole integration —
conversion, hooks, SSD traffic and activation swapping — as a user sees it.

    .venv/bin/python benchmarks/integration_bench.py     # preloads jemalloc itself when installed

Prints a table and writes ``benchmarks/results/integration_bench.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (add_gpt2_arguments, allocator, fit_gpt2_lightning, parse_or_work, peak_rss_bytes,  # noqa: E402
                    run_interleaved, temporary_swap_dir, worker_argv, write_results)

CONFIGS = {
    "auto": None,  # Lightning's default strategy: torch.optim.AdamW(fused=True) in RAM
    "fuyou": "keep",  # FuyouAdamW, activations kept
    "fuyou+act-ssd": "ssd",  # FuyouAdamW and every block's activations to SSD
}


def worker(args: argparse.Namespace) -> dict:
    import fuyou_strategy

    policy = CONFIGS[args.worker]
    strategy = "auto" if policy is None else fuyou_strategy.FuyouStrategy(
        swap_dirs=[args.swap_dir], host_memory_budget=args.host_budget, host_state=args.host_state, activations=policy)
    steps, trainer = fit_gpt2_lightning(args, strategy, args.warmup + args.steps, warmup_schedule=True)
    result = {"step_s": steps[-args.steps:], "peak_rss": peak_rss_bytes()}
    if policy is not None:
        result["summary"] = trainer.strategy.engine.summary()
        trainer.strategy.engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_gpt2_arguments(parser, "integration_bench", layers=8, hidden=768, vocab=8192, seq=256, batch=4, steps=4,
                       warmup=2, rounds=1)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma list (must include auto)")
    args = parse_or_work(parser, worker)
    if args is None:
        return
    temporary_swap_dir(args, "fuyou-intbench-")
    configs = args.configs.split(",")
    if "auto" not in configs:
        raise SystemExit("--configs must include auto: the other rows are ratios to it")
    runs, results = run_interleaved(__file__, [], configs, args.rounds, worker_argv(args, parent_only=("configs",)),
                                    use_jemalloc=not args.no_jemalloc)
    ref_s, ref_rss = statistics.median(results["auto"]["step_s"]), results["auto"]["peak_rss"]
    params = results[configs[-1]].get("summary", {}).get("trainable_parameters")
    lines = [
        f"model: GPT-2 {args.layers} layers x {args.hidden} hidden, vocab {args.vocab}"
        + (f" ({params / 1e6:.0f}M parameters)" if params else "")
        + f"; batch {args.batch} x seq {args.seq}; allocator: {allocator(not args.no_jemalloc)}; host budget "
        f"{args.host_budget}; medians of {args.steps} steps x {args.rounds} round(s) after {args.warmup} warm-up; "
        "each run a fresh process, configurations interleaved",
        "",
        f"{'strategy':<15} {'step s':>8} {'x auto':>8} {'peak RSS GiB':>13} {'x auto':>8}",
        "-" * 56,
    ]
    for config in configs:
        r = results[config]
        s = statistics.median(r["step_s"])
        lines.append(f"{config:<15} {s:>8.2f} {s / ref_s:>8.2f} {r['peak_rss'] / 2**30:>13.2f} {r['peak_rss'] / ref_rss:>8.2f}")
    table = "\n".join(lines)
    write_results(args.json, {"args": vars(args), "runs": runs, "table": table})


if __name__ == "__main__":
    main()
