"""State formats: how one chunk of a parameter's optimizer state is laid out in bytes, and its update.

``FuyouConfig.state_format`` picks one for the whole optimizer (docs/state-formats.md):

==========  ==============================================================  ===========  =============================
format      a chunk of ``n`` elements                                       bytes/param  update
==========  ==============================================================  ===========  =============================
``fp32``    ``[master | exp_avg | exp_avg_sq]``, fp32                        12           torch's AdamW kernel: bitwise
                                                                                         ``torch.optim.AdamW``
``bf16``    ``[master fp32 | exp_avg bf16 | exp_avg_sq bf16]``               8            torch's AdamW kernel on fp32
                                                                                         copies of the moments, which
                                                                                         are rounded back to bf16
``8bit``    ``[master fp32 | exp_avg codes | exp_avg_sq codes |``            ~6.03        torchao's ``AdamW8bit``
            `` exp_avg scales | exp_avg_sq scales]``                                      update, bitwise
==========  ==============================================================  ===========  =============================

The master stays fp32 in every format; ``bf16`` rounds the moments to nearest even after every step.

``8bit`` is torchao's block-wise dynamic-tree quantisation (``OptimState8bit``: a ``uint8`` code per element,
an fp32 scale per `BLOCK` of 256). A parameter under `MIN_8BIT` elements keeps fp32 moments, as torchao and
bitsandbytes do; a last block short of 256 is zero-padded (zeros quantise to zero). The arithmetic is
torchao's (pure PyTorch on the CPU; bitsandbytes' kernels target CUDA), run eagerly over views of the chunk
(`Moment8bit`), bitwise torchao's eager update; `Quantiser` (table look-ups) and `update_compact` (per-thread
`scratch`, cache-sized `tiles`) are ours, for CPU speed. It costs many times fp32's CPU time
(``benchmarks/state_format_bench.py --update``): choose it for the bytes.

A checkpoint records its format and stores each piece in element order; loading a save of one format into an
optimizer of another is refused, naming both (converting would quietly change the training).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..config import STATE_CHUNK_ELEMENTS, STATE_FORMATS, ConfigError

__all__ = ["FORMATS", "BLOCK", "MIN_8BIT", "KINDS", "ALL_KINDS", "Layout", "StateFormat", "Moment8bit", "Quantiser",
           "update_compact", "tiles", "fp32_values", "bytes_per_param", "scratch"]

FORMATS = STATE_FORMATS
BLOCK = 256  # elements per 8-bit block (torchao's and bitsandbytes' default)
MIN_8BIT = 4096  # smaller parameters keep fp32 moments (torchao and bitsandbytes: "only quantize tensors >= 4096")
TILE = 1 << 18  # elements of a compact update's tile (`tiles`): whole blocks; its fp32 working set stays in cache
assert STATE_CHUNK_ELEMENTS % BLOCK == 0 and TILE % BLOCK == 0, "chunks and tiles must hold whole 8-bit blocks"

MOMENTS = ("exp_avg", "exp_avg_sq")
KINDS = ("master", *MOMENTS)  # what a chunk holds, by name; the files of an fp32 or bf16 save
SCALES = ("exp_avg.scale", "exp_avg_sq.scale")
ALL_KINDS = (*KINDS, *SCALES)  # every checkpoint file name any format writes (without ".bin")


@dataclass(frozen=True)
class Layout:
    """One parameter's chunk layout: the moments in ``fp32``, ``bf16`` or ``8bit`` (the master is fp32),
    and the update's ``kernel``: ``"torch"`` (exact, `kernels.adamw_kernel`) or ``"torchao"``
    (`update_compact`; also the small fp32-moment parameters of an 8-bit state, as torchao updates them)."""

    moments: str
    kernel: str = "torch"

    def pieces(self, n: int) -> list[tuple[str, int]]:
        """``(kind, bytes)`` of a chunk of ``n`` elements, in the order they sit in it."""
        if self.moments == "fp32":
            return [("master", 4 * n), ("exp_avg", 4 * n), ("exp_avg_sq", 4 * n)]
        if self.moments == "bf16":
            return [("master", 4 * n), ("exp_avg", 2 * n), ("exp_avg_sq", 2 * n)]
        blocks = -(-n // BLOCK)
        return [("master", 4 * n), ("exp_avg", BLOCK * blocks), ("exp_avg_sq", BLOCK * blocks),
                ("exp_avg.scale", 4 * blocks), ("exp_avg_sq.scale", 4 * blocks)]

    def nbytes(self, n: int) -> int:
        """Bytes of a chunk of ``n`` elements."""
        return sum(size for _kind, size in self.pieces(n))

    def split(self, buf: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
        """The pieces of the chunk of ``n`` elements in the ``uint8`` tensor ``buf`` (views), as bytes."""
        out, at = {}, 0
        for kind, size in self.pieces(n):
            out[kind] = buf[at : at + size]
            at += size
        return out

    def views(self, buf: torch.Tensor, n: int) -> dict[str, Any]:
        """``master`` (fp32, ``n``) and the moments as the update uses them: fp32 or bf16 tensors, or
        `Moment8bit` over the codes and scales — all views of ``buf``."""
        parts = self.split(buf, n)
        out = {"master": parts["master"].view(torch.float32)}
        if self.moments == "8bit":
            for kind, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                out[kind] = Moment8bit(parts[kind], parts[f"{kind}.scale"].view(torch.float32), signed)
        else:
            dtype = torch.float32 if self.moments == "fp32" else torch.bfloat16
            out.update({kind: parts[kind].view(dtype) for kind in MOMENTS})
        return out

    def bytes_per_param(self) -> float:
        """Bytes per parameter of a large parameter's chunks (whole 8-bit blocks)."""
        n = STATE_CHUNK_ELEMENTS * 64
        return self.nbytes(n) / n


