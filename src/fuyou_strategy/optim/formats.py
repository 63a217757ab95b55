"""State formats: how one chunk of a parameter's optimizer state is laid out in bytes, and its update.

``FuyouConfig.state_format`` picks one for the whole optimizer:

==========  ==============================================================  ===========  =============================
format      a chunk of ``n`` elements                                       bytes/param  update
==========  ==============================================================  ===========  =============================
``fp32``    ``[master | exp_avg | exp_avg_sq]``, fp32                        12           torch's AdamW kernel: bitwise
                                                                                         ``torch.optim.AdamW``
``bf16``    ``[master fp32 | exp_avg bf16 | exp_avg_sq bf16]``               8            torch's AdamW kernel on fp32
                                                                                         copies of the moments, which
                                                                                         are rounded back to bf16
``8bit``    ``[master fp32 | exp_avg codes | exp_avg_sq codes |``            ~6.03        torchao's ``single_param_adam``
            `` exp_avg scales | exp_avg_sq scales]``                                      on its ``OptimState8bit``
==========  ==============================================================  ===========  =============================

The master stays fp32 in every format; only the moments shrink.

``bf16``: the update is exactly ``torch.optim.AdamW``'s (the same kernel, fused or for-loop as
``FuyouAdamW(fused=...)`` says) with its moments rounded to bf16 (nearest even) after every step — the
tests check it bitwise against that. It is as fast as fp32 but for two casts each way.

``8bit`` is block-wise dynamic-tree quantisation (Dettmers et al., arXiv 2110.02861) as torchao
implements it (``OptimState8bit``: one ``uint8`` code per element through a 256-entry map, one fp32
scale per block of `BLOCK` = 256 elements). As torchao and bitsandbytes do, a parameter of fewer than
`MIN_8BIT` = 4096 elements keeps fp32 moments (biases and norms: a few KiB, and the most sensitive to
quantisation), updated by the same torchao function. Chunks hold whole blocks (`STATE_CHUNK_ELEMENTS`
is a multiple of 256); a parameter whose size is not a multiple of 256 has its last block padded with
zeros, which quantise to zero and change no other value.

**Why torchao for 8-bit.** The arithmetic is torchao's own (``torchao.optim.adam.single_param_adam``,
``OptimState8bit``), run eagerly on the worker over views of the chunk in the host buffer: the quantised
moments are written in place by torchao's ``copy_``, so there is no second copy and no hand-written
quantiser to get wrong. torchao is pure PyTorch on the CPU and installs without touching torch
(``pip install torchao``; the ``[compact]`` extra); bitsandbytes' CPU back end also quantises block-wise,
but its 8-bit optimizer kernels target CUDA. The update equals torchao's ``AdamW8bit`` on the same
gradients, bitwise when torchao runs eagerly (its optimizer wraps the same function in
``torch.compile``, which fuses and can differ in the last bit). **Its cost is CPU time:** eagerly, the
quantiser's binary search over the 256-entry map makes the 8-bit update many times slower than torch's
fused fp32 kernel (measured in ``docs/state-formats.md``); choose it for the bytes (disk space, drive
wear, host RAM), not for speed on few cores.

A checkpoint records its format (``optimizer.json``'s ``state_format``) and its files are the pieces
above, each in element order (``exp_avg.scale.bin``, ``exp_avg_sq.scale.bin`` for ``8bit``). Loading a
save of one format into an optimizer of another is refused, naming both (converting would quietly change
the training).
"""

from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..config import STATE_CHUNK_ELEMENTS, STATE_FORMATS, ConfigError

__all__ = ["FORMATS", "BLOCK", "MIN_8BIT", "Layout", "StateFormat", "state_format", "ALL_KINDS"]

FORMATS = STATE_FORMATS
BLOCK = 256  # elements per 8-bit block (torchao's and bitsandbytes' default)
MIN_8BIT = 4096  # smaller parameters keep fp32 moments (torchao and bitsandbytes: "only quantize tensors >= 4096")
assert STATE_CHUNK_ELEMENTS % BLOCK == 0, "state chunks must hold whole 8-bit blocks"

