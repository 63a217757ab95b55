"""What clipping costs under each optimizer schedule, on a ~300M-parameter GPT-2, side by side.

Every configuration trains the same model on the same tokens through `FuyouEngine` (so the
``next_forward`` schedule's updates run ahead of the next forward), each in a fresh process:

- ``noclip``: no clipping (``auto`` then always speculates: nothing ever rolls back) — the baseline;
- ``bites-<schedule>``: ``max_grad_norm=1e-3``, so clipping bites on every step;
- ``never-<schedule>``: ``max_grad_norm=1e6``, so it never bites (the gradients are kept for a redo
  that never comes).

Each row's step time is the median over the timed steps of all rounds, as a ratio to ``noclip`` in
the same run; the targets: ``bites-auto`` <= 1.10x and no ``never-*`` row slower than ``noclip``.
The ``backward`` rows are today's behaviour (a redo on every biting step). Compute runs in bf16
where the CPU has bf16 instructions (``avx512_bf16``/``amx_bf16``), else in fp32 (``--dtype``).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 .venv/bin/python benchmarks/schedule_bench.py

Writes ``benchmarks/results/schedule_bench.json`` and a PNG of step time per configuration.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (add_gpt2_arguments, allocator, choose_dtype, parse_or_work, peak_rss_bytes,  # noqa: E402
                    run_interleaved, temporary_swap_dir, worker_argv, write_results)

CLIP = {"noclip": None, "bites": 1e-3, "never": 1e6}


def worker(args: argparse.Namespace) -> dict:
    """One configuration, in this (fresh) process."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from fuyou_strategy import FuyouConfig, FuyouEngine

    kind, _, schedule = args.worker.partition("-")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.hidden // 64,
                                       vocab_size=args.vocab, n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0)).to({"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype])
    cfg = FuyouConfig(swap_dirs=[args.swap_dir], host_memory_budget=args.host_budget, host_state=args.host_state,
                      optimizer_schedule=schedule or "auto")
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True), config=cfg,
                         max_grad_norm=CLIP[kind])
    opt = engine.optimizer
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    times, schedules = [], []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        engine.begin_micro_batch(update=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            schedules.append(opt.stats.last_schedule)
    summary = engine.summary()
    engine.close()
    keys = ("commits", "redos", "deferred", "skips", "clipped", "rollbacks", "rollback_rate", "schedule_steps")
    return {"config": args.worker, "params": sum(p.numel() for p in model.parameters()), "step_s": times,
            "timed_schedules": schedules, "loss": float(loss), "peak_rss": peak_rss_bytes(),
            "stats": {k: summary[k] for k in keys}, "reason": summary["schedule_reason"]}


def plot(path: Path, configs: list[str], results: dict, base: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    ratios = [statistics.median(results[c]["step_s"]) / base for c in configs]
    colors = ["tab:gray" if c == "noclip" else "tab:red" if c.startswith("bites") else "tab:blue" for c in configs]
    ax.bar(configs, ratios, color=colors)
    ax.axhline(1.10, color="k", ls="--", lw=1, label="target 1.10x")
    for i, r in enumerate(ratios):
        ax.text(i, r + 0.01, f"{r:.2f}x", ha="center", fontsize=8)
    ax.set_ylabel("step time / noclip")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_gpt2_arguments(parser, "schedule_bench", layers=20, hidden=1024, vocab=50257, seq=256, batch=4, steps=4,
                       warmup=3, rounds=2, host_budget="1GiB")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                        help="compute dtype; auto: bf16 where the CPU has avx512_bf16 or amx_bf16, else fp32")
    parser.add_argument("--configs", default="noclip,bites-backward,bites-next_forward,bites-auto,never-backward,"
                                             "never-auto")
    args = parse_or_work(parser, worker)
    if args is None:
        return
    args.dtype, _ = choose_dtype(args.dtype)
    temporary_swap_dir(args, "fuyou-schedbench-")
    configs = args.configs.split(",")
    if configs[0] != "noclip":
        raise SystemExit("--configs must start with noclip: the other rows are ratios to it")
    argv = worker_argv(args, parent_only=("configs",))
    runs, results = run_interleaved(__file__, [], configs, args.rounds, argv, use_jemalloc=not args.no_jemalloc)
    base = statistics.median(results["noclip"]["step_s"])
    n = results["noclip"]["params"]
    used = allocator(not args.no_jemalloc)
    title = (f"GPT-2 {n / 1e6:.0f}M, {args.dtype}, batch {args.batch}x{args.seq}; {used}; "
             f"medians of {args.steps} steps x {args.rounds} rounds after {args.warmup} warm-up")
    lines = [title, "", f"{'configuration':<22} {'step s':>7} {'min-max':>13} {'x noclip':>9} {'peak RSS GiB':>13} "
                        f"{'rollbacks':>10}  timed steps' schedules", "-" * 110]
    for c in configs:
        r = results[c]
        s = statistics.median(r["step_s"])
        mix = ", ".join(f"{k} {v}" for k, v in sorted(
            {x: r["timed_schedules"].count(x) for x in set(r["timed_schedules"])}.items()))
        lines.append(f"{c:<22} {s:>7.2f} {min(r['step_s']):>6.2f}-{max(r['step_s']):<6.2f} {s / base:>9.2f} "
                     f"{r['peak_rss'] / 2**30:>13.2f} {r['stats']['rollbacks']:>10}  {mix}")
    lines.append("targets: bites-auto <= 1.10x noclip; never-* not slower than noclip")
    lines.append(f"auto's last reason (bites-auto): {results.get('bites-auto', {}).get('reason', '-')}")
    table = "\n".join(lines)
    png = Path(args.json).with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(png, configs, results, base, title)
    write_results(args.json, {"args": vars(args), "allocator": used, "dtype": args.dtype, "table": table,
                              "step_ratios": {c: statistics.median(results[c]["step_s"]) / base for c in configs},
                              "runs": runs, "png": str(png)})


if __name__ == "__main__":
    main()
