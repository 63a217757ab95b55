"""One command for a machine with one GPU: prove fuyou's CUDA paths, then measure it against DeepSpeed.

    python -m benchmarks.gpu_check                 # on the GPU box: install, CUDA tests, benchmark, report
    python -m benchmarks.gpu_check --dry-run       # anywhere: announce every step and its command; run nothing
    python -m benchmarks.gpu_check --smoke         # on a CPU: the whole pipeline with a tiny model (its own test)

Steps, each a child process with its share of ``--budget-min`` (default 30 minutes); a step that runs
past its share is stopped and the next one starts, and whatever was measured is kept:

1. **environment**: torch and its CUDA, the GPU, RAM and free disk (``environment.json``);
2. **install** (skipped when the CUDA build of torch and DeepSpeed are already there, or ``--no-install``):
   PyPI's torch wheel, a CUDA build, pinned to the installed torch's version, then DeepSpeed with torch
   held at that version;
3. **tests**: ``FUYOU_TEST_DEVICE=cuda pytest -m device``: the device suites, whose device-dependent tests
   take the `compute_device` fixture: bitwise against ``AdamW(fused=True)``, fp16 with loss scaling against
   ``GradScaler``, streamed weights in a device budget below the model's and LoRA over every weight tier,
   every activation policy (SSD included), two-rank NCCL with two GPUs;
4. **plan** and **bench** per model: ``fuyou plan``'s prediction, then the peer harness on the GPU
   (``benchmarks.peers --device cuda``): torch (where it fits), fuyou (the planner's choice), fuyou with
   every tier on SSD, ZeRO-Offload and ZeRO-Infinity on the same model, batch and sequence length. The
   models: GPT-2 1.5B and the largest Llama-shaped model whose SSD footprint fits the free disk;
5. **report**: ``gpu_check.json`` (everything), ``gpu_check.png`` and a Markdown table on stdout.

Each step's share of the time budget, and what to run when a GPU is lent: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30
SSD_BYTES_PER_PARAM = 20  # the larger footprint of fuyou-ssd (16.4) and ZeRO-Infinity, with room to spare
SYSTEMS = "torch,fuyou-hf,fuyou-ssd,ds-offload,ds-infinity"
MIN_STEP_S = 60.0  # the least a step is given while time is left
SHARES = {"environment": 0.02, "install": 0.2, "tests": 0.2, "plan": 0.02, "bench": 0.56}  # of the budget


@dataclass
class Step:
    """One step: what it is, the command it runs and what became of it."""
    name: str
    what: str
    command: list[str]
    share: float  # of the whole budget
    env: dict[str, str] = field(default_factory=dict)
    status: str = "pending"  # ok, failed (exit N), stopped (time), skipped (why), dry-run
    seconds: float = 0.0
    output_tail: str = ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / f"gpu-check-{time.strftime('%Y%m%d-%H%M')}"))
    p.add_argument("--budget-min", type=float, default=30.0, help="the whole check's wall-clock budget in minutes")
    p.add_argument("--dry-run", action="store_true", help="announce every step and its command; run nothing")
    p.add_argument("--smoke", action="store_true", help="on the CPU, a tiny model and one test: the pipeline's own test")
    p.add_argument("--no-install", action="store_true", help="use what is installed")
    p.add_argument("--swap-dir", default=None, help="a folder on the SSD for every system's swap files")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dtype", default="bf16")
    return p.parse_args(argv)


def _free_disk(path: str) -> int:
    Path(path).mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(path).free


def largest_llama(free_bytes: int) -> str:
    """The largest Llama-shaped size whose SSD footprint (`SSD_BYTES_PER_PARAM`) fits in ``free_bytes``."""
    from benchmarks.peers.systems import SIZES, llama_ffn
    best = "124M"
    for size, (layers, hidden, _heads) in SIZES.items():
        if size == "tiny":
            continue
        params = layers * (4 * hidden * hidden + 3 * hidden * llama_ffn(hidden)) + 2 * 32000 * hidden
        if params * SSD_BYTES_PER_PARAM <= free_bytes:
            best = size
    return best


def plan_steps(args: argparse.Namespace) -> list[Step]:
    py, out = sys.executable, Path(args.out)
    swap = args.swap_dir or str(out / "swap")
    device = "cpu" if args.smoke else "cuda"
    steps = [Step("environment", "torch, CUDA, the GPU, RAM and free disk", [py, "-m", "benchmarks.gpu_check_env",
                                                                             str(out / "environment.json"), swap],
                  SHARES["environment"])]
    if args.smoke or args.no_install:
        steps.append(Step("install", "skipped (--smoke / --no-install)", [], SHARES["install"], status="skipped"))
    else:
        steps.append(Step("install", "the CUDA build of torch (same version) and DeepSpeed, torch held",
                          ["bash", str(ROOT / "benchmarks" / "gpu_check_install.sh")], SHARES["install"],
                          env={"PYTHON": py}))
    tests = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfs", "-m", "device and not late_copies",
             "tests/"]  # conftest.DEVICE_SUITES, with copies as they are
    if args.smoke:
        tests[-1:] = ["tests/test_device.py", "-k", "environment_variable"]
    steps.append(Step("tests", f"the device-dependent tests on {device}", tests, SHARES["tests"],
                      env={"FUYOU_TEST_DEVICE": device}))
    if args.smoke:
        models = [("gpt2", "tiny")]
    else:
        models = [("gpt2", "1.5B"), ("llama", largest_llama(int(0.8 * _free_disk(swap))))]
    systems = "torch,fuyou-hf" if args.smoke else SYSTEMS
    batch, seq, dtype = (2, 32, "fp32") if args.smoke else (args.batch, args.seq, args.dtype)
    per_model = 1 / len(models)
    for arch, size in models:
        tag = f"{arch}-{size}"
        steps.append(Step(f"plan {tag}", f"fuyou plan's prediction for {tag}",
                          [py, "-m", "benchmarks.gpu_check_env", "--plan", arch, size, str(batch), str(seq),
                           str(out / f"plan-{tag}.json")], SHARES["plan"] * per_model))
        steps.append(Step(f"bench {tag}", f"{systems} on {tag}, {dtype}, batch {batch} x {seq}, on {device}",
                          [py, "-m", "benchmarks.peers", "--device", device, "--arch", arch, "--sizes", size,
                           "--systems", systems, "--dtype", dtype, "--batch", str(batch), "--seq", str(seq),
                           "--steps", "3", "--warmup", "5", "--rounds", "1", "--swap-dir", swap,
                           "--out", str(out / f"bench-{tag}")], SHARES["bench"] * per_model))
    return steps


def run_step(step: Step, seconds: float) -> None:
    """Run ``step`` for at most ``seconds`` (its whole process group is stopped after that)."""
    if seconds < 5:
        step.status = "skipped (the time budget is spent)"
        return
    started = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **step.env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(step.command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=seconds)
        step.status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        output = _stop(proc)
        step.status = f"stopped (ran past its {seconds:.0f} s share)"
    except KeyboardInterrupt:  # the whole check is stopped: so is the step, and what it printed is kept
        step.output_tail, step.status = _stop(proc)[-4000:], "stopped (interrupted)"
        step.seconds = time.monotonic() - started
        raise
    step.seconds = time.monotonic() - started
    step.output_tail = output[-4000:]
    print(output[-4000:], flush=True)


def _stop(proc: subprocess.Popen) -> str:
    """Stop a step's process group (SIGTERM, then SIGKILL after 30 s); what it printed."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.communicate(timeout=30)[0] or ""
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()[0] or ""


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the check as Ctrl-C does: the report is still written


