"""fuyou against DeepSpeed and Colossal-AI: the same model, data and initial weights, side by side.

Each system (``--systems``, see ``systems.SYSTEMS``) trains each model size (``--sizes``) for
``--warmup + --steps`` optimizer steps in a fresh process, over ``--rounds`` interleaved rounds.
The parent watches every child: a child whose RSS passes ``--memory-limit`` is stopped and its row
says "out of memory" (and the system is not tried at larger sizes); one that runs past
``--timeout`` is stopped too. A peer that is not installed, or that refuses this machine, gets a
row that says why. Meanwhile the parent samples the bytes in the child's swap directory, so the
table's "on SSD" column is the peak footprint, measured the same way for every system.

    .venv/bin/python -m benchmarks.peers                     # 124M and 350M, fp32, every system
    .venv/bin/python -m benchmarks.peers --sizes 124M,350M,774M,1.5B --rounds 1   # the size sweep
    .venv/bin/python -m benchmarks.peers --dtype bf16        # where the CPU has bf16 instructions
    .venv/bin/python -m benchmarks.peers --model /path/to/hf-folder --systems torch,fuyou-lightning

Install the peers first with ``benchmarks/peers/install.sh`` (it never changes torch). Prints a
Markdown table per size, writes ``peers.json`` (every raw number) and ``peers.png`` (step time and
peak RSS per system against model size) to ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from common import allocator, choose_dtype, fresh_env, peak_rss_bytes, proc_bytes  # noqa: E402
from fuyou_strategy.storage.rundir import dir_bytes  # noqa: E402
from systems import SIZES, SWEPT, SYSTEMS, Job, Unavailable, run, system  # noqa: E402

GiB = 2**30


def split_systems(text: str) -> list[str]:
    """``--systems`` as names: split at commas, except that a ``<field>=<value>`` piece after a variant
    (``fuyou-engine@optimizer_schedule=next_forward,optimizer_threads=8``) belongs to that variant."""
    names: list[str] = []
    for piece in text.split(","):
        if names and "@" in names[-1] and "=" in piece and "@" not in piece:
            names[-1] += "," + piece
        else:
            names.append(piece)
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma list of {', '.join(SYSTEMS)}, and {SWEPT}<bytes> (e.g. {SWEPT}4GiB): fuyou-hf with that "
                   "host_memory_budget; several of them also draw step time against peak RSS (<stem>-sweep.png); "
                   "and <fuyou system>@<field>=<value>[,...] (e.g. fuyou-state-ssd@optimizer_schedule=backward): "
                   "that system with those FuyouConfig fields set")
    p.add_argument("--sizes", default="124M,350M", help=f"comma list of {', '.join(SIZES)}")
    p.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--model", help="a local Hugging Face model folder (replaces --arch/--sizes)")
    p.add_argument("--dtype", default="fp32", help="fp32, bf16, or auto (bf16 where the CPU has it natively)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model computes (cuda: the table adds TFLOPS and the GPU's peak memory)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (fuyou's planner profiles 2)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds, each system a fresh process")
    p.add_argument("--memory-limit", default=None,
                   help="stop a run whose RSS passes this many GiB (default: 90%% of MemTotal)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before a run is stopped")
    p.add_argument("--swap-dir", default=None, help="directory on the SSD for every system's swap files "
                   "(default: a temporary one under $TMPDIR)")
    p.add_argument("--no-jemalloc", action="store_true")
    p.add_argument("--out", default=str(HERE.parent / "results"))
    p.add_argument("--replot", help="comma list of this benchmark's JSON files: tables and one plot of all "
                   "their sizes (e.g. separate runs per size), written as peers-merged.* to --out")
    p.add_argument("--trace", help="a folder: fuyou's runs of the first round write a two-step timeline there "
                   "(<system>-<size>.json; `fuyou report FILE --png` draws it)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def job_of(args: argparse.Namespace, size: str, swap_dir: str) -> Job:
    return Job(arch=args.arch, size=size, model=args.model, dtype=args.dtype, batch=args.batch, seq=args.seq,
               steps=args.warmup + args.steps, swap_dir=swap_dir, trace=args.trace,
               device=args.device)


def worker(args: argparse.Namespace) -> dict:
    """Run one system on one size in this process; always returns a JSON-able dict (a crash in native
    code leaves its Python stack on stderr for the parent)."""
    faulthandler.enable()
    size, swap_dir = args.sizes, args.swap_dir
    job = job_of(args, size, swap_dir)
    try:
        trace = run(args.worker, job)
    except Unavailable as e:
        return {"status": "unavailable", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - the row reports it
        traceback.print_exc()  # the whole stack on stderr: the parent keeps it in the run's log
        where = traceback.extract_tb(e.__traceback__)[-1]
        return {"status": "failed", "reason": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]} "
                f"(at {Path(where.filename).name}:{where.lineno})"}
    if len(trace.step_s) != args.warmup + args.steps or len(trace.losses) != len(trace.step_s):
        return {"status": "failed", "reason": f"ran {len(trace.step_s)} steps with {len(trace.losses)} losses, "
                f"expected {args.warmup + args.steps}"}
    return {"status": "ok", "step_s": trace.step_s[args.warmup:], "warmup_s": trace.step_s[:args.warmup],
            "losses": trace.losses, "peak_rss": peak_rss_bytes(), "driver": trace.driver, "summary": trace.summary,
            "params": job.n_params, "device_peak": _device_peak_bytes(args.device)}


def _device_peak_bytes(device: str) -> int | None:
    """The GPU's allocated-memory high-water mark of this process (torch's allocator; DeepSpeed's too)."""
    if device != "cuda":
        return None
    import torch
    return torch.cuda.max_memory_allocated()