def bytes_per_param(state_format: str) -> float:
    """Optimizer-state bytes per parameter and slot of ``state_format`` (12, 8, 6 + 8/256), without torchao."""
    return Layout(state_format).bytes_per_param()


class Moment8bit:
    """An 8-bit moment in a chunk: ``codes`` (``uint8``, whole blocks) and an fp32 ``scale`` per `BLOCK`, views
    of the chunk's buffer; torchao's ``OptimState8bit`` without the tensor subclass, bitwise."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> None:
        self.codes, self.scale, self.signed = codes, scale, signed

    def numel(self) -> int:
        return self.codes.numel()

    def cut(self, start: int, stop: int) -> Moment8bit:
        """Elements ``[start, stop)`` (``start`` a whole number of blocks): views of the codes and scales."""
        return Moment8bit(self.codes[start:stop], self.scale[start // BLOCK : -(-stop // BLOCK)], self.signed)

    def dequantize(self) -> torch.Tensor:
        """The fp32 values (a new tensor): torchao's ``dequant_with_qmap``, bitwise (`Quantiser.values`)."""
        return _torchao().quantiser[self.signed].values(self.codes, self.scale)

    def dequantize_into(self, out: torch.Tensor, index: torch.Tensor) -> None:
        """`dequantize` into ``out`` (fp32), with ``index`` (``int32``) as its scratch; both as many as the codes."""
        _torchao().quantiser[self.signed].values_into(self.codes, self.scale, out, index)

    def copy_(self, values: torch.Tensor) -> None:
        """Quantise ``values`` (as many as the codes) into the codes and scales in place: torchao's
        ``OptimState8bit.copy_`` (``scale_tensor``, then the codes)."""
        n = self.numel()
        self.quantize_from(values, torch.empty(n), torch.empty(n), torch.empty(n, dtype=torch.int32),
                           torch.empty(n, dtype=torch.bool))

    def quantize_from(self, values: torch.Tensor, scaled: torch.Tensor, work: torch.Tensor, code: torch.Tensor,
                      mask: torch.Tensor) -> None:
        """`copy_` with its scratch given: ``scaled`` and ``work`` (fp32), ``code`` (``int32``), ``mask`` (bool),
        each as many as the codes. torchao's ``scale_tensor`` written into ``scaled``: the same operations."""
        torch.abs(values, out=scaled)
        scale = scaled.view(-1, BLOCK).amax(-1).clip(1e-12)
        torch.div(values.view(-1, BLOCK), scale.view(-1, 1), out=scaled.view(-1, BLOCK))
        _torchao().quantiser[self.signed].codes_into(scaled, code, work, mask)
        self.codes.copy_(code)
        self.scale.copy_(scale)