def collect(out: Path, steps: list[Step]) -> dict:
    """Everything measured: the steps, the environment, each model's plan and benchmark rows."""
    def load(path: Path) -> dict | None:
        return json.loads(path.read_text()) if path.exists() else None

    models = {}
    for step in steps:
        if step.name.startswith("bench "):
            tag = step.name.split(" ", 1)[1]
            bench = next(iter(sorted((out / f"bench-{tag}").glob("peers-*.json"))), None)  # none: it did not run
            models[tag] = {"plan": load(out / f"plan-{tag}.json"), "bench": load(bench) if bench else None}
    return {"steps": [asdict(s) for s in steps], "environment": load(out / "environment.json"), "models": models}


def markdown(result: dict) -> str:
    lines = ["| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']:.0f} |" for s in result["steps"]]
    for tag, m in result["models"].items():
        lines += ["", f"### {tag}", ""]
        plan = (m["plan"] or {}).get("results", {}).get("fuyou")
        if plan:
            lines.append(f"fuyou plan predicts {plan['step_s']:.2f} s per step, {plan['tflops']:.1f} TFLOPS, "
                         f"GPU peak {plan['device_peak'] / GiB:.1f} GiB, SSD {plan['ssd_peak'] / GiB:.1f} GiB.")
        bench = m["bench"]
        if bench:
            from benchmarks.peers.run import table
            for size, rows in bench["sizes"].items():
                lines += ["", table(size, rows, argparse.Namespace(**bench["args"]))]
    return "\n".join(lines)


