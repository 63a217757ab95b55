"""The host optimizer update side by side: fuyou's whole update path, torch's bare fused kernel, DeepSpeedCPUAdam.

One run; each system in a fresh process (jemalloc preloaded when installed), rounds interleaved, a warm-up
step first, the median of the timed steps. Every system updates ``--params`` parameters (default 64M) whose
state is in RAM, from gradients set by hand (no model, no backward: the update alone), on the same intra-op
threads (torch's count; fuyou's ``optimizer_threads`` set to it, what ``"auto"`` gives with an accelerator):

- ``bandwidth``: the machine's memory bandwidth measured in the same run: the fastest of a read (``sum``), a
  ``copy_``, a triad and an in-place add (``a += b / 2``, the in-place kernel's pattern) over ``--copy-bytes``
  per tensor (bytes read + bytes written per second);
- ``torch-bare``: ``torch._fused_adamw_`` on fp32 masters, moments and an fp32 gradient, chunk by chunk
  (``--chunk`` elements, the 350M run's), nothing else: the kernel's own rate on this memory;
- ``torch-norm+bare``: the same after every gradient's norm and the global one, as ``clip_grad_norm_`` takes
  them: what a step that clips (or skips a non-finite step, as fuyou's does) reads on top of the kernel;
- ``torch-adamw``: ``torch.optim.AdamW(fused=True)`` after ``clip_grad_norm_`` on the same parameters as fuyou's
  (fp32): torch's whole step, its cost per parameter included (one kernel call for all of them);
- ``fuyou-exact``: `FuyouAdamW` with the whole state in host RAM (``host_state``), ``optimizer_schedule=
  "next_forward"`` (what ``"auto"`` takes on a CPU with the state in RAM): ``step()`` + ``flush()``, which
  take every gradient's norm first (the skip of a non-finite step; clipping) and then update;
- ``fuyou-speculative``: the same with ``optimizer_schedule="backward"``: the speculative update into the
  shadow slot and its commit (what a GPU run with the state in RAM does);
- ``fuyou-exact-torch``, ``fuyou-speculative-torch``: the same with ``update_kernel="torch"`` (torch's kernel
  in place, with the copies around it: the path before the one pass);
- ``fuyou-exact-device``, ``fuyou-speculative-device``: the whole state on the device tier (``device_state``;
  on the CPU the device is host RAM): torch's kernel where the state is, as a GPU's device tier runs it, and
  what fuyou's path adds around it (norms, chunking, the shadow copy). Their "update alone" is empty: the
  worker's meter counts host updates only;
- ``deepspeed``: ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (``--deepspeed-python``: a Python with the ``peers``
  extra; its CPU Adam op is built on first use), fp32 parameters only: its kernel alone;
- ``deepspeed-offload``: the host's share of a DeepSpeed ZeRO-2 Offload step with gradient clipping on
  (``stage_1_and_2.py``, ``step()`` with ``cpu_offload``), on its one flat fp32 partition: the gradient multiplied
  by ``1 / combined_scale`` (``unscale_and_clip_grads``: every step while clipping is on, 1 when the norm is
  under the limit), ``DeepSpeedCPUAdam.step()``, and the partition copied into the buffer in the model's dtype
  (``--dtype``) that then goes to the device. Its norms are not here: the engine takes them on the accelerator in
  backward (``set_norm_for_param_grad_in_gpu``); fuyou's exact step takes them on the host, in its time.

``--param-elems N`` cuts the parameters of fuyou, ``torch-adamw`` and DeepSpeed into ``N`` elements each (default
8 chunks of ``--chunk``): many small parameters show each system's cost per parameter (GPT-2 350M has 292 parameter tensors).
``--state-chunk`` sets fuyou's ``chunk_size`` (the state's chunks; default 16 MiB): small chunks show the worker's
cost per chunk apart from the pass. ``--beside-python`` runs a thread beside every system's timed steps that issues
small torch ops in a loop, as a launch-bound training thread issues a GPU's kernels, and reports its rate during the
steps against its rate alone (in the same process, just before): what the update's Python costs the thread that
drives the device. ``--threads N`` sets the intra-op threads (and fuyou's ``optimizer_threads``); with
``--beside-python`` on a 2-core machine, 1 leaves a core to the loop.

``--before-src PATH`` adds ``fuyou-exact@before`` and ``fuyou-speculative@before`` (or the fuyou systems named by
``--before-systems``): the same runs with another checkout's ``src`` (an earlier commit), interleaved with the rest.

For fuyou the table gives the whole ``step()`` and, apart, its update alone: the worker's time in the updates
(`UpdateMeter`: each chunk's pass and publish, not the norms). ``--dtype bf16`` gives fuyou bf16 compute weights
and gradients (the masters stay fp32); the bare kernel and DeepSpeed run on fp32 either way. The share of
bandwidth counts the bytes one fused pass must move per parameter: read the gradient and the three state values,
write the three state values and the compute weight (fp32 weights are their own master: 28 B; bf16: 2 + 12 +
12 + 2 = 28 B). fuyou's exact fp32 path updates the master in the parameter, which holds it, from the second step
on (28 B); its speculative one writes the new master twice, into the shadow slot and into the parameter (32 B).

    python benchmarks/update_rate_bench.py --dtype fp32 --deepspeed-python /path/to/venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import allocator, fresh_env  # noqa: E402

SYSTEMS = ("bandwidth", "torch-bare", "torch-norm+bare", "torch-adamw", "fuyou-exact", "fuyou-speculative",
           "fuyou-exact-torch", "fuyou-speculative-torch", "fuyou-exact-device", "fuyou-speculative-device", "deepspeed",
           "deepspeed-offload")
BYTES_PER_PARAM = 28  # one fused pass: gradient and state read once, state and compute weight written once


def timed(fn, warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``fn`` after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times


def beside_python(run, warmup: int, steps: int) -> tuple[list[float], dict]:
    """Time ``run`` as `timed` does with a thread beside it issuing small torch ops (two in-place ops on 16 values,
    each a few microseconds of Python and dispatch, as a launch-bound training thread issues kernels). Returns
    the step times and the thread's ops per second alone (0.5 s before the steps) and during each timed step."""
    import threading

    import torch

    stop, count = threading.Event(), [0]

    def loop() -> None:
        x = torch.zeros(16)
        while not stop.is_set():
            x.add_(1)
            x.mul_(0.5)
            count[0] += 2

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        began, t = count[0], time.perf_counter()
        time.sleep(0.5)
        alone = (count[0] - began) / (time.perf_counter() - t)
        during = []

        def counted() -> None:  # the loop's rate during this call of run
            began, t = count[0], time.perf_counter()
            run()
            during.append((count[0] - began) / (time.perf_counter() - t))

        times = timed(counted, warmup, steps)
        during = during[warmup:]
    finally:
        stop.set()
        thread.join()
    return times, {"beside_ops_per_s_alone": alone, "beside_ops_per_s": during}


