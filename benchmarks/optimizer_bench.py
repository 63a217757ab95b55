"""FuyouAdamW vs torch.optim.AdamW in memory, on a ~300M-parameter GPT-2, side by side.

Measures, each configuration in a fresh process (so peak RSS is its own):

1. **Optimizer I/O efficiency**: the optimizer alone (gradients set by hand, so the whole
   update runs inside ``step()`` with nothing to overlap) moves 12 B/param in and 12 B/param
   out of the SSD tier. Its achieved rate is compared with what ``io-bench`` measures on the
   same directory for the same mix (time = read bytes / read bw + write bytes / write bw).
2. **Training step**: forward + backward + step of the full model, median over the timed
   steps after warm-up, FuyouAdamW (updates overlapped with backward) vs ``torch.optim.AdamW``
   (``fused=True``, the fastest in-memory CPU AdamW) holding everything in RAM.
3. **Peak RSS** of each process.

Step configurations: ``no-optimizer``, ``torch``, ``fuyou``, ``fuyou-clip``, ``fuyou+act-ssd``, ``fuyou-ram``
(the whole state in host RAM), ``fuyou-ram-exact`` (the same, every step ``next_forward``: updated in
place), ``fuyou-bf16`` and ``fuyou-8bit`` (``FuyouConfig.state_format``); and the optimizer alone
(gradients set by hand, ``step()`` timed): ``torch-io``, ``fuyou-io`` (state on the SSD), ``fuyou-io-ram``
(state in host RAM) and ``fuyou-io-ram-exact`` (and ``next_forward``, landed by ``flush()`` inside the
time), whose ratios are the CPU cost of an update per parameter.

Run (jemalloc steadies step times on these machines; the table says which allocator ran):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 .venv/bin/python benchmarks/optimizer_bench.py

Results are printed as a table and written to ``benchmarks/results/optimizer_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (allocator, gpt2_model, peak_rss_bytes, run_interleaved, temporary_swap_dir,  # noqa: E402
                    worker_argv)


def worker(args: argparse.Namespace) -> dict:
    """One configuration, in this (fresh) process."""
    import torch

    from fuyou_strategy import FuyouAdamW, FuyouConfig
    from fuyou_strategy.storage.probe import measure_bandwidth

    out: dict = {"config": args.config}
    if args.config == "io-bench":
        bw = measure_bandwidth(args.swap_dir, size=args.io_size, block_size=args.io_block, threads=args.io_threads)
        return {**out, "read_bps": bw.read_bps, "write_bps": bw.write_bps, "direct": bw.direct}

    model = gpt2_model(args.layers, args.hidden, args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    out["params"] = n_params
    cfg = FuyouConfig(swap_dirs=[args.swap_dir], host_memory_budget=args.host_budget, host_state=args.host_state, io_threads=args.io_threads)
    if args.config in ("fuyou-ram", "fuyou-io-ram", "fuyou-ram-exact", "fuyou-io-ram-exact"):
        # The whole state (both slots, with padding) in host RAM (FuyouConfig.host_state), the pool as before.
        state = 2 * 12 * n_params + 2**30
        cfg = cfg.replace(host_memory_budget=cfg.host_memory_budget + state, host_state=state)
    if args.config.endswith("-exact"):  # every update exact, ahead of the next forward (in place in RAM)
        cfg = cfg.replace(optimizer_schedule="next_forward")
    if args.config in ("fuyou-bf16", "fuyou-8bit"):  # a compact state (FuyouConfig.state_format)
        cfg = cfg.replace(state_format=args.config.split("-")[1])
    if args.config == "no-optimizer":
        opt = None  # forward + backward only: the floor of step time and memory
    elif args.config in ("torch", "torch-io"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    else:
        clip = 1.0 if args.config == "fuyou-clip" else None
        opt = FuyouAdamW(model.parameters(), lr=1e-5, max_grad_norm=clip, config=cfg)
    swapper = None
    if args.config == "fuyou+act-ssd":
        # The whole Fuyou recipe: activations of every block to SSD too, through the optimizer's store.
        from fuyou_strategy.activations import ActivationSwapper

        if hasattr(opt, "memory"):  # the run's memory tiers, borrowed
            swapper = ActivationSwapper(model, cfg, memory=opt.memory, policies="ssd")
        else:  # a checkout from before the memory tiers had one owner (versions_bench)
            swapper = ActivationSwapper(model, cfg.replace(activations="ssd"), store=opt.store)

    if args.config in ("fuyou-io", "fuyou-io-ram", "fuyou-io-ram-exact", "torch-io"):
        # Optimizer alone: hand-set gradients, so every update runs inside step().
        grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]
        times = []
        for i in range(args.warmup + args.steps):
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            start = time.perf_counter()
            opt.step()
            if hasattr(opt, "flush"):
                opt.flush()  # next_forward: step() queued the updates; they are part of the time
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        if hasattr(opt, "close"):
            opt.close()
        moved = 24 * n_params  # 12 B/param read + 12 B/param written
        return {**out, "step_s": times, "bytes": moved, "peak_rss": peak_rss_bytes()}

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50257, (args.batch, args.seq), generator=g)
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        if swapper is not None:
            with swapper:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
        else:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    out.update(step_s=times, loss=float(loss), peak_rss=peak_rss_bytes())
    if hasattr(opt, "stats"):
        out["stats"] = opt.stats.to_dict()
        opt.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--configs", default="no-optimizer,torch,fuyou,fuyou-clip,fuyou+act-ssd",
                        help="comma list of step configurations (torch is required: rows are ratios to it)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the step configurations this many times, interleaved, each a fresh process")
    parser.add_argument("--host-budget", default="512MiB")
    parser.add_argument("--host-state", default="0", help="FuyouConfig.host_state of the fuyou configurations without "
                                                          "'-ram' (default 0: the state on the SSD)")
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--io-size", default=str(2 * 2**30))
    parser.add_argument("--io-block", type=int, default=2**20)
    parser.add_argument("--swap-dir", help="directory on the SSD to use (default: a temporary one)")
    parser.add_argument("--no-jemalloc", action="store_true")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "optimizer_bench.json"))
    args = parser.parse_args()
    if args.worker:
        args.config = args.worker
        args.io_size = int(args.io_size)
        print(json.dumps(worker(args)))
        return

    temporary_swap_dir(args, "fuyou-optbench-")
    argv = worker_argv(args, parent_only=("config", "configs"))
    configs = args.configs.split(",")
    if "torch" not in configs:
        raise SystemExit("--configs must include torch: the other rows are ratios to it")
    runs, results = run_interleaved(__file__, ["io-bench", "fuyou-io"], configs, args.rounds, argv,
                                    use_jemalloc=not args.no_jemalloc)
    io, opt_io = results["io-bench"], results["fuyou-io"]
    n = opt_io["params"]
    ideal_s = 12 * n / io["read_bps"] + 12 * n / io["write_bps"]
    opt_s = statistics.median(opt_io["step_s"])
    ref_s = statistics.median(results["torch"]["step_s"])
    ref_rss = results["torch"]["peak_rss"]
    floor_rss = results["no-optimizer"]["peak_rss"] if "no-optimizer" in results else float("nan")
    used_allocator = allocator(not args.no_jemalloc)

    lines = [
        f"model: GPT-2 {args.layers} layers x {args.hidden} hidden = {n / 1e6:.0f}M params; batch {args.batch} x seq {args.seq}; "
        f"allocator: {used_allocator}; swap dir {args.swap_dir} (O_DIRECT={io['direct']}); "
        f"medians of {args.steps} steps x {args.rounds} round(s) after {args.warmup} warm-up; each run a fresh process, "
        "configurations interleaved",
        "",
        f"io-bench on that directory: read {io['read_bps'] / 1e6:.0f} MB/s, write {io['write_bps'] / 1e6:.0f} MB/s",
        f"optimizer alone: {24 * n / 1e9:.2f} GB moved in {opt_s:.2f} s; the drive's floor for that mix is {ideal_s:.2f} s",
        f"  => optimizer SSD traffic / io-bench bandwidth = {ideal_s / opt_s:.2f}   (target >= 0.85)",
        "",
        f"{'configuration':<34} {'step s':>8} {'x torch':>8} {'peak RSS GiB':>13} {'x torch':>8} {'above floor GiB':>16}",
        "-" * 92,
    ]
    labels = {"no-optimizer": "forward+backward only (floor)", "torch": "torch.optim.AdamW(fused) in RAM",
              "fuyou": "FuyouAdamW", "fuyou-clip": "FuyouAdamW max_grad_norm=1.0",
              "fuyou-ram": "FuyouAdamW, state in host RAM", "fuyou-io-ram": "optimizer alone, state in RAM",
              "fuyou-io": "optimizer alone, state on SSD", "torch-io": "torch.optim.AdamW(fused) alone",
              "fuyou-ram-exact": "FuyouAdamW, RAM state, next_forward",
              "fuyou-io-ram-exact": "optimizer alone, RAM, next_forward",
              "fuyou-bf16": "FuyouAdamW, state_format='bf16'", "fuyou-8bit": "FuyouAdamW, state_format='8bit'",
              "fuyou+act-ssd": "FuyouAdamW + activations to SSD"}
    for config in configs:
        r, label = results[config], labels[config]
        s = statistics.median(r["step_s"])
        lines.append(f"{label:<34} {s:>8.2f} {s / ref_s:>8.2f} {r['peak_rss'] / 2**30:>13.2f} {r['peak_rss'] / ref_rss:>8.2f} "
                     f"{(r['peak_rss'] - floor_rss) / 2**30:>16.2f}")
    lines.append("targets: FuyouAdamW step <= 1.15x, peak RSS <= 0.5x; 'above floor' = peak RSS minus the forward+backward-only run")
    if "stats" in results.get("fuyou-clip", {}):
        lines.append(f"fuyou-clip step outcomes: {results['fuyou-clip']['stats']}")
    table = "\n".join(lines)
    print(table)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items()}, "allocator": used_allocator,
                   "optimizer_io_fraction": ideal_s / opt_s, "step_ratios": {c: statistics.median(results[c]["step_s"]) / ref_s for c in configs},
                   "rss_ratios": {c: results[c]["peak_rss"] / ref_rss for c in configs}, "runs": runs, "table": table}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
