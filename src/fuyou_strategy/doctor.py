"""``fuyou doctor``: check a machine's swap directories and memory, and recommend a `FuyouConfig`.

Each swap directory is checked as the engine will use it (a run directory made and written, filesystem,
``O_DIRECT``, free space, bandwidth through `storage.probe`); beside them host memory, CPU cores, the
accelerator (with CUDA, the locked-memory limit) and what swap I/O costs the compute beside it
(`storage.probe.measure_io_cpu_cost`; a VM's disk emulation can take a second of compute per GB). Each
recommended value carries its reason, as a YAML comment or in JSON.
"""

from __future__ import annotations

import os
import resource
import shutil
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from . import drives
from .config import FuyouConfig, auto_host_budget, auto_io_threads, auto_prefetch_chunks, format_bytes
from .device import accelerator

__all__ = ["Check", "Diagnosis", "diagnose"]

GiB = 2**30
# Compute seconds lost per GB of swap I/O above which `fuyou doctor` warns: the state on the SSD moves 20-24 bytes
# per parameter per step (fp32), so at this rate a 1B-parameter model loses ~6-7 s of compute per step.
IO_CPU_WARN_S_PER_GB = 0.3


@dataclass
class Check:
    """One finding: ``status`` is ``"ok"``, ``"warn"`` (works, but slower or riskier) or ``"fail"``."""

    subject: str  # a directory, or "host memory", "cpu", ...
    name: str
    status: str
    detail: str


@dataclass
class Diagnosis:
    checks: list[Check] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    bandwidth: dict[str, dict] = field(default_factory=dict)  # directory -> the measured rates
    io_cpu: dict | None = None  # `IOCpuCost.as_dict` of the first usable directory, if measured

    @property
    def ok(self) -> bool:
        return not any(c.status == "fail" for c in self.checks)

    def add(self, subject: str, name: str, status: str, detail: str) -> None:
        self.checks.append(Check(subject, name, status, detail))

    def recommend(self, key: str, value: Any, reason: str) -> None:
        self.config[key] = value
        self.reasons[key] = reason

    def as_dict(self) -> dict:
        return {"ok": self.ok, "checks": [asdict(c) for c in self.checks], "config": self.config,
                "reasons": self.reasons, "bandwidth": self.bandwidth, "io_cpu": self.io_cpu}

    def text(self) -> str:
        """The checks as a table, then the recommended configuration as YAML with a reason per line."""
        width = max([len(c.subject) for c in self.checks] + [10])
        lines = [f"{'':<6}{'subject':<{width}}  {'check':<14} detail"]
        lines += [f"{c.status.upper():<6}{c.subject:<{width}}  {c.name:<14} {c.detail}" for c in self.checks]
        lines += ["", "# recommended FuyouConfig: save as fuyou.yaml, then FuyouStrategy(config='fuyou.yaml'), "
                  "FuyouCallback(config='fuyou.yaml') or FuyouConfig.from_file('fuyou.yaml')"]
        lines += [f"{_yaml_line(k, v)}  # {self.reasons[k]}" for k, v in self.config.items()]
        return "\n".join(lines)


def _yaml_line(key: str, value: Any) -> str:
    import yaml

    return yaml.safe_dump({key: value}, default_flow_style=True, width=10**6).strip().strip("{}")


