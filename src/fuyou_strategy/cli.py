"""The ``fuyou`` command: ``fuyou io-bench``, ``fuyou clean``, ``fuyou plan``, ``fuyou doctor`` and ``fuyou report``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Sequence

from .config import PAGE, STATE_FORMATS, ConfigError, format_bytes, parse_bytes

__all__ = ["main"]


def _size(text: str) -> int:
    try:
        return parse_bytes(text, name="--size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _block_sizes(text: str) -> list[int]:
    try:
        sizes = [parse_bytes(part, name="--block-sizes") for part in text.split(",")]
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    for size in sizes:
        if size < PAGE or size % PAGE:
            raise argparse.ArgumentTypeError(f"got {size} bytes; each block size must be a positive multiple of 4 KiB (O_DIRECT)")
    return sizes


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _cmd_io_bench(args: argparse.Namespace) -> int:
    from .storage.probe import measure_bandwidth

    dirs = args.dir or [None]
    rows = []
    header = f"{'directory':<32} {'fs':<6} {'direct':<6} {'block':>9} {'threads':>7} {'write MB/s':>11} {'read MB/s':>10}"
    print(header)
    print("-" * len(header))
    for d in dirs:
        with tempfile.TemporaryDirectory(prefix="fuyou-iobench-") as tmp:
            where = d if d is not None else tmp
            for block in args.block_sizes:
                for threads in args.threads:
                    bw = measure_bandwidth(where, size=args.size, block_size=block, threads=threads, direct_io=args.direct_io)
                    rows.append(bw.as_dict())
                    print(
                        f"{where[-32:]:<32} {bw.filesystem:<6} {str(bw.direct):<6} {format_bytes(block):>9} "
                        f"{threads:>7} {bw.write_bps / 1e6:>11.0f} {bw.read_bps / 1e6:>10.0f}",
                        flush=True,
                    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _cmd_clean(args: argparse.Namespace) -> int:
    import shutil

    from .integrations.hf_checkpoints import find_leftovers
    from .optim.checkpoint import find_stale_temps
    from .storage.durable import find_stale_temp_files
    from .storage.rundir import find_stale_runs, remove_run_dir

    dirs = args.dir or [tempfile.gettempdir()]
    if args.dir is None:  # default swap dirs are fuyou-swap-* folders in the temp dir
        import glob

        dirs += glob.glob(f"{tempfile.gettempdir()}/fuyou-swap-*")
    stale = [(run, remove_run_dir) for run in find_stale_runs(dirs)]
    stale += [(temp, shutil.rmtree) for temp in find_stale_temps(dirs)]  # from checkpoint saves cut short
    stale += [(temp, os.remove) for temp in find_stale_temp_files(dirs)]  # a .ckpt written beside its old one
    for folder in dirs:  # a Trainer's output_dir: incomplete checkpoint-N folders of a run that is gone
        leftovers = find_leftovers(folder)
        inside = tuple(os.path.join(left.path, "") for left in leftovers)
        stale = [(s, r) for s, r in stale if not s.path.startswith(inside)] + [(left, shutil.rmtree) for left in leftovers]
    if not stale:
        print(f"no stale fuyou run directories or checkpoint temp folders in {', '.join(dirs)}")
        return 0
    for run, remove in stale:
        action = "would remove" if args.dry_run else "removing"
        print(f"{action} {run.path} ({format_bytes(run.nbytes)}; {run.reason})")
        if not args.dry_run:
            remove(run.path)
    return 0


def _gb(nbytes: int) -> str:
    """``768 GB (715.26 GiB)``: a size in the decimal unit it is sold in, and in the binary one tables use."""
    return f"{nbytes / 1e9:,.4g} GB ({format_bytes(nbytes)})"


def _drives(count: int) -> str:
    return f"{count} drive{'s' if count != 1 else ''}"


def _cmd_plan(args: argparse.Namespace) -> int:
    import dataclasses
    import os

    from .optim.formats import bytes_per_param
    from .planner import (HARDWARE_PRESETS, MODEL_PRESETS, ModelSpec, PlanError, analytic_profile, one_slot, solve,
                          torch_step, with_one_slot, worth_one_slot)

    if args.model in MODEL_PRESETS:
        model = MODEL_PRESETS[args.model]
    elif os.path.isfile(args.model):
        model = ModelSpec.from_hf_config(args.model)
    else:
        raise ConfigError(f"model: got {args.model!r}; expected a preset ({', '.join(MODEL_PRESETS)}) or a config.json path")
    hw = dataclasses.replace(
        HARDWARE_PRESETS[args.gpu], host_memory=args.host_memory, ssds=args.ssds,
        **{k: v for k, v in (("ssd_read_gbps", args.ssd_read_gbps), ("ssd_write_gbps", args.ssd_write_gbps),
                             ("adam_params_per_s", args.adam_params_per_s), ("efficiency", args.efficiency)) if v is not None})
    if args.gpus < 1:
        raise ConfigError(f"--gpus: got {args.gpus}; expected the number of GPUs (>= 1)")
    profile = analytic_profile(model, hw, batch=args.batch, seq=args.seq, micro_batches=args.micro_batches,
                               prefetch_blocks=args.prefetch_blocks, gpus=args.gpus)
    if args.paper_runtime:  # the paper's schedule: no tail read-ahead, every state write inside the step
        profile = dataclasses.replace(profile, tail_read_ahead=False, writes_behind=False)
    flops, flops_paper = profile.notes["flops_per_step"], profile.notes["flops_per_step_paper"]
    print(f"model {model.name}: {model.params / 1e9:.1f}B parameters, {model.layers} blocks; batch {args.batch} x seq "
          f"{args.seq} x {args.micro_batches} micro-batch(es)" + (
              f" on each of {args.gpus} GPUs (data parallel: gradients all-reduced over each GPU's link, ring; the "
              "CPU and SSDs shared, updating the whole model once)" if args.gpus > 1 else ""))
    print(f"hardware: {hw.name} ({format_bytes(hw.device_memory) if hw.device_memory else 'no accelerator'}, "
          f"{hw.tflops:g} TFLOPS peak x {hw.efficiency:g}), host {_gb(hw.host_memory)}, {_drives(hw.ssds)} of "
          f"{hw.ssd_capacity / 1e12:g} TB, {hw.ssds * hw.ssd_read_gbps:g}/{hw.ssds * hw.ssd_write_gbps:g} GB/s "
          f"read/write in all, CPU AdamW {hw.adam_params_per_s / 1e9:g}G params/s" + (
              f", device AdamW {hw.device_adam_params_per_s / 1e9:.0f}G" if hw.device_adam_params_per_s else "")
          + f"; weights: {profile.notes['weights']}")
    print("bytes: GB and TB are powers of 10 (as drives and RAM are sold), GiB powers of 2")
    print(f"TFLOPS count model FLOPs, {flops / 1e15:.3g} PFLOP/step (forward + backward, 6*P*tokens + attention; "
          f"recomputation not counted),\n  and [in brackets] Fuyou's paper's count, {flops_paper / 1e15:.3g} PFLOP/step "
          "(every block's forward twice, as with full recomputation; Megatron-LM's formula)")
    host_state = None if args.host_state == "auto" else parse_bytes(args.host_state, name="--host-state")
    device_state = None if args.device_state == "auto" else parse_bytes(args.device_state, name="--device-state")
    # The device tier is this library's: not the paper's design, not modelled per rank with several GPUs.
    why_no_device = "--paper-runtime" if args.paper_runtime else "--gpus > 1" if args.gpus > 1 else None
    state_bytes = bytes_per_param(args.state_format)
    print(f"optimizer state: state_format={args.state_format!r}, {state_bytes:.2f} bytes per parameter and slot, "
          f"{args.state_slots} slot{'s' if args.state_slots > 1 else ''} (ZeRO-Infinity keeps fp32)")
    # The profile fuyou's plan is solved on: the host and device tiers, the state format, the slots.
    ours = dataclasses.replace(profile, host_state=host_state, device_state=0 if why_no_device else device_state,
                               state_bytes=state_bytes)
    ours = with_one_slot(ours) if args.state_slots == 1 else ours
    overlap = "the next forward, one slot of state" if args.state_slots == 1 else "backward"
    heading = f" (optimizer overlapped with {overlap}; keep / host / ssd / recompute)"
    results, two = {}, None
    for name, kwargs in (("fuyou", {}),
                         ("zero-infinity-like", {"allowed": ("keep", "host", "recompute"), "overlap_optimizer": False})):
        print(f"\n== {name}" + (" (optimizer after backward; activations kept, recomputed or on host, never SSD)"
                                 if kwargs else heading))
        try:  # the host tier, compact state formats and one slot are fuyou's; ZeRO-Infinity keeps fp32 on NVMe
            plan = solve(dataclasses.replace(profile, host_state=0, device_state=0, state_bytes=bytes_per_param("fp32"))
                         if kwargs else ours, **kwargs)
        except PlanError as exc:
            print(f"does not fit: {str(exc).removeprefix('does not fit: ')}")
            results[name] = {"fits": False, "error": str(exc)}
            continue
        print(plan.table(compact=not args.full_table) if args.verbose or args.full_table else "\n".join(plan.totals()))
        if name == "fuyou" and not plan.state_on_device:  # else a line of the totals says how much
            print("optimizer state on the device: none (" + (why_no_device or (
                "no room beside the plan's device peak" if device_state is None
                else f"--device-state {args.device_state}")) + ")")
        tflops, tflops_paper = (f / plan.predicted_step_s / 1e12 for f in (flops, flops_paper))
        drives = -(-plan.ssd_peak // hw.ssd_capacity)  # the fewest drives whose capacity holds the swap files
        space = (f"within the {_drives(hw.ssds)}" + (f" ({_drives(drives)} would hold it)" if 0 < drives < hw.ssds else "")
                 if drives <= hw.ssds else f"more than the {_drives(hw.ssds)} hold: it needs {_drives(drives)}")
        print(f"{tflops:.1f} TFLOPS [{tflops_paper:.1f}] "
              f"({args.batch * args.seq * args.micro_batches * args.gpus / plan.predicted_step_s:,.0f} tokens/s); "
              f"SSD space {_gb(plan.ssd_peak)}, {space}")
        results[name] = {"fits": True, "step_s": plan.predicted_step_s, "tflops": tflops, "tflops_paper": tflops_paper,
                         "device_peak": plan.device_peak, "host_peak": plan.host_peak, "ssd_peak": plan.ssd_peak,
                         "policies": plan.policies, "state_in_ram": plan.state_in_ram,
                         "state_on_device": plan.state_on_device, "ssd_drives_needed": drives}
        if name == "fuyou":  # the optimizer schedule and state slots its prediction modelled
            results[name].update(schedule=plan.profile["schedule"], state_slots=plan.profile["state_slots"])
            two = plan
        if name == "fuyou" and args.save:
            plan.save(args.save)
            print(f"plan written to {args.save}")
    if args.state_slots == 2 and not args.paper_runtime:  # one slot, where faster, or fitting where two do not
        mine, one_plan = results["fuyou"], one_slot(ours)
        # Where two slots' swap files need more drives than the machine has and one slot's do not, one slot is what
        # runs there, faster or not.
        held = one_plan is not None and two is not None and mine["ssd_drives_needed"] > hw.ssds \
            >= -(-one_plan.ssd_peak // hw.ssd_capacity)
        if one_plan is not None and (held or worth_one_slot(two, one_plan)):
            one = mine["one_slot_step_s"] = one_plan.predicted_step_s
            why = "where two slots do not fit" if two is None else (
                f"its swap files within the {_drives(hw.ssds)}, where two slots' need {_drives(mine['ssd_drives_needed'])}"
                if held else "")
            faster = (f"{mine['step_s'] / one:.2f}x faster" if one < mine["step_s"] else
                      f"{one / mine['step_s']:.2f}x slower") if two is not None else ""
            print(f"\none slot of state (--state-slots 1; FuyouConfig(state_slots=1), half the state, updates before "
                  f"each block's next forward): predicted step {one:.3f} s" + "".join(f", {x}" for x in (faster, why) if x))
    if all(r["fits"] for r in results.values()):
        print(f"\nfuyou vs zero-infinity-like: {results['zero-infinity-like']['step_s'] / results['fuyou']['step_s']:.2f}x "
              "faster (predicted)")
    if hw.device_memory and args.gpus == 1:  # torch: the model alone on the device
        torch_s, torch_bytes = torch_step(profile)
        results["torch"] = {"fits": torch_bytes <= hw.device_memory, "step_s": torch_s, "device_bytes": torch_bytes}
        need = f"{_gb(torch_bytes)} of the device's {hw.device_memory / 1e9:g} GB"
        if torch_bytes > hw.device_memory:
            print(f"torch, the model alone on the device: does not fit (needs {need}: 16 B per parameter and the "
                  "activations)")
        else:
            print(f"torch, the model alone on the device (fused AdamW there): {torch_s:.3f} s/step, {need}" + (
                f"; fuyou's predicted step {results['fuyou']['step_s'] / torch_s:.2f}x torch's"
                if results["fuyou"]["fits"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": dataclasses.asdict(model), "hardware": dataclasses.asdict(hw), "batch": args.batch,
                       "seq": args.seq, "state_format": args.state_format, "state_slots": args.state_slots,
                       "results": results}, f, indent=1)
    return 0 if results["fuyou"]["fits"] else 1


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import diagnose

    dirs = args.dir or [tempfile.gettempdir()]
    quiet = args.json or not sys.stderr.isatty()
    diagnosis = diagnose(dirs, probe_bytes=args.size, cpu_probe_seconds=args.cpu_probe_seconds,
                         progress=None if quiet else lambda text: print(text, file=sys.stderr, flush=True))
    print(json.dumps(diagnosis.as_dict(), indent=1) if args.json else diagnosis.text())
    return 0 if diagnosis.ok else 1


def _cmd_report(args: argparse.Namespace) -> int:
    from .report import draw, load_trace

    report = load_trace(args.trace)
    meta = report.metadata
    print(f"{args.trace}: {len(report.steps)} step(s)" + (f"; plan {meta['plan']}" if meta.get("plan") else ""))
    print(report.table())
    if args.png is not None:
        png = args.png or os.path.splitext(args.trace)[0] + ".png"
        draw(report, png, title=f"{os.path.basename(args.trace)}: measured steps and the planner's prediction")
        print(f"wrote {png}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fuyou", description="fuyou-strategy tools")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("io-bench", help="sequential read/write bandwidth of swap directories")
    bench.add_argument("--dir", action="append", help="directory to measure (repeatable; default: a temporary one)")
    bench.add_argument("--size", type=_size, default=parse_bytes("1GiB"),
                       help="bytes written and read per measurement (default 1GiB)")
    bench.add_argument("--block-sizes", type=_block_sizes, default=_block_sizes("1MiB,4MiB"), help="comma list (default 1MiB,4MiB)")
    bench.add_argument("--threads", type=_ints, default=[1, 4], help="comma list of threads per dir (default 1,4)")
    bench.add_argument("--direct-io", choices=["auto", "on", "off"], default="auto")
    bench.add_argument("--json", help="also write the rows to this JSON file")
    bench.set_defaults(func=_cmd_io_bench)

    plan = sub.add_parser("plan", help="what-if: memory per tier and predicted step time for a model on described hardware",
                          description="Plan a fine-tune without instantiating the model: memory per tier, whether it fits, "
                          "predicted step time and TFLOPS, for Fuyou and for a ZeRO-Infinity-like schedule. Preset "
                          "sources are documented in fuyou_strategy/planner/spec.py.")
    plan.add_argument("model", help="a preset (gpt3-13b, gpt3-175b, llama-70b, llama-7b, gpt2-350m, gpt2-1.5b) or a "
                                    "Hugging Face config.json")
    plan.add_argument("--gpu", default="rtx4090", choices=["rtx4090", "a100-80g", "h100", "h200", "cpu"])
    plan.add_argument("--host-memory", type=_size, default=parse_bytes("768GB"), help="host RAM (default 768GB)")
    plan.add_argument("--ssds", type=int, default=1, help="number of NVMe drives, striped (default 1)")
    plan.add_argument("--ssd-read-gbps", type=float, help="per drive, GB/s (default 6.5: Intel D7-P5510)")
    plan.add_argument("--ssd-write-gbps", type=float, help="per drive, GB/s (default 3.4: Intel D7-P5510)")
    plan.add_argument("--adam-params-per-s", type=float, help="the host CPU's AdamW throughput, parameters/s (default: the preset's, 1e9; h200 0.5e9)")
    plan.add_argument("--efficiency", type=float,
                      help="fraction of peak FLOPS reached (default: rtx4090 0.96, measured matmuls; others 0.5)")
    plan.add_argument("--batch", type=int, default=8, help="sequences per micro-batch (default 8)")
    plan.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    plan.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps (default 1)")
    plan.add_argument("--prefetch-blocks", type=int, default=2)
    plan.add_argument("--host-state", default="0",
                      help="optimizer state held in host RAM: bytes, or 'auto' (what the host memory leaves beside the "
                           "plan's activations and weights); default 0: all of it on the SSDs, the paper's design")
    plan.add_argument("--device-state", default="auto",
                      help="optimizer state held in the device's memory and updated there by torch's fused AdamW "
                           "(the first parameters in the optimizer's order): bytes, or 'auto' (default: what the device "
                           "memory leaves beside the plan's weights and activations); 0: none")
    plan.add_argument("--state-format", default="fp32", choices=list(STATE_FORMATS),
                      help="optimizer state format (FuyouConfig.state_format; default fp32, exact)")
    plan.add_argument("--state-slots", type=int, default=2, choices=(1, 2),
                      help="copies of the optimizer state (FuyouConfig.state_slots): 2 (default), updates overlapped "
                           "with backward with a rollback slot; 1, half the state, each update landing before its "
                           "block's next forward (optimizer_schedule='next_forward')")
    plan.add_argument("--gpus", type=int, default=1, help="GPUs on the machine, data parallel (default 1)")
    plan.add_argument("--paper-runtime", action="store_true",
                      help="model Fuyou's paper rather than this library's runtime: each update reads its state when "
                           "its gradients arrive and writes it before the step ends (no tail read-ahead, no writes "
                           "behind step()); reproduces the paper's figures")
    plan.add_argument("-v", "--verbose", action="store_true",
                      help="show the per-block table: each block's policy and weight tier, and what each alternative "
                           "would cost (consecutive alike blocks on one row)")
    plan.add_argument("--full-table", action="store_true", help="the per-block table with one row per block")
    plan.add_argument("--save", help="write the Fuyou plan as JSON (for FuyouConfig(plan=...))")
    plan.add_argument("--json", help="write the results as JSON")
    plan.set_defaults(func=_cmd_plan)

    clean = sub.add_parser("clean", help="remove run directories, checkpoint temp folders and incomplete HF Trainer "
                           "checkpoints left behind by crashed fuyou processes")
    clean.add_argument("--dir", action="append", help="swap, checkpoint or HF Trainer output directory to scan, "
                       "checkpoint temp folders at any depth (repeatable; default: the temp dir)")
    clean.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    clean.set_defaults(func=_cmd_clean)

    doctor = sub.add_parser("doctor", help="check swap directories, memory and limits; print a recommended FuyouConfig",
                            description="Check each swap directory (writable, filesystem, O_DIRECT, free space, "
                            "measured bandwidth) and the machine (memory, cores, locked-memory limit, accelerator), "
                            "then print a recommended FuyouConfig as YAML with the reason for each value. Exit "
                            "status 1 if a directory cannot be used.")
    doctor.add_argument("--dir", action="append", help="swap directory to check (repeatable, one per drive; "
                        "default: the temp dir)")
    doctor.add_argument("--size", type=_size, default=parse_bytes("256MiB"),
                        help="bytes written and read per directory (default 256MiB)")
    doctor.add_argument("--cpu-probe-seconds", type=float, default=3.0,
                        help="about how long each of the three runs of matmuls takes that measure what swap I/O costs "
                             "the compute beside it (default 3; 0 skips that check)")
    doctor.add_argument("--json", action="store_true", help="print the checks and the configuration as JSON")
    doctor.set_defaults(func=_cmd_doctor)

    report = sub.add_parser("report", help="where a traced step's time went (FuyouConfig(trace=...)), against the plan",
                            description="Summarise a trace written with FuyouConfig(trace=PATH): per step, how busy "
                            "each lane was (compute, waits, optimizer, SSD reads and writes), and the planner's "
                            "predicted step beside it; --png draws the lanes.")
    report.add_argument("trace", help="the trace JSON")
    report.add_argument("--png", nargs="?", const="", default=None,
                        help="draw the timeline (default path: the trace's, with .png)")
    report.set_defaults(func=_cmd_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, OSError) as exc:
        print(f"fuyou {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
