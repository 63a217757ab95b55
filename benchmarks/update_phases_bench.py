"""Where a host AdamW update's time goes, phase by phase, over a whole model's worth of state in RAM.

The second and third GPU runs' traces show the optimizer worker busy ~0.5 s a step at 350M with the state
in RAM: ~1 ms for each of ~520 chunks of ~680K parameters, on a 16-core host. This times each phase the
worker runs per chunk, over ``--params`` parameters cycled so that every chunk comes from memory (as in a
run) rather than from the cache, on the worker's kind of thread (a Python thread, not the main one):

- ``stage``: the gradient (``--grad-dtype``) from the device into a pinned host buffer (CPU: a plain copy);
- ``upcast``: that gradient to fp32, into a fresh tensor (what the update does) and into a kept one;
- ``shadow``: the state chunk (12 B/param) copied to its shadow slot (the ``backward`` schedule's lend);
- ``kernel``: torch's fused AdamW on the chunk;
- ``publish``: the new master into the device parameter (``--grad-dtype``): the synchronous ``copy_`` the
  update does, and a cast into a pinned buffer followed by an asynchronous copy;
- ``one pass``: the one-pass update (`optim.onepass`, ``update_kernel="one_pass"``) of the chunk, from the state
  into the shadow (a speculative update, out of place) with the host gradient in its dtype, the compute weight
  written in the pass (on the CPU into the parameter; on a GPU into a pinned buffer, then copied to the device);
- ``one pass, copy beside the next`` (GPU only): the same, each chunk's copy to the device left running beside the
  next chunk's pass, two pinned buffers taking turns, as `OptimizerState.update_job` runs a parameter's chunks.

The last rows compare a chunk as torch's kernel runs it (stage + upcast + shadow + kernel + publish) with the
one pass (stage + one pass).

    python benchmarks/update_phases_bench.py --params 355e6 --chunk 680000 --device cuda
    python benchmarks/update_phases_bench.py --params 60e6            # on a CPU: the device tier is RAM

Prints a table (ms per chunk, M params/s, share of the sum) and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=60e6, help="parameters of state cycled through (default 60e6)")
    p.add_argument("--chunk", type=int, default=680_000, help="elements per chunk (the 350M run's ~680K)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--grad-dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="update_phases.json")
    args = p.parse_args()
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(run(args)), name="fuyou-phases")
    worker.start()
    worker.join()
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


def run(args: argparse.Namespace) -> dict:
    from fuyou_strategy.optim import onepass
    from fuyou_strategy.optim.state import adamw_kernel

    one, why = onepass.load()
    print(f"the one pass: {why}", flush=True)

    dev = torch.device(args.device)
    gd = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.grad_dtype]
    n, chunks = args.chunk, max(2, int(args.params) // args.chunk)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    print(f"{chunks} chunks of {n} elements ({chunks * n / 1e6:.0f}M params), device {dev}, grads {args.grad_dtype}, "
          f"torch threads on this worker thread: {torch.get_num_threads()}", flush=True)
    state = [torch.randn(3 * n).abs_() for _ in range(chunks)]
    shadow = [torch.empty(3 * n) for _ in range(chunks)]
    grads = [torch.randn(n, device=dev).to(gd) for _ in range(chunks)]
    params = [torch.empty(n, device=dev, dtype=gd) for _ in range(chunks)]
    pin = dict(pin_memory=True) if cuda else {}
    staging = torch.empty(n, dtype=gd, **pin)
    pinned_out = torch.empty(n, dtype=gd, **pin)
    turns = [pinned_out, torch.empty(n, dtype=gd, **pin)]  # `one_pass_beside`'s two buffers
    copied: list = [None, None]  # each buffer's last copy to the device (a CUDA event), not waited for yet
    kept = torch.empty(n)
    host_grads = [torch.randn(n).to(gd) for _ in range(chunks)]
    step = torch.tensor(1.0)
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8)

    def stage(i):
        staging.copy_(grads[i], non_blocking=cuda)
        sync()

    def upcast_fresh(i):
        host_grads[i].to(torch.float32)

    def upcast_kept(i):
        kept.copy_(host_grads[i])

    def shadow_copy(i):
        shadow[i].copy_(state[i])

    def kernel(i):  # the update's own call (`optim.state.adamw_kernel`: torch's fused kernel)
        m, a, s = state[i][:n], state[i][n:2 * n], state[i][2 * n:]
        adamw_kernel(m, kept, a, s, step, fused=True, **hyper)

    def publish_sync(i):
        params[i].copy_(state[i][:n])

    def publish_pinned(i):
        pinned_out.copy_(state[i][:n])
        params[i].copy_(pinned_out, non_blocking=cuda)
        sync()

    def one_pass(i):  # from the state into the shadow, the weight in the same pass
        m, a, s = state[i][:n], state[i][n:2 * n], state[i][2 * n:]
        one.update(m, a, s, host_grads[i], shadow[i][:n], shadow[i][n:2 * n], shadow[i][2 * n:],
                   pinned_out if cuda else params[i], step=step, inv_scale=None, coef=None, **hyper)
        if cuda:
            params[i].copy_(pinned_out, non_blocking=True)
            sync()

    def one_pass_beside(i):  # as `one_pass`, the copy waited for only before its buffer's next pass
        b = i % 2
        if copied[b] is not None:
            copied[b].synchronize()
        m, a, s = state[i][:n], state[i][n:2 * n], state[i][2 * n:]
        one.update(m, a, s, host_grads[i], shadow[i][:n], shadow[i][n:2 * n], shadow[i][2 * n:], turns[b],
                   step=step, inv_scale=None, coef=None, **hyper)
        params[i].copy_(turns[b], non_blocking=True)
        copied[b] = torch.cuda.Event()
        copied[b].record()

    phases = {"stage": stage, "upcast (fresh)": upcast_fresh, "upcast (kept)": upcast_kept, "shadow": shadow_copy,
              "kernel": kernel, "publish (sync copy_)": publish_sync, "publish (pinned, async)": publish_pinned}
    if one is not None:
        phases["one pass"] = one_pass
        if cuda:
            phases["one pass, copy beside the next"] = one_pass_beside
    times: dict[str, list[float]] = {k: [] for k in phases}
    for r in range(args.rounds + 1):  # round 0 warms up (page faults, allocator)
        for name, fn in phases.items():  # interleaved: each phase over every chunk, once per round
            sync()
            t = time.perf_counter()
            for i in range(chunks):
                fn(i)
            sync()
            if r:
                times[name].append((time.perf_counter() - t) / chunks)
    rows = {k: statistics.median(v) for k, v in times.items()}
    base = sum(rows[k] for k in ("stage", "upcast (fresh)", "shadow", "kernel", "publish (sync copy_)"))
    print(f"\n| phase | ms per chunk | M params/s | share of torch's kernel's chunk |\n|---|---|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v * 1e3:.3f} | {n / v / 1e6:.0f} | {v / base:.0%} |")
    print(f"| torch's kernel's chunk (stage + upcast fresh + shadow + kernel + sync publish) | {base * 1e3:.3f} | "
          f"{n / base / 1e6:.0f} | 100% |")
    if one is not None:
        whole = rows["stage"] + rows["one pass"]
        print(f"| the one pass's chunk (stage + one pass) | {whole * 1e3:.3f} | {n / whole / 1e6:.0f} | {whole / base:.0%} |")
    return {"device": str(dev), "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
            "threads": torch.get_num_threads(), "chunk": n, "chunks": chunks, "grad_dtype": args.grad_dtype,
            "seconds_per_chunk": rows, "samples": times}


if __name__ == "__main__":
    main()
