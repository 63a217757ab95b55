"""`FuyouConfig`: every knob of the system, a validated value; `resolve`: that value and the machine.

Each field has one home here. ``__post_init__`` checks each field where it is written, with an
error that names the field, the value and the fix, and reads nothing of the machine: ``"auto"``
stays ``"auto"``. `resolve` turns a config, once, at the start of a run (`FuyouEngine`), into the
`Settings` the run uses: every machine-dependent ``"auto"`` replaced by its number with the reason
(`Machine`: available RAM, cores, ranks on the machine, measured drives), the unset placement decided
for the device, the plan file read. Byte sizes accept ints or strings such as ``"8GiB"``, ``"512MiB"``,
``"1.5GB"``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from . import drives
from .planfile import POLICIES, WEIGHT_TIERS, PlanError, did_you_mean, streamed_tiers
from .planfile import read as read_plan

__all__ = ["ConfigError", "FuyouConfig", "Machine", "Settings", "resolve", "settled", "is_resolved",
           "placement_defaults",
           "auto_host_budget", "available_memory", "parse_bytes", "format_bytes", "read_mapping",
           "STATE_BYTES_PER_PARAM"]

log = logging.getLogger("fuyou_strategy")

PAGE = 4096
STATE_BYTES_PER_PARAM = 12  # the optimizer's state on SSD, per parameter and slot: fp32 master, exp_avg, exp_avg_sq
SCHEDULES = ("auto", "backward", "next_forward")  # FuyouConfig.optimizer_schedule
GRADIENT_REDUCTIONS = ("owner", "all")  # FuyouConfig.gradient_reduction
STATE_FORMATS = ("fp32", "bf16", "8bit")  # FuyouConfig.state_format (optim.formats)
UPDATE_KERNELS = ("auto", "one_pass", "torch")  # FuyouConfig.update_kernel (optim.onepass)
STATE_CHUNK_ELEMENTS = 2048  # state chunks hold whole multiples of this many parameters: 2048 bf16 values fill a page

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and the fix."""


class PlanFileError(ConfigError, PlanError):
    """The plan file that ``plan`` names cannot be used: a bad value of the field and a bad plan at once."""


# host_memory_budget="auto": this share of the RAM available at start, leaving at least AUTO_BUDGET_KEEP to
# the process itself (the model, its gradients and activations on a CPU device), the data loader and the
# rest of the machine; never less than AUTO_BUDGET_MIN (the transfers' buffers). Below AUTO_BUDGET_LOW
# the optimizer state stays on the SSD (host_state="auto" takes nothing) and a warning says so.
AUTO_BUDGET_SHARE = 0.5
AUTO_BUDGET_KEEP = 4 * 1024**3
AUTO_BUDGET_MIN = 512 * 1024**2
AUTO_BUDGET_LOW = 2 * 1024**3


def available_memory() -> int:
    """Bytes of RAM available to new allocations without swapping (``MemAvailable`` of ``/proc/meminfo``;
    0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                if key == "MemAvailable":
                    return int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _local_ranks() -> int:
    """Processes of this training on this machine (``$LOCAL_WORLD_SIZE``, as torchrun sets it; else 1)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def auto_host_budget(available: int, ranks: int = 1) -> tuple[int, str]:
    """What ``host_memory_budget="auto"`` takes of ``available`` bytes of RAM, shared by ``ranks`` processes
    of this machine (``$LOCAL_WORLD_SIZE``), and why (one sentence)."""
    share = min(int(available * AUTO_BUDGET_SHARE), available - AUTO_BUDGET_KEEP) // max(1, ranks) // PAGE * PAGE
    each = f", shared by the {ranks} ranks of this machine" if ranks > 1 else ""
    if share >= AUTO_BUDGET_MIN:
        return share, (f"{AUTO_BUDGET_SHARE:.0%} of the {format_bytes(available)} of RAM available at start{each}, "
                       f"leaving at least {format_bytes(AUTO_BUDGET_KEEP)} to the model, the data loader and the machine")
    return AUTO_BUDGET_MIN, (f"only {format_bytes(available)} of RAM is available{each}: the minimum for the "
                             f"transfers, {format_bytes(AUTO_BUDGET_MIN)}")


AUTO_IO_THREADS_MAX = 4  # io_threads="auto": one per core, at most this many per swap directory


def auto_io_threads(cores: int) -> tuple[int, str]:
    """What ``io_threads="auto"`` takes on a machine with ``cores`` cores, and why (one sentence); `fuyou doctor`
    recommends the same."""
    threads = max(1, min(AUTO_IO_THREADS_MAX, cores))
    return threads, (f"per swap directory: one per core ({cores} here), at most {AUTO_IO_THREADS_MAX}; the reads "
                     "and writes release the GIL while the drive works")