class Quantiser:
    """torchao's 8-bit quantiser (``quantize_8bit_with_qmap``) and dequantiser (``dequant_with_qmap``), bitwise,
    by table look-ups instead of searches.

    Codes: torchao gives ``x`` (scaled into [-1, 1]) the code ``c`` with ``qmap[c] <= x < qmap[c+1]``, rounded
    up when ``x - qmap[c] >= (qmap[c+1] - qmap[c]) * 0.5``. That test is monotone in ``x`` within an interval,
    so one threshold per interval decides it (``thresholds``, found by bisection with torchao's expression)
    and the code is the number of thresholds ``<= x``. The fp32 values sharing their top 16 bits form one
    interval of the reals, so a 65,536-entry table (``base``) gives each one's least code and at most `steps`
    comparisons (1 for torchao's maps), ``code += x >= ahead[code]``, finish it. Equal to ``torch.bucketize``
    for every fp32 value but NaN (whose block scale is NaN anyway; ``state_format_bench.py --quantiser``
    checks all 2**32 patterns). Look-ups use ``index_select``: tensor indexing is several times slower.

    Values: ``qmap[codes] * scale`` per block, as torchao computes it."""

    def __init__(self, qmap: torch.Tensor) -> None:
        low, high = qmap[:-1], qmap[1:]
        half = (high - low) * 0.5
        lo, hi = _ordered(low), _ordered(high)  # rounds up at ``high`` itself; bisect for the least that does
        for _ in range(33):
            mid = (lo + hi) // 2
            up = (_from_ordered(mid) - low) >= half
            hi, lo = torch.where(up, mid, hi), torch.where(up, lo, mid)
        self.thresholds = _from_ordered(hi)
        # The 2**16 intervals, by their top 16 bits as an unsigned number, each from its least to its greatest
        # value that is not a NaN.
        top = torch.arange(1 << 16, dtype=torch.int64) << 16
        ends = fp32_of_bits(torch.stack([top, top | 0xFFFF]))
        first, last = ends.nan_to_num(float("inf")).amin(0), ends.nan_to_num(float("-inf")).amax(0)
        nan = ends.isnan().all(0)
        first, last = torch.where(nan, float("nan"), first), torch.where(nan, float("nan"), last)
        base = torch.bucketize(first, self.thresholds, right=True).to(torch.int32)
        inside = torch.where(nan, 0, torch.bucketize(last, self.thresholds, right=True) - base)
        self.steps = int(inside.max())
        self.ahead = torch.cat([self.thresholds, torch.tensor([float("nan")])])
        # Indexed by the top 16 bits as a signed number (an int32's arithmetic shift) plus 2**15: rolled by
        # 2**15, as ``index_select`` takes no negative index.
        self.base = base.roll(1 << 15)
        self.qmap = qmap

    def codes(self, scaled: torch.Tensor) -> torch.Tensor:
        """The codes of ``scaled`` (fp32, contiguous), as ``uint8``."""
        flat = scaled.reshape(-1)
        code = torch.empty(flat.numel(), dtype=torch.int32)
        self.codes_into(flat, code, torch.empty_like(flat), torch.empty(flat.numel(), dtype=torch.bool))
        return code.view(scaled.shape).to(torch.uint8)

    def codes_into(self, scaled: torch.Tensor, code: torch.Tensor, work: torch.Tensor, mask: torch.Tensor) -> None:
        """`codes` into ``code`` (``int32``), with ``work`` (fp32) and ``mask`` (bool) as scratch; all 1-D, as
        many as ``scaled``."""
        key = work.view(torch.int32)  # the key is read once, before ``work`` holds the thresholds
        torch.bitwise_right_shift(scaled.view(torch.int32), 16, out=key)
        key += 1 << 15
        torch.index_select(self.base, 0, key, out=code)
        for _ in range(self.steps):
            torch.index_select(self.ahead, 0, code, out=work)
            torch.ge(scaled, work, out=mask)
            code += mask

    def values(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """torchao's ``dequant_with_qmap(codes, qmap, scale)``: the fp32 values of whole blocks of ``codes``."""
        out = torch.empty(codes.numel())
        self.values_into(codes.reshape(-1), scale, out, torch.empty(codes.numel(), dtype=torch.int32))
        return out.view(codes.shape)

    def values_into(self, codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, index: torch.Tensor) -> None:
        """`values` into ``out`` (fp32), with ``index`` (``int32``) as scratch; all 1-D, as many as ``codes``:
        torchao's look-up and block scaling, the same operations."""
        index.copy_(codes)
        torch.index_select(self.qmap, 0, index, out=out)
        out.view(scale.shape[0], -1).mul_(scale.view(-1, 1))


def fp32_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """The fp32 values whose bit patterns are ``bits`` (``int64``, each in [0, 2**32))."""
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """fp32 values as int64 keys in the same order (negative floats' bit patterns reversed)."""
    bits = x.view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def _from_ordered(key: torch.Tensor) -> torch.Tensor:
    bits = torch.where(key < 0, (-key) | -0x80000000, key).to(torch.int32)
    return bits.view(torch.float32)


def tiles(state: dict[str, Any], grad: torch.Tensor) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
    """A chunk's ``state`` (`Layout.views`) and gradient in tiles of `TILE` elements, ``(state, grad)`` views in
    order, so a compact update's dozen passes find their data in the CPU's caches. Every operation is
    elementwise or within a block, so each element gets the same bits (tested)."""
    n = state["exp_avg"].numel()  # an 8-bit moment's whole blocks: past the master's end if padded
    for start in range(0, n, TILE):
        stop = start + TILE
        yield {kind: x.cut(start, stop) if isinstance(x, Moment8bit) else x[start:stop] for kind, x in state.items()}, \
            grad[start:stop]


def update_compact(state: dict[str, Any], grad: torch.Tensor, step: torch.Tensor, *, lr: Any, beta1: float,
                   beta2: float, weight_decay: float, eps: float) -> None:
    """One AdamW update of a chunk or a tile (`tiles`), in place (``state`` from `Layout.views`, ``step`` the
    count before it): torchao's ``single_param_adam`` line for line over `Moment8bit` or fp32 moments, bitwise
    torchao's ``AdamW8bit`` run eagerly. A tile whose master ends before its whole blocks runs on zero-padded
    copies of master and gradient."""
    master, exp_avg, exp_avg_sq = state["master"], state["exp_avg"], state["exp_avg_sq"]
    n, padded = master.numel(), exp_avg.numel()
    p, g = master, grad
    if padded != n:
        p, g = master.new_zeros(padded), grad.new_zeros(padded)
        p[:n].copy_(master)
        g[:n].copy_(grad)
    step = (step + 1).to(torch.float32)
    g = g.float()
    # torchao.optim.adam.single_param_adam (IS_ADAMW, no amsgrad, no stochastic rounding), p being fp32, line for
    # line, each result written into a kept buffer (w: p_f32; m, v: the moments in fp32; t, u, c, b: scratch)
    # by the same operation (a product's operands may swap: IEEE products commute).
    w, m, v, t, u, c, b = scratch(padded, *(torch.float32,) * 5, torch.int32, torch.bool)
    torch.mul(p, lr * weight_decay, out=w)
    torch.sub(p, w, out=w)  # p_f32 = p_f32 - lr * weight_decay * p_f32
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    _fp32_into(exp_avg, m, c)
    m.lerp_(g, 1 - beta1)  # exp_avg_f32 = exp_avg.float().lerp(grad_f32, 1 - beta1)
    _fp32_into(exp_avg_sq, v, c)
    torch.square(g, out=t)
    v.lerp_(t, 1 - beta2)  # exp_avg_sq_f32 = exp_avg_sq.float().lerp(grad_f32.square(), 1 - beta2)
    for moment, values in ((exp_avg, m), (exp_avg_sq, v)):  # exp_avg.copy_(exp_avg_f32), then exp_avg_sq
        if isinstance(moment, Moment8bit):
            moment.quantize_from(values, t, u, c, b)
        else:
            moment.copy_(values)
    torch.sqrt(v, out=t)
    t.div_(bias_correction2.sqrt())
    t.add_(eps)  # denom = (exp_avg_sq_f32.sqrt() / bias_correction2.sqrt()) + eps
    m.div_(bias_correction1)
    m.mul_(lr)
    m.div_(t)
    w.sub_(m)  # p_f32 = p_f32 - lr * (exp_avg_f32 / bias_correction1) / denom
    p.copy_(w)
    if padded != n:
        master.copy_(p[:n])


def _fp32_into(moment: Any, out: torch.Tensor, index: torch.Tensor) -> None:
    """`fp32_values` of ``moment`` into ``out``; ``index`` (``int32``, as many) is an 8-bit moment's scratch."""
    if isinstance(moment, Moment8bit):
        moment.dequantize_into(out, index)
    else:
        out.copy_(moment)


_SCRATCH = threading.local()  # per thread (the worker; a planner's measurement): no sharing, no lock


def scratch(n: int, *dtypes: torch.dtype) -> list[torch.Tensor]:
    """One tensor of ``n`` elements per entry of ``dtypes``, kept per thread (and ``dtypes``) and grown as needed:
    an update's temporaries (fresh ones fault a page per 4 KiB under jemalloc's decay). Outside the host pool;
    the 8-bit update's take 25 bytes per `TILE` element. Finish with one call's tensors before the next call
    with the same ``dtypes`` on the thread: they are the same memory."""
    kept = getattr(_SCRATCH, "buffers", None)
    if kept is None:
        kept = _SCRATCH.buffers = {}
    buffers = kept.get(dtypes)
    if buffers is None or buffers[0].numel() < n:
        buffers = kept[dtypes] = [torch.empty(n, dtype=dtype) for dtype in dtypes]
    return [buffer[:n] for buffer in buffers]


def fp32_values(moment: Any) -> torch.Tensor:
    """A view's values in fp32 (`Layout.views`): dequantised, upcast, or the fp32 tensor itself — as torchao's
    ``exp_avg.float()`` gives a moment to ``lerp``; also how the state is read back."""
    return moment.dequantize() if isinstance(moment, Moment8bit) else moment.float()


@dataclass(frozen=True)
class StateFormat:
    """``FuyouConfig.state_format``: which `Layout` each parameter's state takes, and its checkpoint files."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise ConfigError(f"state_format: got {self.name!r}; expected one of {', '.join(map(repr, FORMATS))}")
        if self.name == "8bit":
            _torchao()  # fail now, with the install line, not in the first update

    def layout(self, numel: int) -> Layout:
        if self.name != "8bit":
            return Layout(self.name)
        return Layout("fp32" if numel < MIN_8BIT else "8bit", kernel="torchao")

    @property
    def kinds(self) -> tuple[str, ...]:
        """The checkpoint files (without ``.bin``) of a save in this format."""
        return ALL_KINDS if self.name == "8bit" else KINDS


_TORCHAO: Any = None  # set once under _TORCHAO_LOCK, then only read
_TORCHAO_LOCK = threading.Lock()


def _torchao() -> Any:
    """torchao's optimizer-state pieces, imported once, quietly (its import logs that its CUDA
    extensions do not load on a CPU-only machine, and warns about deprecations that are not ours)."""
    global _TORCHAO
    with _TORCHAO_LOCK:
        if _TORCHAO is None:
            _TORCHAO = _import_torchao()
    return _TORCHAO


def _import_torchao() -> Any:
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.optim import quant_utils, subclass_8bit
    except ImportError as exc:
        raise ConfigError("state_format: the '8bit' format uses torchao's optimizer state; install it with  "
                          "pip install 'fuyou-strategy[compact]'  (or  pip install torchao)") from exc
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)

    qmap = {signed: torch.tensor(subclass_8bit.get_qmap_signed() if signed else subclass_8bit.get_qmap_unsigned(),
                                 dtype=torch.float32) for signed in (True, False)}

    class _Q:  # read-only once made: shared by every chunk's update on the worker
        dequant_with_qmap = staticmethod(quant_utils.dequant_with_qmap)
        scale_tensor = staticmethod(quant_utils.scale_tensor)
        quantize_8bit_with_qmap = staticmethod(quant_utils.quantize_8bit_with_qmap)  # the reference of `Quantiser`

    _Q.qmap = qmap  # the maps from code to value (signed for exp_avg, unsigned for exp_avg_sq)
    _Q.quantiser = {signed: Quantiser(m) for signed, m in qmap.items()}
    return _Q