def diagnose(directories: list[str], *, probe_bytes: int = 256 * 2**20, cpu_probe_seconds: float = 3.0,
             progress: Callable[[str], None] | None = None) -> Diagnosis:
    """Check ``directories`` (measuring ``probe_bytes`` written and read in each) and the machine;
    ``cpu_probe_seconds``: about how long each run of matmuls of the I/O-CPU probe takes (three runs,
    on the first usable directory; ``0`` skips it); ``progress`` is told what is being measured."""
    d = Diagnosis()
    say = progress or (lambda _text: None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    usable = []
    for directory in directories:
        directory = os.path.abspath(os.path.expanduser(directory))
        if _check_directory(d, directory, probe_bytes, say):
            usable.append(directory)
    mem = _meminfo()
    _check_machine(d, cores, mem)
    _check_update(d, say)
    if usable and cpu_probe_seconds > 0:
        _check_io_cpu(d, usable[0], cpu_probe_seconds, auto_io_threads(cores)[0], say)
    _recommend(d, usable, cores, mem.get("MemAvailable", 0))
    return d


def _check_directory(d: Diagnosis, directory: str, probe_bytes: int, say: Callable[[str], None]) -> bool:
    from .storage.aio import StorageIOError
    from .storage.probe import measure_bandwidth

    if not os.path.isdir(directory):
        d.add(directory, "exists", "fail", "not a directory; create it on the SSD, or name another")
        return False
    if not os.access(directory, os.W_OK | os.X_OK):
        d.add(directory, "writable", "fail", "no write permission; chown it, or name another directory")
        return False
    free = shutil.disk_usage(directory).free
    d.add(directory, "free space", "ok" if free >= 4 * probe_bytes else "fail",
          f"{format_bytes(free)} free (the optimizer state takes 24 bytes per trainable parameter)")
    if free < 4 * probe_bytes:
        return False
    say(f"measuring {directory}: writing and reading {format_bytes(probe_bytes)} ...")
    try:
        bw = measure_bandwidth(directory, size=probe_bytes, block_size=2**20, threads=4)
    except (OSError, StorageIOError) as exc:
        d.add(directory, "write/read", "fail", f"{exc}")
        return False
    ram = bw.filesystem in ("tmpfs", "ramfs")
    d.add(directory, "filesystem", "warn" if ram else "ok",
          bw.filesystem + (": RAM, not an SSD (the 'SSD' tier would use host memory)" if ram else ""))
    d.add(directory, "O_DIRECT", "ok" if bw.direct else "warn",
          "accepted" if bw.direct else "refused: buffered I/O with the page cache bounded (slower, uses RAM)")
    d.add(directory, "bandwidth", "ok" if min(bw.write_bps, bw.read_bps) >= 1e9 else "warn",
          f"write {bw.write_bps / 1e9:.2f} GB/s, read {bw.read_bps / 1e9:.2f} GB/s (1 MiB requests, 4 threads; "
          "NVMe drives reach 2-7 GB/s)")
    d.bandwidth[directory] = bw.as_dict()
    drives.remember(drives.cache_key(directory), d.bandwidth[directory])  # optimizer_prefetch_chunks="auto" reads it
    return True


def _check_machine(d: Diagnosis, cores: int, mem: dict[str, int]) -> None:
    d.add("host memory", "RAM", "ok" if mem.get("MemAvailable", 0) >= 8 * GiB else "warn",
          f"{format_bytes(mem.get('MemAvailable', 0))} available of {format_bytes(mem.get('MemTotal', 0))}")
    d.add("cpu", "cores", "ok" if cores >= 4 else "warn",
          f"{cores} usable: the optimizer's AdamW and the I/O threads share them" +
          ("" if cores >= 4 else " (few: the CPU optimizer will bound the step)"))
    try:
        found = accelerator()
    except Exception as exc:  # noqa: BLE001 - a broken CUDA install is a finding, not a crash
        d.add("accelerator", "cuda", "warn", f"the CUDA query failed: {exc}")
        return
    if found is None:  # nothing to pin, nothing to warn of: CPU training is a supported setting
        d.add("accelerator", "none", "ok", "training computes on the CPU; the device tier is host RAM")
        return
    d.add("accelerator", "cuda", "ok", f"{found[0]}, {format_bytes(found[1])}")
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)  # only CUDA pins the host pool's buffers
    unlimited = soft == resource.RLIM_INFINITY
    d.add("limits", "memlock", "ok" if unlimited or soft >= GiB else "warn",
          ("unlimited" if unlimited else format_bytes(soft)) + ": locked memory per process; CUDA pins the host "
          "pool's buffers through the driver, but a container's low `ulimit -l` can refuse pinning "
          "(raise it with --ulimit memlock=-1)")


def _check_update(d: Diagnosis, say: Callable[[str], None]) -> None:
    """Whether the one-pass update builds and matches torch's kernel here (`optim.onepass`): the first check on a
    machine builds it (about half a minute), so that the first run does not."""
    from .optim import onepass

    say("building or loading the one-pass AdamW update ...")
    one, why = onepass.load()
    d.add("cpu", "one-pass update", "ok" if one is not None else "warn",
          why if one is not None else f"{why} (update_kernel='auto' runs torch's kernel: slower, the same bits)")