def _rss(pid: int) -> int:
    try:
        return proc_bytes(f"/proc/{pid}/status", "VmRSS")
    except (OSError, RuntimeError):  # gone, or a zombie (no VmRSS line)
        return 0


def watch(argv: list[str], swap_dir: Path, limit: int, timeout: float, use_jemalloc: bool) -> dict:
    """Run a worker (``run.py --worker ...``) and watch it: its RSS against ``limit``, its time
    against ``timeout``, and its swap directory's size. Returns the worker's result with
    ``ssd_peak_bytes``, or a failure row."""
    swap_dir.mkdir(parents=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
    start, peak_disk, stopped = time.monotonic(), 0, None
    with open(swap_dir.parent / f"{swap_dir.name}.log", "w+") as log:
        # An interrupt (Ctrl-C, SIGTERM) between starting the worker and the `try` below would leave it running
        # on its own (its own session, no `finally` yet to kill it). A signal mask cannot hold it off: the mask
        # is per thread, and a signal sent to the process reaches any other thread (torch's, an import's) that
        # does not block it, whose Python handler then runs in this thread at once. So the handlers only note
        # the interrupt while the worker starts, and it is raised again inside the `try`, where it kills it.
        with _interrupts_deferred() as pending:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=fresh_env(use_jemalloc),
                                    start_new_session=True)
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
        try:
            pending.raise_again()
            reader.start()
            while proc.poll() is None:
                rss = _rss(proc.pid)
                peak_disk = max(peak_disk, dir_bytes(str(swap_dir)))
                if rss > limit:
                    stopped = "out of memory", f"RSS reached {rss / GiB:.2f} GiB > the {limit / GiB:.2f} GiB limit"
                elif time.monotonic() - start > timeout:
                    stopped = "timed out", f"stopped after {timeout:.0f} s"
                if stopped:
                    break
                time.sleep(0.5)
        finally:  # stopped, or this process interrupted: the worker (its own session) goes down with it
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
        reader.join(timeout=60)
        log.seek(0)
        stderr = log.read()
    shutil.rmtree(swap_dir, ignore_errors=True)
    elapsed = time.monotonic() - start
    if stopped:
        return {"status": stopped[0], "reason": stopped[1], "ssd_peak_bytes": peak_disk, "wall_s": elapsed}
    try:
        result = json.loads(out[-1])
    except (IndexError, json.JSONDecodeError):
        reason = f"exit code {proc.returncode}: {crash_reason(stderr)}"
        if proc.returncode == -signal.SIGKILL:
            reason += " (killed: the kernel's OOM killer?)"
        return {"status": "failed", "reason": reason, "ssd_peak_bytes": peak_disk, "wall_s": elapsed}
    if proc.returncode != 0:  # after it reported (e.g. a peer's exit handler crashed): keep the result, say so
        result["exit"] = f"exit code {proc.returncode} after reporting"
    return {**result, "ssd_peak_bytes": peak_disk, "wall_s": elapsed}


class _Pending:
    """The interrupts noted while `_interrupts_deferred` held them, raised again by `raise_again`."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.handlers: dict[int, object] = {}

    def note(self, signum: int, frame: object) -> None:
        self.signals.append(signum)

    def raise_again(self) -> None:
        """Restore the handlers, then deliver each noted interrupt to them (the caller's `finally` runs)."""
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)
        self.handlers = {}
        for signum in self.signals:
            signal.raise_signal(signum)