MOMENTS = ("exp_avg", "exp_avg_sq")
SCALES = ("exp_avg.scale", "exp_avg_sq.scale")
ALL_KINDS = ("master", *MOMENTS, *SCALES)  # every checkpoint file name any format writes (without ".bin")


@dataclass(frozen=True)
class Layout:
    """One parameter's chunk layout: the moments in ``fp32``, ``bf16`` or ``8bit`` (the master is fp32),
    and the update's ``kernel``: ``"torch"`` (exact, `state.adamw_kernel`) or ``"torchao"``
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
        torchao ``OptimState8bit`` over the codes and scales — all views of ``buf``."""
        parts = self.split(buf, n)
        out = {"master": parts["master"].view(torch.float32)}
        if self.moments == "8bit":
            q = _torchao()
            for kind, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                out[kind] = q.OptimState8bit(parts[kind], parts[f"{kind}.scale"].view(torch.float32), q.qmap[signed],
                                             signed)
        else:
            dtype = torch.float32 if self.moments == "fp32" else torch.bfloat16
            out.update({kind: parts[kind].view(dtype) for kind in MOMENTS})
        return out

    @staticmethod
    def dequantize(moment: Any) -> torch.Tensor:
        """A moment as fp32 values (a copy; for reading state back)."""
        return moment.dequantize() if hasattr(moment, "dequantize") else moment.float()


def update_compact(state: dict[str, Any], grad: torch.Tensor, step: torch.Tensor, *, lr: Any, beta1: float,
                   beta2: float, weight_decay: float, eps: float) -> None:
    """One AdamW update of a compact chunk in place (``state`` from `Layout.views`, ``step`` the count
    before it): torchao's ``single_param_adam``, eagerly. An 8-bit chunk whose size is not whole blocks
    runs on zero-padded copies of its master and gradient (the padding stays zero)."""
    q = _torchao()
    master, exp_avg, exp_avg_sq = state["master"], state["exp_avg"], state["exp_avg_sq"]
    n, padded = master.numel(), exp_avg.shape[0]
    p, g = master, grad
    if padded != n:
        p, g = master.new_zeros(padded), grad.new_zeros(padded)
        p[:n].copy_(master)
        g[:n].copy_(grad)
    q.single_param_adam(p, g, (step + 1).to(torch.float32), exp_avg, exp_avg_sq, None, lr, beta1, beta2,
                        weight_decay, eps, True, False)
    if padded != n:
        master.copy_(p[:n])


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
    def exact(self) -> bool:
        return self.name == "fp32"

    @property
    def kinds(self) -> tuple[str, ...]:
        """The checkpoint files (without ``.bin``) of a save in this format."""
        return ALL_KINDS if self.name == "8bit" else ALL_KINDS[:3]

    def bytes_per_param(self, numel: int | None = None) -> float:
        """State bytes per parameter and slot (of a parameter of ``numel`` elements; large ones by default)."""
        n = STATE_CHUNK_ELEMENTS * 64 if numel is None else numel
        return self.layout(n).nbytes(n) / n


def state_format(name: str) -> StateFormat:
    return StateFormat(name)


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
            from torchao.optim import adam, subclass_8bit
    except ImportError as exc:
        raise ConfigError("state_format: the '8bit' format uses torchao's optimizer state; install it with  "
                          "pip install 'fuyou-strategy[compact]'  (or  pip install torchao)") from exc
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)

    class _Q:
        single_param_adam = staticmethod(adam.single_param_adam)
        OptimState8bit = subclass_8bit.OptimState8bit
        # the maps from code to value (read-only; shared by every chunk's OptimState8bit)
        qmap = {signed: torch.tensor(subclass_8bit.get_qmap_signed() if signed else subclass_8bit.get_qmap_unsigned(),
                                     dtype=torch.float32) for signed in (True, False)}

    return _Q