def _check_io_cpu(d: Diagnosis, directory: str, seconds: float, io_threads: int, say: Callable[[str], None]) -> None:
    from .storage.aio import StorageIOError
    from .storage.probe import measure_io_cpu_cost

    say(f"measuring what swap I/O in {directory} costs the compute beside it (~{3 * seconds:.0f} s of matmuls) ...")
    try:
        cost = measure_io_cpu_cost(directory, seconds=seconds, size=256 * 2**20, io_threads=io_threads)
    except (OSError, StorageIOError, RuntimeError) as exc:
        d.add("cpu", "I/O CPU cost", "warn", f"not measured: {exc}")
        return
    d.io_cpu = cost.as_dict()
    lost = cost.lost_s_per_gb
    drives.remember_io_cpu(drives.cache_key(directory), lost, cost.steal_share)  # a run's own report reads it
    shares = ", ".join(f"{name} {share:.0%}" for name, share in (("steal", cost.steal_share),
                                                                    ("system", cost.system_share)) if share is not None)
    detail = (f"each GB of swap I/O took {max(lost, 0.0):.2f} s of compute from the busy cores "
              f"({cost.bytes_moved / 1e9:.1f} GB moved beside {cost.alone_s:.1f} s of matmuls"
              + (f"; CPU time while it ran: {shares}" if shares else "") + ")")
    if lost >= IO_CPU_WARN_S_PER_GB:
        steal = cost.steal_share is not None and cost.steal_share >= 0.05
        detail += ((": a virtual machine whose hypervisor serves the disk on these CPUs" if steal else "")
                   + f". The optimizer state on the SSD moves 20-24 bytes per parameter per step in fp32 "
                   f"(~{lost * 22:.0f} s of compute per billion parameters per step here): keep what fits in RAM "
                   "(host_state), or take state_format='bf16' (12-16 bytes)")
    d.add("cpu", "I/O CPU cost", "warn" if lost >= IO_CPU_WARN_S_PER_GB else "ok", detail)


def _recommend(d: Diagnosis, usable: list[str], cores: int, available: int) -> None:
    defaults = FuyouConfig()
    if usable:
        d.recommend("swap_dirs", usable, "the directories that passed; list one per drive, chunks are striped")
    else:
        d.recommend("swap_dirs", None, "no directory passed: a temporary folder (name one on an NVMe SSD)")
    direct = all(d.bandwidth[u]["direct"] for u in usable) if usable else True
    d.recommend("direct_io", "auto", "every directory takes O_DIRECT" if direct else
                "some refuse O_DIRECT: 'auto' falls back to buffered I/O there")
    threads, why = auto_io_threads(cores)  # the rule of io_threads="auto"
    d.recommend("io_threads", threads, why)
    budget, why = auto_host_budget(available)  # the rule of host_memory_budget="auto", in whole GiB
    budget = max(budget // GiB * GiB, min(budget, GiB))
    d.recommend("host_memory_budget", format_bytes(budget),
                f"what 'auto' takes now, in whole GiB: {why}; the optimizer's read-ahead, the activations' staging, "
                "and then as much optimizer state as fits")
    costly = d.io_cpu is not None and d.io_cpu["lost_s_per_gb"] >= IO_CPU_WARN_S_PER_GB
    d.recommend("host_state", "auto",
                "the optimizer state the budget leaves room for stays in RAM (exact), the rest on the SSD"
                + (f"; each GB of swap I/O costs {d.io_cpu['lost_s_per_gb']:.2f} s of compute here, so every "
                   "byte of state in RAM saves compute as well as drive time" if costly else ""))
    if usable:
        slowest = drives.slowest(d.bandwidth.values())
        # The rule of optimizer_prefetch_chunks="auto" with these measurements, which it now finds in the cache.
        chunks = auto_prefetch_chunks(len(usable), defaults.chunk_size, slowest)[0]
        d.recommend("optimizer_prefetch_chunks", "auto",
                    f"takes {chunks}: {format_bytes(chunks * defaults.chunk_size)} of state in flight for "
                    f"{slowest / 1e9:.1f} GB/s per drive (measured now and cached for the runs that use these "
                    "directories)")
    d.recommend("activations", "auto", "let the planner profile a warm-up and place each block's activations")
    d.recommend("ssd_endurance_tbw", defaults.ssd_endurance_tbw,
                "a conservative default: set your drive's datasheet TBW for an accurate wear report")


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out