def draw(result: dict, path: Path) -> bool:
    """Step time and GPU peak memory per system, one group per model."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [(tag, name, r) for tag, m in result["models"].items() if m["bench"]
            for rs in m["bench"]["sizes"].values() for name, r in rs.items() if r["status"] == "ok"]
    if not rows:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{tag}\n{name}" for tag, name, _ in rows]
    axes[0].barh(labels, [r["median_s"] for *_, r in rows])
    axes[0].set_xlabel("step time, s (median)")
    axes[1].barh(labels, [(r.get("device_peak") or 0) / GiB for *_, r in rows])
    axes[1].set_xlabel("GPU peak allocated, GiB")
    axes[1].set_yticklabels([])
    fig.suptitle("gpu_check: fuyou against DeepSpeed on one GPU", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = plan_steps(args)
    budget = args.budget_min * 60
    deadline = time.monotonic() + budget
    mode = "dry run: nothing runs" if args.dry_run else f"budget {args.budget_min:.0f} min"
    print(f"gpu_check ({mode}); results in {out}", flush=True)

    def finish(note: str | None = None) -> int:
        result = collect(out, steps)
        result["note"] = note
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
        drawn = draw(result, out / "gpu_check.png")
        print(markdown(result) + ("\n\nplot: " + str(out / "gpu_check.png") if drawn else ""), flush=True)
        return 0 if all(s.status in ("ok", "dry-run") or s.status.startswith("skipped") for s in steps) else 1

    previous = signal.signal(signal.SIGTERM, _interrupted)
    try:
        for i, step in enumerate(steps):
            if step.status == "skipped":
                print(f"[{i + 1}/{len(steps)}] {step.name}: {step.what}", flush=True)
                continue
            left = deadline - time.monotonic()
            own = max(MIN_STEP_S, step.share * budget)  # a small share still gets a minute (imports alone take seconds)
            reserved = sum(max(MIN_STEP_S, s.share * budget) for s in steps[i:] if s.status != "skipped")
            share = min(left, own + max(0.0, left - reserved))
            env = " ".join(f"{k}={v}" for k, v in step.env.items())
            limit = own if args.dry_run else share  # a dry run spends no time: each its own share
            print(f"[{i + 1}/{len(steps)}] {step.name}: {step.what} (up to {limit / 60:.1f} min)\n    "
                  f"{env + ' ' if env else ''}{' '.join(step.command)}", flush=True)
            if args.dry_run:
                step.status = "dry-run"
                continue
            run_step(step, share)
            print(f"    -> {step.status} in {step.seconds:.0f} s", flush=True)
    except KeyboardInterrupt:
        return finish("interrupted: what ran is kept")
    finally:
        signal.signal(signal.SIGTERM, previous)
    return finish()


if __name__ == "__main__":
    raise SystemExit(main())