@contextlib.contextmanager
def _interrupts_deferred():
    """While the block runs, SIGINT and SIGTERM are only noted; the caller calls ``raise_again()`` on what this
    yields once it is inside the ``try`` whose ``finally`` cleans up (or at once, if the block failed).
    Off the main thread (where Python's handlers cannot be set) nothing is deferred."""
    pending = _Pending()
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            pending.handlers[signum] = signal.signal(signum, pending.note)
    try:
        yield pending
    except BaseException:
        pending.raise_again()
        raise


def crash_reason(stderr: str) -> str:
    """What a worker's stderr says about its death: faulthandler's fatal error and the innermost frame
    of the crashing thread, else the last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    fatal = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error:")), None)
    if fatal is None:
        return lines[-1][:300] if lines else "no output"
    frame = next((line for line in lines[fatal:] if line.startswith("File ")), "")
    return f"{lines[fatal]}" + (f", in {frame}" if frame else "")


def merge(rounds: list[dict]) -> dict:
    """One system at one size over its rounds: every timed step, the median peak RSS, the peak SSD bytes."""
    ok = [r for r in rounds if r["status"] == "ok"]
    if not ok:
        return dict(rounds[-1])
    steps = [t for r in ok for t in r["step_s"]]
    return {"status": "ok", "driver": ok[0]["driver"], "step_s": steps, "median_s": statistics.median(steps),
            "min_s": min(steps), "max_s": max(steps), "peak_rss": statistics.median(r["peak_rss"] for r in ok),
            "ssd_peak_bytes": max(r["ssd_peak_bytes"] for r in ok), "losses": ok[0]["losses"],
            "loss_spread": max(abs(r["losses"][-1] - ok[0]["losses"][-1]) for r in ok), "rounds": len(ok),
            "params": ok[0].get("params"), "device_peak": max((r.get("device_peak") or 0) for r in ok) or None,
            "exit": next((r["exit"] for r in ok if "exit" in r), None)}


def table(size: str, rows: dict[str, dict], args: argparse.Namespace) -> str:
    """A Markdown table for one size: every system, ratios to torch in the same run. On a GPU it adds each
    system's model TFLOPS (6 x parameters x tokens per step: the same count for every system, recomputation
    not counted) and the GPU's peak allocated memory."""
    ref = rows.get("torch", {})
    ref = ref if ref.get("status") == "ok" else None
    tokens = args.batch * args.seq
    gpu = getattr(args, "device", "cpu") == "cuda"
    extra_head, extra_rule = (" TFLOPS | GPU peak GiB |", "---|---|") if gpu else ("", "")
    lines = [f"| system | step s (median, min–max) | tokens/s | × torch | peak RSS GiB | × torch | on SSD GiB |{extra_head} "
             f"loss after {args.warmup + args.steps} steps | Δ loss vs torch | driven by |",
             "|---|---|---|---|---|---|---|" + extra_rule + "---|---|---|"]
    for name, r in rows.items():
        if r["status"] != "ok":
            lines.append(f"| {name} | **{r['status']}** | | | | | |{' | |' if gpu else ''} | | {r['reason']} |")
            continue
        x_time = f"{r['median_s'] / ref['median_s']:.2f}" if ref else "—"
        x_rss = f"{r['peak_rss'] / ref['peak_rss']:.2f}" if ref else "—"
        d_loss = f"{r['losses'][-1] - ref['losses'][-1]:+.2e}" if ref else "—"
        extra = ""
        if gpu:
            tflops = 6 * (r.get("params") or 0) * tokens / r["median_s"] / 1e12
            extra = f" {tflops:.1f} | {(r.get('device_peak') or 0) / GiB:.2f} |"
        lines.append(f"| {name} | {r['median_s']:.2f} ({r['min_s']:.2f}–{r['max_s']:.2f}) | {tokens / r['median_s']:.0f} "
                     f"| {x_time} | {r['peak_rss'] / GiB:.2f} | {x_rss} | {r['ssd_peak_bytes'] / GiB:.2f} |{extra} "
                     f"{r['losses'][-1]:.4f} | {d_loss} | {r['driver']}{'; ' + r['exit'] if r.get('exit') else ''} |")
    return "\n".join(lines)


