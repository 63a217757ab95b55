"""Activation swapping side by side: no hooks, all-recompute, all-ssd, and a mix.

The model is chosen so that activations dominate: a GPT-2 with a long sequence, a small
hidden size and a small vocabulary. Each configuration runs in a fresh process and reports
the median step time (forward + backward, after warm-up) and its peak RSS. A baseline
process runs the same model on a one-token sequence: its peak RSS is the memory that is not
activations (weights, gradients, the runtime), and

    resident activation memory = peak RSS - baseline peak RSS.

Targets on this machine: all-ssd holds resident activation memory to <= 0.25x of the no-hooks
run, with a step time <= 1.3x of it.

    .venv/bin/python benchmarks/activation_bench.py      # preloads jemalloc itself when installed

Prints a table and writes ``benchmarks/results/activation_bench.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (add_gpt2_arguments, allocator, parse_or_work, peak_rss_bytes, run_interleaved,  # noqa: E402
                    temporary_swap_dir, worker_argv, write_results)

CONFIGS = {
    "baseline": None,  # one-token sequence: everything but activations
    "no-hooks": "keep",
    "recompute": "recompute",
    "ssd": "ssd",
    "mix": "mix",  # first half of the blocks to SSD, second half recomputed
}


def worker(args: argparse.Namespace) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from fuyou_strategy import FuyouConfig
    from fuyou_strategy.activations import ActivationSwapper

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.hidden // 64, vocab_size=args.vocab,
                     n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    seq = 1 if args.worker == "baseline" else args.seq
    ids = torch.randint(0, args.vocab, (args.batch, seq), generator=torch.Generator().manual_seed(0))
    policy = CONFIGS[args.worker]
    if policy == "mix":
        policy = {i: ("ssd" if i < args.layers // 2 else "recompute") for i in range(args.layers)}
    swapper = None
    if policy not in (None, "keep"):
        swapper = ActivationSwapper(model, FuyouConfig(swap_dirs=[args.swap_dir], activations=policy,
                                                       host_memory_budget=args.host_budget,
                                                       activation_prefetch_blocks=args.prefetch_blocks))
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        with swapper if swapper is not None else _nothing():
            model(input_ids=ids, labels=ids).loss.backward()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    out = {"config": args.worker, "step_s": times, "peak_rss": peak_rss_bytes()}
    if swapper is not None:
        out["stats"] = {k: v for k, v in vars(swapper.stats).items() if k != "per_block_bytes"}
        out["host_high_water"] = swapper.store.pool.high_water if swapper.store is not None else 0
        swapper.close()
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_gpt2_arguments(parser, "activation_bench", layers=12, hidden=256, vocab=4096, seq=2048, batch=2, steps=3,
                       warmup=1, rounds=1)
    parser.add_argument("--prefetch-blocks", type=int, default=2, help="FuyouConfig.activation_prefetch_blocks")
    parser.add_argument("--configs", default=",".join(list(CONFIGS)[1:]),
                        help="comma list of configurations besides the baseline (default: all)")
    args = parse_or_work(parser, worker)
    if args is None:
        return
    temporary_swap_dir(args, "fuyou-actbench-")
    argv = worker_argv(args, parent_only=("configs",))
    configs = ["baseline"] + [c for c in args.configs.split(",") if c != "baseline"]
    if "no-hooks" not in configs:
        raise SystemExit("--configs must include no-hooks: the other rows are ratios to it")
    runs, results = run_interleaved(__file__, ["baseline"], configs[1:], args.rounds, argv,
                                    use_jemalloc=not args.no_jemalloc)
    base_rss = results["baseline"]["peak_rss"]
    ref = results["no-hooks"]
    ref_s, ref_act = statistics.median(ref["step_s"]), ref["peak_rss"] - base_rss
    lines = [
        f"model: GPT-2 {args.layers} layers x {args.hidden} hidden, vocab {args.vocab}; batch {args.batch} x seq {args.seq}; "
        f"allocator: {allocator(not args.no_jemalloc)}; host budget {args.host_budget}; prefetch {args.prefetch_blocks} "
        f"blocks; medians of {args.steps} steps x {args.rounds} round(s) after {args.warmup} warm-up; each run a "
        "fresh process, configurations interleaved",
        f"baseline (one-token sequence) peak RSS: {base_rss / 2**30:.2f} GiB",
        "",
        f"{'configuration':<14} {'step s':>8} {'x no-hooks':>11} {'peak RSS GiB':>13} {'activations GiB':>16} {'x no-hooks':>11}",
        "-" * 78,
    ]
    for config in configs[1:]:
        r = results[config]
        s, act = statistics.median(r["step_s"]), r["peak_rss"] - base_rss
        lines.append(f"{config:<14} {s:>8.2f} {s / ref_s:>11.2f} {r['peak_rss'] / 2**30:>13.2f} {act / 2**30:>16.2f} {act / ref_act:>11.2f}")
    lines.append("targets: ssd resident activations <= 0.25x of no-hooks, step time <= 1.3x")
    if "ssd" in results:
        lines.append(f"ssd swapper stats: {results['ssd'].get('stats')}")
    table = "\n".join(lines)
    write_results(args.json, {"args": vars(args), "runs": runs, "table": table})


if __name__ == "__main__":
    main()