def auto_optimizer_threads(on_host: bool, cores: int, training_threads: int) -> tuple[int | None, str]:
    """What ``optimizer_threads="auto"`` gives the optimizer's worker, and why (one sentence). ``on_host``: the
    model computes on the CPU; ``cores``: the process's usable cores; ``training_threads``: the training
    thread's intra-op threads. ``None``: torch's own count, untouched."""
    if not on_host:
        return None, ("the model computes on an accelerator, so the host's cores are the worker's: torch's "
                      "intra-op threads")
    threads = max(1, cores - training_threads)
    return threads, (f"the model computes on the CPU with {training_threads} intra-op threads on {cores} cores; a "
                     "second OpenMP team beyond the cores would make every team sleep at each barrier instead of "
                     "spinning, so the worker takes the cores left, at least one")


AUTO_PREFETCH_MAX = 8  # optimizer_prefetch_chunks="auto": at most this many chunks read ahead
AUTO_PREFETCH_COVER_S = 0.02  # ... measured drives: enough to keep ~20 ms of the slowest one's traffic in flight


def auto_prefetch_chunks(drives: int, chunk_size: int = 16 * 2**20, slowest_bps: float | None = None, *,
                         temporary: bool = False) -> tuple[int, str]:
    """What ``optimizer_prefetch_chunks="auto"`` takes with ``drives`` swap directories, and why (one sentence).

    With the directories' bandwidth measured (``slowest_bps``: the slowest read or write rate of any, from
    the cache the planner's probe and `fuyou doctor` fill, `drives.measured`): two chunks beyond the double
    buffer plus as many ``chunk_size`` chunks as ~20 ms of every drive at that rate moves
    (`AUTO_PREFETCH_COVER_S`), at least 2: a fast drive gets a deeper read-ahead than a slow one. Without
    a measurement, by their number: two chunks per drive beyond the double buffer keep a request queued on
    every drive while the optimizer computes. At most `AUTO_PREFETCH_MAX` either way; the host budget may
    lower it (`host_budget_split`). One unmeasured drive takes 4. ``temporary``: the
    swap directory is a temporary folder (``swap_dirs=None``), new every run and so never measured."""
    drives = max(1, drives)
    if slowest_bps is not None:
        chunks = max(2, min(AUTO_PREFETCH_MAX, int(slowest_bps * AUTO_PREFETCH_COVER_S * drives / chunk_size) + 2))
        return chunks, (f"~{AUTO_PREFETCH_COVER_S * 1e3:.0f} ms of {drives} drive(s) at the slowest measured rate "
                        f"({slowest_bps / 1e9:.2f} GB/s, cached by the planner's probe or fuyou doctor) in "
                        f"{format_bytes(chunk_size)} chunks, plus a double buffer, at most {AUTO_PREFETCH_MAX}; "
                        "the host budget may lower it")
    chunks = min(AUTO_PREFETCH_MAX, 2 + 2 * drives)
    unmeasured = ("a temporary swap folder is new every run, so never measured: name swap_dirs to have the drives "
                  "timed" if temporary else "the drives are not measured yet: the planner's probe or fuyou doctor "
                  "times them for the next run")
    return chunks, (f"two chunks in flight per swap directory ({drives} here) beyond a double buffer, at most "
                    f"{AUTO_PREFETCH_MAX} ({unmeasured}); the host budget may lower it")


def slowest_measured(directories: Iterable[str] | None) -> float | None:
    """The slowest read or write rate remembered for any of ``directories`` (`drives.measured`); ``None``
    when one has none, or with no directories (a temporary folder is new every run)."""
    rates = drives.measured(directories) if directories else None
    return drives.slowest(rates) if rates else None