def plot(results: dict, path: Path, limit: int) -> bool:
    """Step time and peak RSS per system against model size (a cross where a system ran out of memory)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = list(results["sizes"])
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 5))
    for name in results["systems"]:
        xs, ts, ms, oom = [], [], [], []
        for i, size in enumerate(sizes):
            r = results["sizes"][size].get(name)
            if r is None:
                continue
            if r["status"] == "ok":
                xs.append(i), ts.append(r["median_s"]), ms.append(r["peak_rss"] / GiB)
            elif r["status"] == "out of memory":
                oom.append(i)
        if not xs and not oom:
            continue
        line, = ax_t.plot(xs, ts, marker="o", label=name)
        ax_m.plot(xs, ms, marker="o", color=line.get_color(), label=name)
        if oom:
            ax_m.scatter(oom, [limit / GiB] * len(oom), marker="x", s=80, color=line.get_color())
    ax_m.axhline(limit / GiB, color="grey", linestyle="--", linewidth=1)
    ax_m.text(len(sizes) - 1, limit / GiB, "memory limit (x: ran out) ", va="bottom", ha="right", fontsize=8,
              color="grey")
    for ax, label in ((ax_t, "step time, s (median)"), (ax_m, "peak RSS, GiB")):
        ax.set_xticks(range(len(sizes)), sizes)
        ax.set_xlabel("model size")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if any(len(line.get_xdata()) for line in ax_t.lines):  # a log axis needs a point
        ax_t.set_yscale("log")
    ax_m.legend(fontsize=8, loc="upper left")
    fig.suptitle(textwrap.fill(results["title"], 190), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_sweep(results: dict, path: Path) -> bool:
    """Step time against peak RSS, one panel per size: the ``fuyou-hf@<budget>`` runs as one line (the host
    budget sweep), every other system as a labelled point. False when no size has two sweep points."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [size for size, rows in results["sizes"].items()
             if sum(1 for n, r in rows.items() if n.startswith(SWEPT) and r["status"] == "ok") >= 2]
    if not sizes:
        return False
    fig, axes = plt.subplots(1, len(sizes), figsize=(7 * len(sizes), 5), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        rows = {n: r for n, r in results["sizes"][size].items() if r["status"] == "ok"}
        swept = sorted(((r["peak_rss"] / GiB, r["median_s"], n[len(SWEPT):]) for n, r in rows.items()
                        if n.startswith(SWEPT)))
        ax.plot([p[0] for p in swept], [p[1] for p in swept], marker="o", color="C0", linewidth=2,
                label="fuyou-hf, host_memory_budget swept")
        for x, y, budget in swept:
            ax.annotate(budget, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color="C0")
        for i, (name, r) in enumerate((n, r) for n, r in rows.items() if not n.startswith(SWEPT)):
            ax.scatter([r["peak_rss"] / GiB], [r["median_s"]], marker="s", s=50, color=f"C{i + 1}", label=name)
        ax.set_xlabel("peak RSS, GiB")
        ax.set_ylabel("step time, s (median)")
        ax.set_title(size)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(results["title"], 15 * 7 * len(sizes)), fontsize=8)  # ~15 characters per inch
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args), default=str), flush=True)  # before exit: some peers crash in their exit handlers
        return
    if args.replot:
        parts = [json.loads(Path(f).read_text()) for f in args.replot.split(",")]
        merged = {"title": " | ".join(dict.fromkeys(r["title"] for r in parts)),
                  "systems": list(dict.fromkeys(n for r in parts for n in r["systems"])),
                  "sizes": {k: v for r in parts for k, v in r["sizes"].items()}, "args": parts[0]["args"]}
        report(merged, argparse.Namespace(**parts[0]["args"]), Path(args.out), "peers-merged",
               int(0.9 * _mem_total()))
        return
    args.dtype, dtype_why = choose_dtype(args.dtype) if args.dtype == "auto" else (args.dtype, "--dtype")
    systems = split_systems(args.systems)
    unknown = [s for s in systems if system(s) is None]
    sizes = [Path(args.model).name] if args.model else args.sizes.split(",")
    unknown += [s for s in sizes if not args.model and s not in SIZES]
    if unknown:
        raise SystemExit(f"--systems/--sizes: unknown {unknown}; choose from {list(SYSTEMS)} and {list(SIZES)}")
    limit = int(float(args.memory_limit) * GiB) if args.memory_limit else int(0.9 * _mem_total())
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
    root = Path(args.swap_dir) if args.swap_dir else Path(os.environ.get("TMPDIR", "/tmp"))
    root = root / f"fuyou-peers-{os.getpid()}"
    runs: dict[str, dict[str, list[dict]]] = {size: {name: [] for name in systems} for size in sizes}
    given_up: dict[str, str] = {}  # system -> why it is not tried again (unavailable, out of memory)
    forwarded = ["--arch", args.arch, "--dtype", args.dtype, "--batch", str(args.batch), "--seq", str(args.seq),
                 "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device] + (["--model", args.model] if args.model else [])
    title = (f"{args.model or args.arch}, {args.dtype} ({dtype_why}){', on the GPU' if args.device == 'cuda' else ''}, batch {args.batch} x seq {args.seq}; medians of "
             f"{args.steps} steps x {args.rounds} round(s) after {args.warmup} warm-up, a fresh process per run, "
             f"systems interleaved; allocator: {allocator(not args.no_jemalloc)}; memory limit {limit / GiB:.1f} GiB")
    stem = f"peers-{args.arch if not args.model else 'model'}-{args.dtype}" + ("-cuda" if args.device == "cuda" else "")

    def write(partial: str | None) -> None:
        merged = {size: {name: merge(rs) for name, rs in by.items() if rs} for size, by in runs.items()}
        results = {"title": title + (f" [PARTIAL: {partial}]" if partial else ""), "args": vars(args),
                   "systems": systems, "sizes": {size: rows for size, rows in merged.items() if rows}, "runs": runs,
                   "descriptions": {name: system(name)[1] for name in systems}, "partial": partial}
        report(results, args, Path(args.out), stem, limit, quiet=partial is not None)

    previous = signal.signal(signal.SIGTERM, _interrupt)
    done, total = 0, args.rounds * len(sizes) * len(systems)
    try:
        for rnd in range(args.rounds):
            for size in sizes:
                for name in systems:
                    if name in given_up:
                        if not runs[size][name]:
                            runs[size][name].append({"status": "skipped", "reason": given_up[name]})
                        continue
                    print(f"[round {rnd + 1}/{args.rounds}] {size} {name} ...", file=sys.stderr, flush=True)
                    swap = root / f"{name}-{size}-r{rnd}"
                    file_name = re.sub(r"[^\w.-]", "_", name)  # variants' "@" and "=" kept out of file names
                    traced = (["--trace", str(Path(args.trace).resolve() / f"{file_name}-{size}.json")]
                              if args.trace and rnd == 0 and name.startswith("fuyou") else [])
                    r = watch(["--worker", name, "--sizes", size, "--swap-dir", str(swap), *forwarded, *traced], swap,
                              limit, args.timeout, not args.no_jemalloc)
                    print(f"    {r['status']}" + (f": {r['reason']}" if r["status"] != "ok" else
                                                  f", median step {statistics.median(r['step_s']):.2f} s"),
                          file=sys.stderr, flush=True)
                    runs[size][name].append(r)
                    if r["status"] == "unavailable":
                        given_up[name] = r["reason"]
                    elif r["status"] == "out of memory":
                        given_up[name] = f"ran out of memory at {size}"
                    done += 1
                    if done < total:  # what has run so far is on disk: a killed or stopped harness loses nothing
                        write(f"{done} of {total} runs")
    except KeyboardInterrupt:
        print(f"interrupted after {done} of {total} runs: reporting those", file=sys.stderr, flush=True)
        write(f"interrupted after {done} of {total} runs")
        raise SystemExit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(root, ignore_errors=True)
    write(None)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM stops the harness the way Ctrl-C does: the running worker is killed, what ran is reported."""
    raise KeyboardInterrupt(f"signal {signum}")


def _mem_total() -> int:
    return proc_bytes("/proc/meminfo", "MemTotal")


def report(results: dict, args: argparse.Namespace, out: Path, stem: str, limit: int, quiet: bool = False) -> None:
    """Print the Markdown tables (unless ``quiet``); write them, the JSON and the PNG as ``out/stem.*``,
    each through a temporary file and a rename, so an interrupted write leaves the previous report."""
    out.mkdir(parents=True, exist_ok=True)
    text = [f"# {results['title']}", ""]
    for size, rows in results["sizes"].items():
        text += [f"## {size}", "", table(size, rows, args), ""]
    text += ["Systems:", *[f"- `{name}`: {system(name)[1]}" for name in results["systems"]]]
    if not quiet:
        print("\n".join(text))
    for suffix, body in ((".md", "\n".join(text) + "\n"), (".json", json.dumps(results, indent=1))):
        tmp = out / f".{stem}{suffix}.tmp"
        tmp.write_text(body)
        os.replace(tmp, out / f"{stem}{suffix}")
    tmp = out / f".{stem}.tmp.png"
    drawn = plot(results, tmp, limit)
    if drawn:
        os.replace(tmp, out / f"{stem}.png")
    if drawn and plot_sweep(results, tmp):
        os.replace(tmp, out / f"{stem}-sweep.png")
    if not quiet:
        print(f"wrote {out / stem}.md, .json" + (", .png" if drawn else " (no PNG: matplotlib is not installed)"))


if __name__ == "__main__":
    main()