def worker(args: argparse.Namespace) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n, chunk = int(args.params), args.chunk
    if args.worker == "bandwidth":  # the fastest of four streams (tensors read, written): read only (1, 0), copy
        # (1, 1), triad (2, 1), and in place (2, 1) as AdamW's kernel writes: into lines it has just read, so the
        # cache need not first read the lines it writes (a copy's or triad's writes cost a read the count omits)
        a, b, c = (torch.ones(args.copy_bytes // 4) for _ in range(3))
        streams = {"read": (lambda: a.sum(), 1), "copy": (lambda: b.copy_(a), 2),
                   "triad": (lambda: torch.add(b, c, alpha=0.5, out=a), 3),
                   "in place": (lambda: a.add_(b, alpha=0.5), 3)}
        rates, times = {}, []
        for name, (fn, moved) in streams.items():
            took = timed(fn, args.warmup, args.steps)
            rates[name] = moved * args.copy_bytes / statistics.median(took)
            times += took
        return {"step_s": times, "bytes_per_s": max(rates.values()), "streams_bytes_per_s": rates}
    hyper = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    each = args.param_elems or chunk * 8  # elements per parameter (fuyou's, torch-adamw's, DeepSpeed's)
    if args.worker in ("torch-bare", "torch-norm+bare"):
        m, g, a, s = (torch.randn(n), torch.randn(n) * 1e-3, torch.zeros(n), torch.zeros(n))
        step = torch.tensor(0.0)
        k = dict(lr=hyper["lr"], beta1=0.9, beta2=0.999, weight_decay=hyper["weight_decay"], eps=hyper["eps"],
                 amsgrad=False, maximize=False)
        norms = args.worker == "torch-norm+bare"

        def run() -> None:
            step.add_(1)
            if norms:  # per tensor (fuyou's parameters), then the global norm: clip_grad_norm_'s
                per = [torch.linalg.vector_norm(g[i : i + each], 2) for i in range(0, n, each)]
                torch.linalg.vector_norm(torch.stack(per), 2).item()
            for i in range(0, n, chunk):
                e = min(n, i + chunk)
                torch._fused_adamw_([m[i:e]], [g[i:e]], [a[i:e]], [s[i:e]], [], [step], **k)
    elif args.worker == "torch-adamw":
        params = [torch.nn.Parameter(torch.randn(min(each, n - i))) for i in range(0, n, each)]
        grads = [(torch.randn_like(p) * 1e-3) for p in params]
        opt = torch.optim.AdamW(params, **hyper, fused=True)

        def run() -> None:
            for p, grad in zip(params, grads):
                p.grad = grad
            torch.nn.utils.clip_grad_norm_(params, 1e9)
            opt.step()
    elif args.worker.startswith("fuyou"):
        from fuyou_strategy import FuyouAdamW, FuyouConfig

        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
        params = [torch.nn.Parameter(torch.randn(min(each, n - i), dtype=dtype)) for i in range(0, n, each)]
        grads = [(torch.randn_like(p) * 1e-3) for p in params]
        state = 2 * 12 * n + 2**30
        schedule = "next_forward" if args.worker.startswith("fuyou-exact") else "backward"
        # a checkout from before update_kernel takes none (its kernel is torch's)
        kernel = {"update_kernel": "torch"} if args.worker.endswith("-torch") else {}
        tier = dict(device_state=state, host_state=0) if args.worker.endswith("-device") else dict(host_state=state)
        chunking = {"chunk_size": args.state_chunk} if args.state_chunk else {}
        cfg = FuyouConfig(swap_dirs=[args.swap_dir], host_memory_budget=state + 2**30, optimizer_schedule=schedule,
                          optimizer_threads=torch.get_num_threads(), **tier, **kernel, **chunking)
        opt = FuyouAdamW(params, **hyper, config=cfg)
        updates: list[float] = []

        def run() -> None:
            for p, grad in zip(params, grads):
                p.grad = grad
            began = opt.control.figures().update_total[0]
            opt.step()
            opt.flush()
            updates.append(opt.control.figures().update_total[0] - began)
    elif args.worker in ("deepspeed", "deepspeed-offload"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        offload = args.worker == "deepspeed-offload"
        spans = [(0, n)] if offload else [(i, min(each, n - i)) for i in range(0, n, each)]  # ZeRO's flat partition
        params = [torch.nn.Parameter(torch.randn(size)) for _, size in spans]
        grads = [(torch.randn_like(p) * 1e-3) for p in params]
        opt = DeepSpeedCPUAdam(params, lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"],
                               weight_decay=hyper["weight_decay"], adamw_mode=True)
        model_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
        sent = torch.zeros(n, dtype=model_dtype) if offload else None  # param_buffer_of_bit16_for_cpu_offload_groups
        norm, clip_grad, loss_scale = torch.tensor(0.5), 1.0, 1.0  # the accelerator's norm, under the limit

        def run() -> None:
            for p, grad in zip(params, grads):
                p.grad = grad
            if offload:  # unscale_and_clip_grads, as DeepSpeed writes it
                clip = torch.clamp(((norm / loss_scale) + 1e-6) / clip_grad, min=1.0)
                for p in params:
                    p.grad.data.mul_(1. / (clip * loss_scale))
            opt.step()
            if offload:
                sent.copy_(params[0].data)
    else:
        raise SystemExit(f"unknown system {args.worker!r}")
    beside: dict = {}
    if args.beside_python:
        times, beside = beside_python(run, args.warmup, args.steps)
    else:
        times = timed(run, args.warmup, args.steps)
    out = {"step_s": times, "threads": torch.get_num_threads(), **beside}
    if args.worker == "torch-adamw" or args.worker.startswith(("fuyou", "deepspeed")):
        out["parameters"] = len(params)
    if args.worker.startswith("fuyou"):
        figures = opt.control.figures()
        out.update(update_s=updates[args.warmup:], worker_threads=figures.worker_threads,
                   update_kernel=getattr(figures, "update_kernel", "torch"),
                   state_chunks=sum(ps.nchunks for ps in opt.adam_state.owned))
        opt.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--params", type=float, default=64e6)
    p.add_argument("--chunk", type=int, default=680_000, help="elements per kernel call / state chunk")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="fuyou's compute weights")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--copy-bytes", type=int, default=2**30)
    p.add_argument("--swap-dir", default="/tmp")
    p.add_argument("--deepspeed-python", help="a Python with deepspeed installed (default: this one)")
    p.add_argument("--before-src", help="another checkout's src folder: adds fuyou-exact@before, fuyou-speculative@before")
    p.add_argument("--before-systems", default="fuyou-exact,fuyou-speculative",
                   help="the fuyou systems run again with --before-src")
    p.add_argument("--param-elems", type=int, default=0, help="elements per parameter (default: 8 x --chunk)")
    p.add_argument("--state-chunk", default="", help="fuyou's chunk_size (e.g. 64KiB); default: FuyouConfig's")
    p.add_argument("--beside-python", action="store_true", help="a thread issuing small torch ops beside the steps")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (default: torch's)")
    p.add_argument("--no-jemalloc", action="store_true")
    p.add_argument("--json", default="update_rate_bench.json")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    src = str(Path(__file__).resolve().parent.parent / "src")
    before = [f"{system}@before" for system in args.before_systems.split(",")] if args.before_src else []
    if any(not system.startswith("fuyou") for system in before):
        raise SystemExit(f"--before-systems: got {args.before_systems!r}; only fuyou's systems run another checkout")
    systems = args.systems.split(",") + before
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(args.rounds):
        for system in systems:
            python = args.deepspeed_python if system.startswith("deepspeed") and args.deepspeed_python else sys.executable
            env = fresh_env(not args.no_jemalloc)
            env["PYTHONPATH"] = args.before_src if system.endswith("@before") else src
            argv = [python, __file__, "--worker", system.removesuffix("@before"), f"--params={args.params}",
                    f"--chunk={args.chunk}",
                    f"--dtype={args.dtype}", f"--steps={args.steps}", f"--warmup={args.warmup}",
                    f"--copy-bytes={args.copy_bytes}", f"--swap-dir={args.swap_dir}", f"--threads={args.threads}",
                    f"--param-elems={args.param_elems}", *([f"--state-chunk={args.state_chunk}"] if args.state_chunk else []),
                    *(["--beside-python"] if args.beside_python else [])]
            print(f"round {r + 1}/{args.rounds}: {system} ...", file=sys.stderr, flush=True)
            proc = subprocess.run(argv, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                print(f"{system} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                runs[system].append({"error": proc.stderr[-2000:]})
                continue
            runs[system].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    n = int(args.params)
    ok = {s: [r for r in v if "step_s" in r] for s, v in runs.items()}
    bandwidth = statistics.median(r["bytes_per_s"] for r in ok.get("bandwidth", [])) if ok.get("bandwidth") else None
    summary = {}
    bare = None
    for system in systems:
        if system == "bandwidth" or not ok[system]:
            continue
        step = statistics.median(t for r in ok[system] for t in r["step_s"])
        rate = n / step
        if system == "torch-bare":
            bare = rate
        summary[system] = {"median_step_s": step, "params_per_s": rate,
                           "round_medians_s": [statistics.median(r["step_s"]) for r in ok[system]]}
        if args.beside_python:  # the loop beside the steps: its rate during them, as a share of its rate alone
            summary[system]["beside_share"] = statistics.median(
                d / r["beside_ops_per_s_alone"] for r in ok[system] for d in r["beside_ops_per_s"])
        alone = statistics.median(t for r in ok[system] for t in r.get("update_s", [0.0]))
        if alone > 0:  # the device tier's updates are not the host's time: none
            summary[system]["median_update_s"] = alone
            summary[system]["update_kernel"] = ok[system][0]["update_kernel"]
    lines = [f"{n / 1e6:.0f}M parameters, state in RAM, fuyou's compute weights {args.dtype}; allocator: "
             f"{allocator(not args.no_jemalloc)}; {args.rounds} interleaved rounds of {args.steps} steps after "
             f"{args.warmup} warm-up, a fresh process per system and round; intra-op threads: "
             f"{next((r[0]['threads'] for r in ok.values() if r and 'threads' in r[0]), '?')}"
             + (f"; fuyou's chunk_size {args.state_chunk}" if args.state_chunk else "")
             + (f"; parameters of {args.param_elems} elements" if args.param_elems else "")
             + ("; a thread issuing small torch ops beside the steps (its rate during them: x its rate alone)"
                if args.beside_python else ""),
             "memory bandwidth (fastest of read, copy, triad, in place; read + write): " + (f"{bandwidth / 1e9:.1f} GB/s" if bandwidth else "not measured"),
             "", f"| system | step s (median) | M params/s | x torch-bare | share of bandwidth at {BYTES_PER_PARAM} B/param "
             "| fuyou's update alone: s, x torch-bare |" + (" ops beside: x alone |" if args.beside_python else ""),
             "|---|---|---|---|---|---|" + ("---|" if args.beside_python else "")]
    for system, row in summary.items():
        rate = row["params_per_s"]
        share = f"{rate * BYTES_PER_PARAM / bandwidth:.0%}" if bandwidth else "-"
        vs = f"{rate / bare:.2f}" if bare else "-"
        alone = "" if "median_update_s" not in row else \
            f"{row['median_update_s']:.3f}, {n / row['median_update_s'] / bare:.2f}" if bare else f"{row['median_update_s']:.3f}"
        beside = f" {row['beside_share']:.2f} |" if "beside_share" in row else ""
        lines.append(f"| {system} | {row['median_step_s']:.3f} | {rate / 1e6:.0f} | {vs} | {share} | {alone} |{beside}")
    for system in systems:
        if runs[system] and not ok[system]:
            lines.append(f"| {system} | failed: see the JSON | | | |")
    table = "\n".join(lines)
    print(table)
    Path(args.json).write_text(json.dumps({"args": vars(args), "bandwidth_bytes_per_s": bandwidth,
                                           "summary": summary, "runs": runs, "table": table}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
