"""torch's AdamW arithmetic as fuyou's update applies it: the gradient in fp32, unscaled and clipped
(`fp32_gradient`), then torch's kernel in place (`adamw_kernel`). The reference every update path matches
bitwise: `state.apply_update` runs it on a chunk, and `onepass` on the ragged end of a chunk and in the
check of its compiled pass."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.adamw import adamw as adamw_for_loop

__all__ = ["adamw_kernel", "fused_adamw", "fp32_gradient", "fp32_gradients"]


def fp32_gradient(raw: torch.Tensor, inv_scale: torch.Tensor | None, coef: torch.Tensor | None) -> torch.Tensor:
    """The gradient the kernel takes: ``raw`` in fp32 (on the host: a device gradient was staged), times
    ``inv_scale`` (``GradScaler.unscale_``) then ``coef`` (``clip_grad_norm_``'s in-place multiply), each an
    fp32 multiply, when given. ``raw`` itself when it is fp32 and neither is given."""
    g = raw.to(torch.float32)
    if inv_scale is not None:
        g = g * inv_scale
    if coef is not None:
        g = g * coef
    return g


def fp32_gradients(raws: list[torch.Tensor], inv_scale: torch.Tensor | None, coef: torch.Tensor | None, *,
                   consume: bool = False) -> list[torch.Tensor]:
    """`fp32_gradient` of each of ``raws``, bitwise, with one multi-tensor multiply per factor (on an accelerator,
    one kernel for the list rather than one per tensor): each the same fp32 product. ``consume``: the caller reads
    none of ``raws`` again, so an fp32 one is multiplied in place, as ``GradScaler.unscale_`` and
    ``clip_grad_norm_`` do (no second gradient's worth of memory, one pass fewer); an upcast copy always is."""
    grads = [g if g.dtype == torch.float32 else g.to(torch.float32) for g in raws]
    fresh = consume or all(g is not raw for g, raw in zip(grads, raws))
    for factor in (inv_scale, coef):
        if factor is None:
            continue
        if fresh:
            torch._foreach_mul_(grads, factor)
        else:  # the first multiply makes the list the rest multiply in place; ``raws`` stay as they are
            grads, fresh = torch._foreach_mul(grads, factor), True
    return grads


def fused_adamw(masters: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], counts: list[torch.Tensor], *, found_inf: torch.Tensor | None = None,
                **hyper: Any) -> None:
    """torch's fused AdamW in place over lists, as ``torch.optim.AdamW(fused=True)`` calls it (one multi-tensor call);
    ``counts``: the step count each update completes (the count *before* it, plus one). ``found_inf`` (a one-element
    fp32 tensor where the kernel runs, as ``GradScaler`` passes it): where it is 1, the kernel leaves every tensor as
    it was (the step skipped on the device, without the host reading the flag)."""
    torch._fused_adamw_(masters, grads, exp_avgs, exp_avg_sqs, [], counts, amsgrad=False, maximize=False,
                        found_inf=found_inf, **hyper)


def adamw_kernel(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 step: torch.Tensor, *, fused: bool, found_inf: torch.Tensor | None = None, **hyper: Any) -> None:
    """One AdamW update in place, ``step`` being the count *before* it: torch's fused CPU kernel or
    its for-loop one (``AdamW()``'s default on the CPU), bitwise as ``torch.optim.AdamW`` applies them.
    ``found_inf``: the fused kernel's flag (`fused_adamw`)."""
    if fused:
        fused_adamw([master], [grad], [exp_avg], [exp_avg_sq], [step + 1], found_inf=found_inf, **hyper)
    elif found_inf is not None:
        raise ValueError("adamw_kernel: found_inf is the fused kernel's; the for-loop kernel takes none")
    else:  # the for-loop kernel increments its step tensor: give it a copy
        adamw_for_loop([master], [grad], [exp_avg], [exp_avg_sq], [], [step.clone()], foreach=False, fused=False,
                       amsgrad=False, maximize=False, **hyper)
