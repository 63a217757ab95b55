"""`LossScaler`: dynamic loss scaling for fp16, with ``torch.amp.GradScaler``'s semantics.

``FuyouAdamW(..., loss_scaling=True)`` owns one. Its loop is GradScaler's, folded into the
optimizer (gradients are consumed during backward, so they cannot be unscaled after it)::

    loss = opt.scale_loss(loss)   # GradScaler.scale: loss * scale
    loss.backward()
    opt.step()                    # unscale (x 1/scale, in fp32), norm and clip on the unscaled
                                  # gradients, skip the step if any is inf/NaN; then GradScaler.update

The scale only ever changes by ``growth_factor`` / ``backoff_factor`` (powers of two by default),
so unscaling is exact and the gradient norm of the unscaled gradients is what
``clip_grad_norm_`` computes after ``scaler.unscale_``. The update of the scale is torch's own
kernel (``torch._amp_update_scale_``), so scale and growth tracker follow GradScaler bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import ConfigError

__all__ = ["LossScaler"]


class LossScaler:
    """GradScaler's state and rules (defaults are GradScaler's).

    Args:
        init_scale: the first scale. growth_factor: multiplies the scale after
        ``growth_interval`` steps in a row without inf/NaN. backoff_factor: multiplies it after a
        step with inf/NaN (the step is skipped).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        if not init_scale > 0:
            raise ConfigError(f"loss_scaling init_scale: got {init_scale}; expected a positive number, e.g. 65536")
        if not growth_factor > 1.0:
            raise ConfigError(f"loss_scaling growth_factor: got {growth_factor}; expected > 1, e.g. 2.0")
        if not 0.0 < backoff_factor < 1.0:
            raise ConfigError(f"loss_scaling backoff_factor: got {backoff_factor}; expected in (0, 1), e.g. 0.5")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ConfigError(f"loss_scaling growth_interval: got {growth_interval!r}; expected an int >= 1, e.g. 2000")
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._scale = torch.full((), init_scale, dtype=torch.float32)
        self._growth_tracker = torch.full((), 0, dtype=torch.int32)

    @classmethod
    def resolve(cls, value: "bool | dict | LossScaler | None") -> "LossScaler | None":
        """``True``: GradScaler's defaults; a dict: its arguments; a `LossScaler`; ``None``/``False``: none."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, dict):
            return cls(**value)
        if isinstance(value, cls):
            return value
        raise ConfigError(f"loss_scaling: got {value!r}; expected True, a dict of GradScaler arguments "
                          "(init_scale, growth_factor, backoff_factor, growth_interval), a LossScaler, or None")

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``, as ``GradScaler.scale``."""
        return loss * self._scale.to(loss.device)  # a scalar from pageable memory: a blocking copy (device.py)

    def scale_backward(self, loss: torch.Tensor) -> None:
        """Make the gradient reaching ``loss`` in backward ``scale`` times larger (the same values as
        backwarding ``scale(loss)``: the scale is a power of two), read when backward runs."""
        scale = self._scale
        loss.register_hook(lambda grad: (grad * scale.to(grad.device)).to(grad.dtype))

    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` in fp32, computed as ``GradScaler.unscale_`` does."""
        return self._scale.double().reciprocal().float()

    def get_scale(self) -> float:
        return float(self._scale)

    def update(self, found_inf: bool) -> None:
        """After a step: back off (inf/NaN found, the step was skipped) or count towards growth."""
        torch._amp_update_scale_(self._scale, self._growth_tracker, torch.full((), float(found_inf)),
                                 self.growth_factor, self.backoff_factor, self.growth_interval)

    def state_dict(self) -> dict[str, Any]:
        """As ``GradScaler.state_dict`` (plain numbers)."""
        return {"scale": float(self._scale), "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": int(self._growth_tracker)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale.fill_(state["scale"])
        self._growth_tracker.fill_(state["_growth_tracker"])
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval = state["growth_interval"]
