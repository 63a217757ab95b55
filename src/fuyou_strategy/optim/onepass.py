"""The one-pass AdamW update: torch's fused CPU arithmetic, out of place, over a chunk's memory once.

A chunk's update with torch's own kernel (`kernels.adamw_kernel`) is several passes over memory: the gradient
upcast to fp32 (and unscaled, and clipped: one pass each), the shadow slot filled with a copy of the active
chunk (a speculative update), the in-place kernel, then the new master cast into the parameter. The pass here
(``csrc/adamw_pass.cpp``) reads the gradient in its own dtype and the master and moments once, from wherever
they are (the active chunk, the parameter holding the master), and writes the new master and moments once,
wherever they go (the shadow slot, or in place), and the compute-dtype weight in the same pass: ~28 bytes per
parameter of traffic, where the passes it replaces move up to ~68.

Why a compiled loop: torch's ``_fused_adamw_`` works in place on one dtype, and ``torch.compile``'s code
generation of an out-of-place AdamW in the same formulas did not give its bits (measured: docs/one-pass-update.md),
while fuyou's updates are bitwise torch's. The loop is a
transcription of torch's fused CPU kernel (``ATen/native/cpu/FusedAdamKernel.cpp``: same statements, same
``at::vec::Vectorized<float>`` of the CPU capability torch dispatches to, same compiler contraction), built
by ``torch.utils.cpp_extension`` with torch's own headers and OpenMP runtime. It is used only after it
matched ``torch._fused_adamw_`` bit for bit on this machine (`check`): a check over several gradient dtypes,
hyperparameters, unscale and clip factors and ragged lengths, at load. The last elements of a chunk that do
not fill a vector block go through torch's own kernel (torch's scalar tail).

The same build takes the gradients' norms (`OnePass.norms`): torch's ``vector_norm`` order, which is sequential
and so single-threaded in torch, on one thread per gradient with the gradients shared out among the caller's
threads, and a bf16 or fp16 gradient read in its own dtype rather than upcast first. A speculative update's norms
are taken in its pass's own parallel region (`OnePass.update_chunks`'s ``beside``): each on one thread while the
others update. Its order depends on how torch was built (how many accumulators, how the compiler built the last
elements' loop), so `find_norm_layout` tries the known layouts against torch at load; with none matching, the
norms are torch's own.

``FuyouConfig.update_kernel`` chooses: ``"auto"`` takes the pass when it builds and checks out on this
machine (else torch's kernel, saying why), ``"one_pass"`` requires it, ``"torch"`` never builds it.

Threads: `load` may be called from any thread; the first call builds or loads the cached build (`cache_dir`)
under a lock, later calls return what it found. The pass runs on the caller's intra-op threads (OpenMP, torch's
runtime): the optimizer's worker, with ``optimizer_threads``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from .gradients import Beside, grad_norm
from .kernels import adamw_kernel, fp32_gradient

__all__ = ["OnePass", "choose", "load", "step_count", "CAPABILITY_FLAGS", "NORM_LAYOUTS"]

log = logging.getLogger("fuyou_strategy")

SOURCE = Path(__file__).parent / "csrc" / "adamw_pass.cpp"
# The compiler flags torch builds each CPU capability's kernels with (its cmake's CPU_CAPABILITY_FLAGS), and the
# macros that select that capability's `at::vec::Vectorized`. Other capabilities (ARM, DEFAULT) are not built.
CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

# The orders torch's CPU L2 norm of a contiguous fp32 tensor may sum in, as `grad_norms` takes them: (accumulators,
# tail group). The last ``size % accumulators`` elements are added one by one, the first ``tail - tail % group`` of
# them as rounded squares and the rest with a fused multiply-add; a group larger than any tail: all fused.
NORM_LAYOUTS = ((8, 4), (16, 4), (16, 8), (8, 1), (16, 1), (8, 16), (16, 16))
_NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()  # guards _found: one build at a time, one result per capability for the process
_found: dict[str, "tuple[OnePass | None, str]"] = {}


class OnePass:
    """The compiled pass (`load`), with torch's kernel for the ragged end of a chunk.

    ``update`` writes ``master``, ``exp_avg``, ``exp_avg_sq`` (fp32) and, given, ``weight`` (fp32, bf16 or fp16;
    rounded to nearest even as ``Tensor.copy_`` casts) from ``master_in``, ``exp_avg_in``, ``exp_avg_sq_in`` and
    ``grad`` (fp32, bf16 or fp16), all contiguous CPU tensors of at least ``n`` elements; an output may be its
    input (in place), ``weight`` may be ``master_in``. ``grad`` is multiplied by ``inv_scale`` then ``coef``
    (fp32, each rounded) when given, as `state.OptimizerState.update_job` does before torch's kernel; ``step``
    is the count *before* the update (a float tensor, as torch's AdamW keeps it). The result is bitwise that of
    ``torch._fused_adamw_`` on the fp32 gradient so scaled (`check`)."""

    def __init__(self, module: Any, capability: str) -> None:
        self.module, self.capability = module, capability
        self.block = int(module.block_elements())
        # torch's norm order on this machine (`find_norm_layout`), set once at load; None: `norms` is not used
        self.norm_layout: tuple[int, int] | None = None

    def reads(self, grad: torch.Tensor) -> bool:
        """Whether `norms` takes ``grad``: its layout was found, and ``grad`` is a contiguous fp32, bf16 or fp16
        CPU tensor."""
        return (self.norm_layout is not None and grad.is_cpu and grad.dtype in _NORM_DTYPES
                and grad.is_contiguous())

    def norms(self, grads: list[torch.Tensor], inv_scale: torch.Tensor | None) -> list[torch.Tensor]:
        """Each gradient's L2 norm, 0-d fp32, bitwise `gradients.grad_norm` (``vector_norm`` of the gradient in
        fp32, times ``inv_scale`` when given); every gradient one that `reads` takes. One gradient runs on the
        calling thread; several are shared out among its intra-op threads, one thread per gradient."""
        lanes, group = self.norm_layout
        scale = None if inv_scale is None else float(inv_scale)
        return list(self.module.grad_norms(grads, scale, lanes, group).unbind())

    def update(self, master_in: torch.Tensor, exp_avg_in: torch.Tensor, exp_avg_sq_in: torch.Tensor,
               grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               weight: torch.Tensor | None, *, step: torch.Tensor, inv_scale: torch.Tensor | None,
               coef: torch.Tensor | None, lr: float, beta1: float, beta2: float, weight_decay: float,
               eps: float) -> None:
        n = master.numel()
        done = self.module.adamw_pass(master_in, exp_avg_in, exp_avg_sq_in, grad, master, exp_avg, exp_avg_sq, weight,
                                      n, *_scalars(lr, beta1, beta2, weight_decay, eps, step_count(step), inv_scale,
                                                   coef))
        if done < n:
            self._tail(done, master_in, exp_avg_in, exp_avg_sq_in, grad, master, exp_avg, exp_avg_sq, weight, step=step,
                       inv_scale=inv_scale, coef=coef, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                       eps=eps)

    def update_chunk(self, out: torch.Tensor, source: torch.Tensor | None, master_in: torch.Tensor | None,
                     grad: torch.Tensor, weight: torch.Tensor | None, *, n: int, step: torch.Tensor, count: float,
                     inv_scale: torch.Tensor | None, coef: torch.Tensor | None, lr: float, beta1: float,
                     beta2: float, weight_decay: float, eps: float,
                     beside: Beside | None = None, last: bool = True) -> list[torch.Tensor]:
        """`update` of one state chunk as the store holds it (`formats.Layout` ``"fp32"``), with no view made here
        but for a ragged end: ``out`` is the chunk's fp32 values, the master, ``exp_avg`` and ``exp_avg_sq`` of
        ``n`` elements each in turn, written from ``source`` (the same layout; ``None``: ``out``, in place), the
        master read from ``master_in`` when given; ``count`` is ``step + 1`` as a float (`step_count`), taken once
        per parameter. ``beside``, ``last``: norms taken in the same call (`update_chunks`), returned once
        finished; else ``[]``."""
        if beside is not None:
            return self.update_chunks([out], [source], [grad], [weight], [n], counts=[count], inv_scale=inv_scale,
                                      coef=coef, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                                      master_ins=[master_in], beside=beside, last=last)
        done = self.module.adamw_chunk(out, source, master_in, grad, weight, n,
                                       *_scalars(lr, beta1, beta2, weight_decay, eps, count, inv_scale, coef))
        if done < n:
            self._chunk_tail(done, out, source, master_in, grad, weight, n, step=step, inv_scale=inv_scale,
                             coef=coef, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps)
        return []

    def update_chunks(self, outs: list[torch.Tensor], sources: list[torch.Tensor | None], grads: list[torch.Tensor],
                      weights: list[torch.Tensor], ns: list[int], *, counts: list[float],
                      inv_scale: torch.Tensor | None, coef: torch.Tensor | None, lr: float, beta1: float,
                      beta2: float, weight_decay: float, eps: float, master_ins: list[torch.Tensor | None] | None = None,
                      masters_in_place: list[bool] | None = None, beside: Beside | None = None,
                      last: bool = True) -> list[torch.Tensor]:
        """`update_chunk` of each chunk of the lists (the master read from each ``source``, or in place, or from
        ``master_ins``; each new weight into ``weights``), in one call of the compiled pass without the GIL: a run of
        parameters (`state.OptimizerState.group_job`), whose small chunks would each pay more for a call than for
        their arithmetic. The same bits, chunk for chunk. A weight is any contiguous tensor of its chunk's elements,
        in order: a whole parameter may be given as it is (shaped; the pass writes it by pointer, outside autograd).
        ``counts``: the step count each chunk's update completes (`step_count`); a ragged end's tail gives torch's
        kernel the count before it as its step tensor, made only then (whole numbers: exact in fp32).

        ``beside`` (`gradients.Beside`): gradients whose norms (`norms`, each a gradient it `reads`) are taken in the
        same parallel region as the passes, each on one thread while the others update; returned in its order (else
        ``[]``), for the caller to record. The norm a speculative update takes before it then leaves none of the
        worker's other threads waiting. ``last=False``: the norms go on only while this call's blocks last, each
        carried on from where it paused by the next call with the same ``beside`` (`gradients.Beside.progress`), the
        last one finishing them; they are returned by the call that finished the last of them (``[]`` before): a job
        whose chunks come one call each (`state.OptimizerState.update_job`) takes a large gradient's norm beside all
        of its passes, not only beside the first chunk's, where it would outlast that pass with the other threads
        waiting. The same bits: each norm is summed in one order, wherever it pauses.

        ``masters_in_place[i]`` (with ``master_ins[i]``, an fp32 parameter that is its own master, and no weight):
        the new master is written back into ``master_ins[i]`` only; the chunk's master is left as it was (older
        than the parameter: `state.OptimizerState`'s ``masters_behind``). 28 bytes per element, as torch's kernel
        moves on an fp32 parameter, where writing the master into the chunk and the parameter both takes 32."""
        scalars = _scalars(lr, beta1, beta2, weight_decay, eps, 0.0, inv_scale, coef)
        if beside is not None:
            lanes, group = self.norm_layout
            norm_grads, norm_scale = beside.grads(), None if beside.inv_scale is None else float(beside.inv_scale)
            if beside.progress is None:
                beside.progress = [self.module.NormProgress() for _ in norm_grads]
            progress = beside.progress
        else:
            lanes, group, norm_grads, norm_scale, progress = 8, 1, [], None, []
        done, norms = self.module.adamw_chunks(outs, sources, master_ins or [], masters_in_place or [], grads,
                                               weights, ns, counts,
                                               *scalars[:5], *scalars[6:], norm_grads, norm_scale, lanes, group,
                                               progress, last)
        for i, n in enumerate(ns):
            if done[i] < n:
                weight = weights[i].detach().view(-1) if weights[i] is not None else None  # the tail's slices: flat
                master_in = master_ins[i] if master_ins else None  # likewise: a parameter may be given whole
                master_in = master_in.detach().view(-1) if master_in is not None else None
                step = torch.tensor(counts[i] - 1.0, dtype=torch.float32)
                self._chunk_tail(done[i], outs[i], sources[i], master_in, grads[i], weight,
                                 n, step=step, inv_scale=inv_scale, coef=coef, lr=lr, beta1=beta1, beta2=beta2,
                                 weight_decay=weight_decay, eps=eps,
                                 master_in_place=bool(masters_in_place and masters_in_place[i]))
        if not norm_grads or not (last or all(p.done for p in progress)):
            return []
        return list(norms.unbind())

    def _chunk_tail(self, done: int, out: torch.Tensor, source: torch.Tensor | None, master_in: torch.Tensor | None,
                    grad: torch.Tensor, weight: torch.Tensor | None, n: int, *, master_in_place: bool = False,
                    **kwargs: Any) -> None:
        """`_tail` of a chunk as the store holds it (`update_chunk`'s arguments; ``master_in_place``:
        `update_chunks`' ``masters_in_place``)."""
        src = out if source is None else source
        master_in = src[:n] if master_in is None else master_in
        self._tail(done, master_in, src[n : 2 * n], src[2 * n : 3 * n], grad,
                   master_in[:n] if master_in_place else out[:n], out[n : 2 * n], out[2 * n : 3 * n], weight, **kwargs)

    @staticmethod
    def _tail(done: int, master_in: torch.Tensor, exp_avg_in: torch.Tensor, exp_avg_sq_in: torch.Tensor,
              grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              weight: torch.Tensor | None, *, step: torch.Tensor, inv_scale: torch.Tensor | None,
              coef: torch.Tensor | None, lr: float, beta1: float, beta2: float, weight_decay: float,
              eps: float) -> None:
        """The ragged end after the pass's ``done`` elements: torch's kernel, in place on the outputs (its scalar
        tail, as in torch's own run)."""
        n = master.numel()
        tail = slice(done, n)
        for src, dst in ((master_in, master), (exp_avg_in, exp_avg), (exp_avg_sq_in, exp_avg_sq)):
            if src.data_ptr() != dst.data_ptr():
                dst[tail].copy_(src[tail])
        adamw_kernel(master[tail], fp32_gradient(grad[tail], inv_scale, coef), exp_avg[tail], exp_avg_sq[tail], step,
                     fused=True, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps)
        if weight is not None:
            weight[tail].copy_(master[tail])


def _scalars(lr: float, beta1: float, beta2: float, weight_decay: float, eps: float, count: float,
             inv_scale: torch.Tensor | None, coef: torch.Tensor | None) -> tuple:
    """The pass's scalar arguments, in its order: hyperparameters, step count, unscale and clip factors (or None)."""
    return (float(lr), float(beta1), float(beta2), float(weight_decay), float(eps), count,
            None if inv_scale is None else float(inv_scale), None if coef is None else float(coef))


def step_count(step: torch.Tensor) -> float:
    """The step count an update completes, as torch's kernel reads its (incremented) fp32 step tensor: a float."""
    return float((step + 1).item())


def load() -> "tuple[OnePass | None, str]":
    """The one-pass update for this machine's CPU capability and why (one sentence), or ``None`` and why not:
    the capability has no build here, the build failed (no compiler, no ninja), or the built pass did not
    match torch's kernel bit for bit (`check`). Builds once per machine, torch and Python (`cache_dir`), loads
    once per process; thread-safe."""
    capability = torch.backends.cpu.get_cpu_capability()
    with _lock:
        if capability not in _found:
            _found[capability] = one, why = _build(capability)
            if one is None:  # once per process: every update of the run takes the slower kernel
                log.warning("fuyou: %s", why)
        return _found[capability]


def _build(capability: str) -> "tuple[OnePass | None, str]":
    flags = CAPABILITY_FLAGS.get(capability)
    if flags is None:
        return None, (f"torch dispatches its CPU kernels for {capability}, for which the one-pass update has no "
                      f"build (it has {', '.join(CAPABILITY_FLAGS)}); torch's kernel runs")
    cflags = ["-O2", "-fopenmp", f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}", *flags]
    try:
        module = _cached_build(capability, cflags)
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a header torch no longer ships: torch's kernel
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, (f"the one-pass update did not build ({first}); torch's kernel runs. It needs a C++ compiler "
                      "and ninja (pip install ninja)")
    one = OnePass(module, capability)
    wrong = check(one)
    if wrong is not None:
        return None, f"the one-pass update built for {capability} but {wrong}; torch's kernel runs"
    one.norm_layout = find_norm_layout(one)
    if one.norm_layout is None:
        return one, (f"built for {capability} and bitwise torch's fused kernel on this machine; torch's norm sums in "
                     "none of the orders the pass knows, so the gradients' norms are torch's own")
    return one, (f"built for {capability} and bitwise torch's fused kernel and norm on this machine (the norm's "
                 f"layout: {one.norm_layout})")


def cache_dir() -> Path:
    """Where built passes are kept: ``~/.cache/fuyou-strategy/onepass`` (``$XDG_CACHE_HOME`` if set). A build is
    a function of its key alone, so unlike the drives' measurements (`drives`, ``$FUYOU_CACHE_DIR``) it is kept
    for every run of the machine, a test session's included."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fuyou-strategy" / "onepass"


def _cached_build(capability: str, cflags: list[str]) -> Any:
    """The compiled module: loaded from the cache when a build of this source, these flags, this torch and this
    Python is there; else built by ``torch.utils.cpp_extension.load`` in a folder of this process's own and
    moved into the cache whole (``os.replace``). No lock: two processes building at once each build, and the
    last to finish replaces the other's identical file; a process killed mid-build leaves only its own folder,
    which nothing waits for (torch's shared build folder has a lock file that a killed build leaves behind, and
    every later build would wait on it for ever)."""
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *cflags, torch.__version__, sys.version,
                                    capability]).encode()).hexdigest()[:16]
    name = f"fuyou_adamw_pass_{capability.lower()}_{key}"
    kept = cache_dir() / f"{name}.so"
    if not kept.exists():
        from torch.utils.cpp_extension import load as build

        log.info("fuyou: building the one-pass AdamW update for %s (once per machine, torch and Python; about "
                 "half a minute)", capability)
        kept.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f"{name}.", dir=kept.parent) as folder:
            module = build(name=name, sources=[str(SOURCE)], extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                           build_directory=folder, verbose=False)
            os.replace(os.path.join(folder, f"{name}.so"), kept)
        return module  # loaded by the build, from the file now in the cache
    spec = importlib.util.spec_from_file_location(name, kept)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check(one: OnePass, trials: int = 12) -> str | None:
    """``None`` if ``one`` gives torch's ``_fused_adamw_`` bits on ``trials`` random chunks (every gradient dtype,
    with and without unscaling, clipping and weight decay, ragged lengths, in and out of place, the compute
    weight in fp32 and bf16); else what differed."""
    gen = torch.Generator().manual_seed(1234)
    for t in range(trials):
        n = 3 * one.block + 1 + int(torch.randint(0, 4 * one.block, (1,), generator=gen))
        size = 10.0 ** float(torch.empty(()).uniform_(-6, 1, generator=gen))
        master = torch.randn(n, generator=gen)
        exp_avg = torch.randn(n, generator=gen) * size * 0.1
        exp_avg_sq = torch.rand(n, generator=gen) * size * size
        grad = (torch.randn(n, generator=gen) * size).to((torch.float32, torch.bfloat16, torch.float16)[t % 3])
        hyper = dict(lr=(1e-3, 3e-4, 1e-2)[t % 3], beta1=(0.9, 0.5, 0.3, 0.95)[t % 4], beta2=(0.999, 0.95)[t % 2],
                     weight_decay=(0.01, 0.0, 0.1)[t % 3], eps=(1e-8, 1e-6)[t % 2])
        step = torch.tensor(float(t % 5))
        inv_scale = torch.tensor(2.0 ** -10) if t % 2 else None
        coef = torch.tensor(0.3711, dtype=torch.float32) if t % 3 == 1 else None
        want = [master.clone(), exp_avg.clone(), exp_avg_sq.clone()]
        adamw_kernel(want[0], fp32_gradient(grad, inv_scale, coef), want[1], want[2], step, fused=True, **hyper)
        weight = torch.empty(n, dtype=(torch.float32, torch.bfloat16)[t % 2])
        if t % 4 == 3:  # in place, on a chunk as the store holds it
            chunk = torch.cat([master, exp_avg, exp_avg_sq])
            one.update_chunk(chunk, None, None, grad, weight, n=n, step=step, count=step_count(step),
                             inv_scale=inv_scale, coef=coef, **hyper)
            got = list(chunk.split(n))
        else:
            got = [torch.empty(n) for _ in range(3)]
            one.update(master, exp_avg, exp_avg_sq, grad, *got, weight, step=step, inv_scale=inv_scale, coef=coef,
                       **hyper)
        for name, a, b in zip(("the master", "exp_avg", "exp_avg_sq"), got, want):
            if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                return f"{name} differed from torch's kernel in {int((a != b).sum())} of {n} elements"
        if not torch.equal(weight, want[0].to(weight.dtype)):
            return f"the {weight.dtype} weight differed from the master's cast"
    return None


def find_norm_layout(one: OnePass) -> tuple[int, int] | None:
    """The first of `NORM_LAYOUTS` whose norms are torch's bit for bit on gradients of every length up to three
    times the widest layout's accumulators (every tail of every layout) and a few long ones, in each dtype, with
    and without an unscale factor, over magnitudes from 1e-4 to 1e2; ``None`` if none is."""
    gen = torch.Generator().manual_seed(4321)
    cases: dict[torch.Tensor | None, tuple[list, list]] = {None: ([], []), torch.tensor(2.0**-7): ([], [])}
    for i, n in enumerate([*range(1, 49), 1000, 4099, 65537, 2**20 + 11]):
        size = 10.0 ** float(torch.empty(()).uniform_(-4, 2, generator=gen))
        grad = (torch.randn(n, generator=gen) * size).to(_NORM_DTYPES[i % 3])
        inv_scale = list(cases)[i % 2]
        grads, norms = cases[inv_scale]  # the unscale factor's gradients and their norms by torch
        grads.append(grad)
        norms.append(grad_norm(grad, inv_scale))  # torch's path, which the kernel's norms replace
    for layout in NORM_LAYOUTS:
        one.norm_layout = layout
        if all(torch.equal(torch.stack(one.norms(grads, inv)).view(torch.int32), torch.stack(norms).view(torch.int32))
               for inv, (grads, norms) in cases.items()):
            return layout
    one.norm_layout = None
    return None


def choose(asked: str, *, fused: bool, state_format: str) -> "tuple[OnePass | None, str]":
    """The update's kernel for ``FuyouConfig.update_kernel=asked`` and why (one sentence): the one pass (`load`)
    or ``None`` (torch's kernel). ``"one_pass"`` that cannot run raises `ConfigError` naming why."""
    if asked == "torch":
        return None, "update_kernel='torch' was given"
    if not fused:
        why = "fused=False asks for torch's for-loop kernel's arithmetic, which the one pass does not compute"
    elif state_format != "fp32":
        why = f"state_format={state_format!r} updates its compact moments with its own kernel"
    else:
        one, why = load()
        if one is not None:
            return one, why
    if asked == "one_pass":
        raise ConfigError(f"update_kernel: got 'one_pass', but {why}; use update_kernel='auto' (which falls back "
                          "to torch's kernel) or 'torch'")
    return None, why