def parse_bytes(value: int | float | str, *, name: str = "value") -> int:
    """Turn ``4096``, ``"4KiB"``, ``"1.5GB"`` into a whole number of bytes.

    Raises `ConfigError` naming ``name`` when the value is not a non-negative size.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}: got {value!r}; expected a byte size such as 1073741824 or '1GiB'")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{name}: got {value!r}; expected a byte size such as '512MiB', '8GiB' or '1.5GB' "
                f"(units: {', '.join(u for u in _UNITS if u)})"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise ConfigError(f"{name}: got {value!r} of type {type(value).__name__}; expected int or str like '8GiB'")
    nbytes = number * _UNITS[unit]
    if nbytes < 0 or nbytes != nbytes:
        raise ConfigError(f"{name}: got {value!r}; a byte size must be >= 0")
    return int(nbytes)


def format_bytes(nbytes: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _per_block(name: str, value: Any, choices: tuple[str, ...], *, auto: bool) -> str | dict[int, str]:
    """Validate a per-block field: one choice for every block, or ``{block index: choice}``."""
    expected = ("'auto', " if auto else "") + f"one of {list(choices)} or a mapping from block index to one of them"
    if isinstance(value, Mapping):
        for k, v in value.items():
            if v not in choices:
                raise ConfigError(f"{name}[{k!r}]: got {v!r}; expected one of {list(choices)}")
            try:
                int(k)
            except (TypeError, ValueError):
                raise ConfigError(f"{name}: got the key {k!r}; keys are block indices (0, 1, ...)") from None
        return {int(k): v for k, v in value.items()}
    if not isinstance(value, str) or value not in choices and not (auto and value == "auto"):
        raise ConfigError(f"{name}: got {value!r}; expected {expected}")
    return value


@dataclass(frozen=True)
class FuyouConfig:
    """Every knob of fuyou-strategy: a validated value. Constructing, copying (`replace`) or merging (`merge`)
    one checks each field and reads nothing of the machine; ``"auto"`` stays ``"auto"`` until `resolve` (at the
    engine's start). Sizes are bytes (an int, or a string such as ``"8GiB"``); times are seconds. The reference,
    with each default's reason: ``docs/configuration.md``.

    Attributes:
        swap_dirs: SSD-tier directories, one per drive, striped; ``None``: a temporary one, removed on close.
            ``{rank}``/``{local_rank}`` in a path give each rank its own.
        host_memory_budget: hard cap on every host buffer fuyou holds (one pool, divided by
            `storage.host_budget_split`). ``"auto"``: half the RAM available at start, at least 4 GiB left to the
            rest, at least 512 MiB, shared by the machine's ranks (`auto_host_budget`).
        device_memory_budget: device bytes the planner may plan for; ``None``: the accelerator's memory, no limit
            on the CPU.
        io_threads: I/O threads per swap directory; ``"auto"``: one per core, at most 4 (`auto_io_threads`).
        io_block_size: largest single read/write request (a multiple of 4 KiB). Default 1 MiB.
        chunk_size: unit of striping and of chunked transfers (a multiple of 4 KiB). Default 16 MiB.
        direct_io: ``"auto"`` (``O_DIRECT`` where accepted, buffered otherwise, said once), ``"on"``, ``"off"``.
        preallocate: reserve swap space with ``posix_fallocate`` when entries are created (a full disk shows up
            front).
        optimizer_prefetch_chunks: state chunks read ahead of the one updated (the budget may lower it);
            ``"auto"``: from the drives' cached speed, else two per directory beyond a double buffer, 2 to 8
            (`auto_prefetch_chunks`).
        optimizer_threads: intra-op threads of the optimizer's worker; ``"auto"``: the cores the training thread
            leaves when the model computes on the CPU (two OpenMP teams on the same cores sleep at every barrier),
            torch's own count with an accelerator (`auto_optimizer_threads`; resolved by the optimizer).
        io_timeout: the longest any one wait on the drives or the host pool may last before it raises. Default 600.
        activations: per block ``"keep"``, ``"host"``, ``"ssd"`` or ``"recompute"`` (one for all, or
            ``{block: policy}``), or ``"auto"`` (the planner profiles ``planner_warmup_steps`` steps, then places
            them). Unset (``None``): decided for the device (`placement_defaults`).
        plan: a plan JSON (``Plan.save``, ``fuyou plan --save``) applied from the first step; read by `resolve`.
        planner_warmup_steps: steps profiled before ``"auto"`` plans (the first is discarded). Default 3.
        blocks: the repeated blocks (a dotted path to a ``ModuleList``, or module paths); ``None``: discovered.
        activation_min_bytes: saved tensors smaller than this stay where they are. Default 64 KiB.
        activation_prefetch_blocks: blocks whose activations are read back ahead of backward. Default 2.
        weights: per block ``"device"``, ``"host"`` or ``"ssd"`` (`params.WeightStreamer`), or ``"auto"`` (the
            planner, with ``activations="auto"`` or a ``plan``). Unset: decided for the device and ranks.
        weight_prefetch_blocks: streamed blocks read ahead and kept from forward into backward. Default 2.
        state_slots: 2 (speculative updates with a rollback slot, 24 B per parameter) or 1 (12 B; updates in
            ``step()``, ``next_forward`` only). ``"auto"``: two, and one from the end of the planner's warm-up where
            its plan with one slot is predicted at least 5% faster, fits where two do not, or on the CPU holds the
            whole state in RAM where two do not (``activations="auto"``, one process; `planner.worth_one_slot`).
            Where the warm-up's steps speculated, it runs two more under ``next_forward``, which that plan is
            solved on.
        host_state: bytes of ``host_memory_budget`` holding optimizer state in RAM instead of on the SSD (exact);
            ``"auto"``: what the transfers and the plan leave (`storage.host_state_bytes`); 0: all on the SSD.
        device_state: bytes of the compute device's memory holding optimizer state, updated there by torch's fused
            AdamW (`optim.state`'s device tier; exact, the device's kernel): the first parameters' state that
            fits, before the host tier takes any. ``"auto"``: what the plan leaves on the device after the
            weights, activations and working set (0 during the warm-up, and on the CPU, whose device tier is
            host RAM, which ``host_state`` already uses); 0: none.
        state_format: ``"fp32"`` (exact, 12 B per parameter and slot), ``"bf16"`` moments (8 B) or ``"8bit"``
            moments (~6.03 B, torchao); approximate formats cost CPU time per update; a checkpoint loads only
            into its own format.
        optimizer_schedule: ``"backward"`` (speculative, during backward), ``"next_forward"`` (exact, ahead of
            the next forward) or ``"auto"`` (per step, from measured costs: `optim.schedule.ScheduleChooser`);
            bitwise the same weights.
        update_kernel: the host update of fp32 state with ``fused=True``: ``"one_pass"`` (one pass over each
            chunk's memory, compiled on first use; `optim.onepass`), ``"torch"`` (torch's fused kernel, in
            place, with the copies around it) or ``"auto"``: the one pass where it builds and matches torch's
            kernel bitwise on this machine, else torch's. The same bits either way.
        gradient_reduction: data parallel with DDP: ``"owner"`` (each bucket summed onto the owners only) or
            ``"all"`` (DDP's all-reduce).
        trace: a path: record ``trace_steps`` steps as Perfetto trace JSON there (its folder must exist).
        trace_steps: steps in the trace. Default 2.
        ssd_endurance_tbw: each swap drive's rated endurance in TB written (1e12 bytes). Default 300.
        ssd_wear_warning: warn when the run is projected to spend more than this share of it. Default 0.05.
        ssd_write_tolerance: share of predicted step time the planner may give up for fewer SSD writes.
            Default 0.02.
        progress: progress bars (on a terminal) for long work. Default ``True``.
    """

    swap_dirs: list[str] | None = None
    host_memory_budget: int | str = "auto"
    device_memory_budget: int | str | None = None
    io_threads: int | str = "auto"
    io_block_size: int | str = "1MiB"
    chunk_size: int | str = "16MiB"
    direct_io: str = "auto"
    preallocate: bool = True
    optimizer_prefetch_chunks: int | str = "auto"
    optimizer_threads: int | str = "auto"
    io_timeout: float = 600.0
    activations: str | dict | None = None
    blocks: str | list[str] | None = None
    activation_min_bytes: int | str = "64KiB"
    activation_prefetch_blocks: int = 2
    weights: str | dict | None = None
    weight_prefetch_blocks: int = 2
    state_slots: int | str = 2
    host_state: int | str = "auto"
    device_state: int | str = "auto"
    state_format: str = "fp32"
    optimizer_schedule: str = "auto"
    update_kernel: str = "auto"
    gradient_reduction: str = "owner"
    plan: str | None = None
    planner_warmup_steps: int = 3
    trace: str | None = None
    trace_steps: int = 2
    ssd_endurance_tbw: float = 300.0
    ssd_wear_warning: float = 0.05
    ssd_write_tolerance: float = 0.02
    progress: bool = True

    def __post_init__(self) -> None:
        self._validate()

    # -- validation -------------------------------------------------------------------------
    def _validate(self) -> None:
        if self.swap_dirs is not None:
            dirs = [self.swap_dirs] if isinstance(self.swap_dirs, (str, os.PathLike)) else list(self.swap_dirs)
            if not dirs:
                raise ConfigError("swap_dirs: got []; give at least one directory, or None for a temporary one")
            for d in dirs:
                if not isinstance(d, (str, os.PathLike)):
                    raise ConfigError(f"swap_dirs: got entry {d!r}; expected a path string")
                try:
                    os.fspath(d).format(rank=0, local_rank=0)
                except (KeyError, IndexError, ValueError) as exc:
                    raise ConfigError(f"swap_dirs: got {os.fspath(d)!r}; the only placeholders are {{rank}} and "
                                      f"{{local_rank}} (a directory per rank or per GPU), not {exc}") from None
            resolved = [str(Path(d).expanduser()) for d in dirs]
            if len(set(map(_same_path, resolved))) != len(resolved):
                raise ConfigError(f"swap_dirs: got {resolved}; a directory is listed twice, list each drive once")
            _set(self, "swap_dirs", resolved)
        raw_budget = self.host_memory_budget
        if raw_budget != "auto":  # "auto" stays until `resolve` reads the machine
            _set(self, "host_memory_budget", parse_bytes(raw_budget, name="host_memory_budget"))
            if self.host_memory_budget < PAGE:
                raise ConfigError(
                    f"host_memory_budget: got {raw_budget!r} ({self.host_memory_budget} bytes); it must hold at "
                    f"least one 4 KiB page, and in practice several chunks, e.g. '2GiB'"
                )
        if self.device_memory_budget is not None:
            _set(self, "device_memory_budget", parse_bytes(self.device_memory_budget, name="device_memory_budget"))
        threads = self.io_threads
        if threads != "auto" and (not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 64):
            raise ConfigError(f"io_threads: got {self.io_threads!r}; expected 'auto' or an int from 1 to 64 (threads per "
                              "swap dir)")
        for name in ("io_block_size", "chunk_size"):
            nbytes = parse_bytes(getattr(self, name), name=name)
            if nbytes < PAGE or nbytes % PAGE:
                suggestion = max(PAGE, -(-nbytes // PAGE) * PAGE)
                raise ConfigError(
                    f"{name}: got {getattr(self, name)!r} ({nbytes} bytes); it must be a positive multiple of "
                    f"4 KiB for O_DIRECT, e.g. {suggestion} ({format_bytes(suggestion)})"
                )
            _set(self, name, nbytes)
        if self.host_memory_budget != "auto" and self.chunk_size > self.host_memory_budget:
            raise ConfigError(
                f"chunk_size: got {format_bytes(self.chunk_size)}, larger than host_memory_budget "
                f"({format_bytes(self.host_memory_budget)}); lower chunk_size or raise host_memory_budget"
            )
        if self.direct_io not in ("auto", "on", "off"):
            raise ConfigError(f"direct_io: got {self.direct_io!r}; expected 'auto', 'on' or 'off'")
        chunks = self.optimizer_prefetch_chunks
        if chunks != "auto" and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
            raise ConfigError(
                f"optimizer_prefetch_chunks: got {self.optimizer_prefetch_chunks!r}; expected 'auto' or an int >= 1"
            )
        threads = self.optimizer_threads
        if threads != "auto" and (not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 1024):
            raise ConfigError(f"optimizer_threads: got {threads!r}; expected 'auto' or an int from 1 to 1024 (the "
                              "optimizer worker's intra-op threads)")
        timeout = self.io_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ConfigError(f"io_timeout: got {self.io_timeout!r}; expected seconds > 0, e.g. 600")
        if self.activations is not None:  # None: `placement_defaults` decides when the engine knows the device
            _set(self, "activations", _per_block("activations", self.activations, POLICIES, auto=True))
        if self.weights is not None:
            _set(self, "weights", _per_block("weights", self.weights, WEIGHT_TIERS, auto=True))
        if not isinstance(self.weight_prefetch_blocks, int) or isinstance(self.weight_prefetch_blocks, bool) \
                or self.weight_prefetch_blocks < 0:
            raise ConfigError(f"weight_prefetch_blocks: got {self.weight_prefetch_blocks!r}; expected an int >= 0")
        if self.state_slots not in (1, 2, "auto") or isinstance(self.state_slots, bool):
            raise ConfigError(f"state_slots: got {self.state_slots!r}; expected 2 (overlapped updates with a rollback "
                              "slot), 1 (updates in step(), half the state) or 'auto' (two, one where the warm-up's "
                              "plan names one)")
        if self.host_state != "auto":
            raw_state = self.host_state
            _set(self, "host_state", parse_bytes(raw_state, name="host_state"))
            if self.host_state and self.host_memory_budget != "auto" \
                    and self.host_memory_budget - self.host_state < 2 * self.chunk_size:
                raise ConfigError(
                    f"host_state: got {raw_state!r} ({format_bytes(self.host_state)}) of host_memory_budget="
                    f"{format_bytes(self.host_memory_budget)}; the transfers need at least two chunks "
                    f"({format_bytes(2 * self.chunk_size)}) of what is left: lower host_state or raise "
                    "host_memory_budget")
        if self.device_state != "auto":
            _set(self, "device_state", parse_bytes(self.device_state, name="device_state"))
        if self.state_format not in STATE_FORMATS:
            raise ConfigError(f"state_format: got {self.state_format!r}; expected one of "
                              f"{', '.join(map(repr, STATE_FORMATS))} (fp32 is exact; bf16 and 8bit store the moments "
                              "compactly)")
        if self.update_kernel not in UPDATE_KERNELS:
            raise ConfigError(f"update_kernel: got {self.update_kernel!r}; expected one of "
                              f"{', '.join(map(repr, UPDATE_KERNELS))} ('auto' takes the one-pass update where it "
                              "builds on this machine)")
        if self.optimizer_schedule not in SCHEDULES:
            raise ConfigError(f"optimizer_schedule: got {self.optimizer_schedule!r}; expected one of "
                              f"{', '.join(map(repr, SCHEDULES))}")
        if self.gradient_reduction not in GRADIENT_REDUCTIONS:
            raise ConfigError(f"gradient_reduction: got {self.gradient_reduction!r}; expected one of "
                              f"{', '.join(map(repr, GRADIENT_REDUCTIONS))}")
        if self.optimizer_schedule == "backward" and self.state_slots == 1:
            raise ConfigError("optimizer_schedule: got 'backward' with state_slots=1; speculative updates during "
                              "backward need the shadow slot: use state_slots=2, or optimizer_schedule='next_forward'")
        _set(self, "activation_min_bytes", parse_bytes(self.activation_min_bytes, name="activation_min_bytes"))
        if not isinstance(self.activation_prefetch_blocks, int) or self.activation_prefetch_blocks < 0:
            raise ConfigError(f"activation_prefetch_blocks: got {self.activation_prefetch_blocks!r}; expected an int >= 0")
        if not isinstance(self.planner_warmup_steps, int) or self.planner_warmup_steps < 2:
            raise ConfigError(f"planner_warmup_steps: got {self.planner_warmup_steps!r}; expected an int >= 2 "
                              "(the first step is discarded)")
        if self.plan is not None:
            if not isinstance(self.plan, (str, os.PathLike)):
                raise ConfigError(f"plan: got {self.plan!r}; expected the path of a plan JSON written by `fuyou plan "
                                  "--save` or Plan.save")
            _set(self, "plan", os.fspath(self.plan))  # read, and checked against ``weights``, by `resolve`
        elif self.weights == "auto" and self.activations not in ("auto", None):
            raise ConfigError(f"weights: got 'auto' with activations={self.activations!r} and no plan; 'auto' lets the "
                              "planner choose each block's tier, so set activations='auto' (it chooses both) or "
                              "plan='plan.json' (a plan's tiers), or name a tier: 'device', 'host' or 'ssd'")
        if self.trace is not None:
            if not isinstance(self.trace, (str, os.PathLike)):
                raise ConfigError(f"trace: got {self.trace!r}; expected the path of the trace JSON to write")
            _set(self, "trace", str(Path(self.trace).expanduser()))  # its folder is checked by `resolve`
        if not isinstance(self.trace_steps, int) or isinstance(self.trace_steps, bool) or self.trace_steps < 1:
            raise ConfigError(f"trace_steps: got {self.trace_steps!r}; expected an int >= 1 (steps in the trace)")
        tbw = self.ssd_endurance_tbw
        if isinstance(tbw, bool) or not isinstance(tbw, (int, float)) or not 0 < tbw < float("inf"):
            raise ConfigError(f"ssd_endurance_tbw: got {tbw!r}; expected the drive's rated terabytes written "
                              "(its datasheet's TBW), e.g. 600 for a 1 TB consumer NVMe drive")
        share = self.ssd_wear_warning
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ConfigError(f"ssd_wear_warning: got {share!r}; expected a share of the rated endurance in (0, 1], "
                              "e.g. 0.05 to warn when a run would spend over 5% of it")
        tol = self.ssd_write_tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol <= 1:
            raise ConfigError(f"ssd_write_tolerance: got {tol!r}; expected a share of step time in [0, 1], e.g. 0.02 "
                              "(a plan up to 2% slower may be chosen if it writes less to the SSD), or 0")
        for name in ("preallocate", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: got {getattr(self, name)!r}; expected True or False")

    # -- loading ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "FuyouConfig":
        """Build from a mapping; an unknown key is an error that suggests the closest field."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                raise ConfigError(f"{key}: not a FuyouConfig field; {did_you_mean(key, known)}")
        return cls(**dict(values))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "FuyouConfig":
        """Load from a ``.json``, ``.yaml`` or ``.yml`` file holding a mapping of fields."""
        return cls.from_dict(read_mapping(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def merge(cls, config: "FuyouConfig | Mapping[str, Any] | str | os.PathLike | None" = None,
              **fields: Any) -> "FuyouConfig":
        """One config from what an adapter was given: a `FuyouConfig`, a mapping, a file path or
        ``None`` (defaults), with keyword ``fields`` overriding it (unknown names are errors)."""
        if config is None:
            base: dict[str, Any] = {}
        elif isinstance(config, FuyouConfig):
            if not fields:
                return config
            base = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        elif isinstance(config, Mapping):
            base = dict(config)
        elif isinstance(config, (str, os.PathLike)):
            base = cls.from_file(config).to_dict()
        else:
            raise ConfigError(f"config: got {type(config).__name__}; expected a FuyouConfig, a dict, a .json/.yaml path or None")
        return cls.from_dict({**base, **fields})

    def replace(self, **changes: Any) -> "FuyouConfig":
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)


_set = object.__setattr__  # `FuyouConfig._validate` normalises its own frozen fields, once, as it is made


def _same_path(path: str) -> str:
    """``path`` as written, made absolute and normalised (no file system access: symlinks are `resolve`'s)."""
    return os.path.normpath(os.path.abspath(path))


# -- resolution: a config and the machine it runs on -> the settings a run uses ------------------------------------
@dataclass(frozen=True)
class Machine:
    """What ``"auto"`` choices depend on, read once (`Machine.read`) or given (tests, ``fuyou plan``).

    Attributes:
        available_memory: bytes of RAM available at start (``MemAvailable``; 0 if unknown).
        cores: CPU cores of the machine (``os.cpu_count()``).
        local_ranks: processes of this training on this machine (``$LOCAL_WORLD_SIZE``, as torchrun sets it).
        slowest_drive_bps: the slowest cached read or write rate of the swap directories (`drives.measured`);
            ``None`` when one is unmeasured or the swap directory is a temporary folder.
    """

    available_memory: int
    cores: int
    local_ranks: int = 1
    slowest_drive_bps: float | None = None

    @classmethod
    def read(cls, swap_dirs: Iterable[str] | None = None) -> "Machine":
        """This machine, now: ``/proc/meminfo``, the CPU count, ``$LOCAL_WORLD_SIZE`` and the drive-bandwidth
        cache for ``swap_dirs``."""
        return cls(available_memory(), os.cpu_count() or 1, _local_ranks(), slowest_measured(swap_dirs))


@dataclass(frozen=True)
class Settings:
    """A `FuyouConfig` resolved for one run: every ``"auto"`` that depends on the machine replaced by its number
    (``host_memory_budget``, ``io_threads``, ``optimizer_prefetch_chunks``), ``activations``/``weights`` left
    unset decided for the device (when one was given), the plan file read and checked.

    Attributes:
        config: the resolved values (a `FuyouConfig`: every part reads its fields from it).
        choices: ``{field: (value, why)}`` for each field fuyou chose; `FuyouEngine` announces them once.
        said: one sentence per placement decision (`placement_defaults`), as the engine logs it.
        machine: what the choices were made from.
    """

    config: "FuyouConfig"
    choices: Mapping[str, tuple[Any, str]]
    said: tuple[str, ...] = ()
    machine: Machine | None = None


def is_resolved(config: "FuyouConfig") -> bool:
    """No field of ``config`` still waits for the machine (`resolve`)."""
    return "auto" not in (config.host_memory_budget, config.io_threads, config.optimizer_prefetch_chunks)


def resolve(config: "FuyouConfig | None" = None, machine: Machine | None = None, *, device: Any = None,
            ranks: int = 1, local_ranks: int | None = None) -> Settings:
    """Turn ``config`` into the `Settings` of a run, once, at its start (`FuyouEngine`, or a part built on its
    own). ``machine``: read now when not given. ``device`` (a ``torch.device``): where the model computes;
    with it, ``activations``/``weights`` left unset are decided (`placement_defaults`, for ``ranks`` processes
    in all). ``local_ranks``: the processes sharing this machine's RAM (default ``machine.local_ranks``).

    Raises `ConfigError` for what only the machine can tell: a plan file that is missing or contradicts
    ``weights``, a trace folder that does not exist, swap directories that are one directory twice."""
    config = config if config is not None else FuyouConfig()
    machine = machine if machine is not None else Machine.read(config.swap_dirs)
    choices: dict[str, tuple[Any, str]] = {}
    changes: dict[str, Any] = {}

    def chose(name: str, value: Any, why: str, shown: Any = None) -> None:
        changes[name] = value
        choices[name] = (value if shown is None else shown, why)
        log.debug("fuyou: %s='auto' took %s: %s", name, value if shown is None else shown, why)

    if config.swap_dirs is not None and len(set(map(os.path.realpath, config.swap_dirs))) != len(config.swap_dirs):
        raise ConfigError(f"swap_dirs: got {config.swap_dirs}; a directory is listed twice, list each drive once")
    if config.host_memory_budget == "auto":
        ranks_here = local_ranks if local_ranks is not None else machine.local_ranks
        budget, why = auto_host_budget(machine.available_memory, ranks_here)
        chose("host_memory_budget", budget, why, format_bytes(budget))
        if config.host_state == "auto" and machine.available_memory < AUTO_BUDGET_LOW:
            warnings.warn(f"fuyou: only {format_bytes(machine.available_memory)} of RAM is available, less than "
                          f"{format_bytes(AUTO_BUDGET_LOW)}: host_state='auto' keeps the optimizer state on the SSD "
                          "(free memory, or set host_memory_budget and host_state)", stacklevel=2)
            changes["host_state"] = 0
    if config.io_threads == "auto":
        chose("io_threads", *auto_io_threads(machine.cores))
    if config.optimizer_prefetch_chunks == "auto":
        chose("optimizer_prefetch_chunks", *auto_prefetch_chunks(
            len(config.swap_dirs or ()), config.chunk_size, machine.slowest_drive_bps, temporary=not config.swap_dirs))
    if config.plan is not None:
        try:
            streamed = streamed_tiers(read_plan(config.plan))
        except PlanError as exc:
            raise PlanFileError(f"plan: {exc}") from None
        if streamed and config.weights not in ("device", "auto", None):
            raise ConfigError(f"weights: got {config.weights!r}, but the plan {config.plan!r} chooses the weight tiers "
                              f"{streamed}; leave weights at 'device' or 'auto' to apply the plan's, or pin "
                              "a plan that keeps every block's weights on the device")
    if config.trace is not None:
        folder = os.path.dirname(os.path.abspath(config.trace))
        if not os.path.isdir(folder):
            raise ConfigError(f"trace: got {config.trace!r}, but its folder {folder!r} does not exist; create it "
                              "or write the trace elsewhere")
    resolved = config.replace(**changes) if changes else config
    said: list[str] = []
    if device is not None:
        resolved, said = placement_defaults(resolved, device, ranks)
    return Settings(resolved, choices, tuple(said), machine)


def settled(config: "FuyouConfig | None") -> "FuyouConfig":
    """``config`` with nothing left for the machine: itself when resolved already (the engine hands every part
    its resolved config), else `resolve`'s values (a part built on its own)."""
    config = config if config is not None else FuyouConfig()
    return config if is_resolved(config) else resolve(config).config


def read_mapping(path: str | os.PathLike) -> dict[str, Any]:
    """The mapping a ``.json``, ``.yaml`` or ``.yml`` file holds; `ConfigError` naming the file otherwise."""
    path = Path(path)
    if path.suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError(f"config file: got {str(path)!r}; expected a .json, .yaml or .yml file")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r}: cannot be read ({exc.strerror or exc})") from None
    if path.suffix == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r}: not valid JSON: {exc.msg} at line {exc.lineno}, "
                              f"column {exc.colno}") from None
    else:
        import yaml  # pyyaml arrives with lightning and transformers

        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r}: not valid YAML: {exc}") from None
    if not isinstance(values, Mapping):
        raise ConfigError(f"config file {str(path)!r}: expected a mapping of field names to values, got "
                          f"{type(values).__name__}")
    return dict(values)


def placement_defaults(config: FuyouConfig, device: "torch.device", ranks: int = 1) -> tuple[FuyouConfig, list[str]]:
    """``config`` with ``activations`` and ``weights`` decided where they were left unset (``None``), for an
    engine on ``device`` with ``ranks`` processes, and one sentence per decision saying why (the engine
    announces them). A value given is a hard setting and stays.

    - ``activations``: the planner (``"auto"``) when the device's memory is bounded (an accelerator, or a
      ``device_memory_budget``): it profiles a short warm-up, keeps on the device what fits and moves the
      rest to the cheapest tier. ``"keep"`` on the CPU without a budget (the device tier is the host's RAM:
      nothing to plan against), when the weights' tiers were given by hand (placement is then the
      user's), or when a pinned ``plan`` places them.
    - ``weights``: ``"auto"`` when the activations went to the planner here (or were set to ``"auto"``) in
      one process; ``"device"`` otherwise."""
    if config.activations is not None and config.weights is not None:
        return config, []
    bounded = device.type != "cpu" or config.device_memory_budget is not None
    where = (f"a device_memory_budget of {format_bytes(config.device_memory_budget)}"
             if config.device_memory_budget is not None else f"the memory of {device}")
    said, activations, weights = [], config.activations, config.weights
    if activations is None:
        if config.plan is not None:
            activations, why = "keep", f"the pinned plan {config.plan!r} places every block's activations"
        elif weights is not None and weights != "auto":
            activations, why = "keep", (f"the weights' tiers are given (weights={weights!r}), so placement is yours; "
                                        "set activations='auto' to let the planner place the activations too")
        elif weights == "auto" or bounded:
            activations = "auto"
            why = ("weights='auto' needs the planner" if weights == "auto" and not bounded else
                   f"{where} is bounded: the planner profiles the first {config.planner_warmup_steps} steps, keeps on "
                   "the device what fits and moves the rest; set activations='keep' to skip it")
        else:
            activations, why = "keep", (f"the device is {device} with no device_memory_budget: every tier is host "
                                        "RAM, so there is nothing to plan against; set activations='auto' to plan")
        said.append(f"fuyou: activations (unset) took {activations!r}: {why}")
    if weights is None:
        planned = activations == "auto" and config.plan is None
        if planned and ranks == 1:
            weights, why = "auto", ("the planner places each block's weights with its activations (resident while "
                                    "they fit)")
        elif planned:
            weights, why = "device", (f"with {ranks} ranks, a streamed weight would leave DDP's averaging that "
                                      "overlaps backward; set weights='auto' to let the planner stream them anyway")
        else:
            weights, why = "device", ""
        if why:
            said.append(f"fuyou: weights (unset) took {weights!r}: {why}")
    return config.replace(activations=activations, weights=weights), said
