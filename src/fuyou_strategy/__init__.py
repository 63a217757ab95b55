"""fuyou-strategy: fine-tune models larger than GPU memory on one machine, with NVMe SSDs.

An implementation of Fuyou (Liao et al., arXiv 2403.06504). Importing the package registers
``strategy="fuyou"`` with Lightning's ``Trainer`` and ``Fabric``; ``FuyouCallback`` (for the
Hugging Face ``Trainer``) is imported on first use, so transformers loads only when needed.
"""

from typing import Any

from .activations import ActivationSwapper, Policy, SwapStats
from .config import ConfigError, FuyouConfig
from .engine import FuyouEngine, ignore_streamed_in_ddp
from .optim import FuyouAdamW, StepStats
from .params import SafetensorsInit
from .storage import HostBufferPool, IOEngine, TensorStore

__version__ = "0.1.0"
__all__ = [
    "ActivationSwapper", "ConfigError", "FuyouAdamW", "FuyouCallback", "FuyouConfig", "FuyouEngine",
    "FuyouDDPStrategy", "FuyouFabricStrategy", "FuyouStrategy", "HostBufferPool", "IOEngine", "Policy", "SafetensorsInit", "StepStats",
    "SwapStats", "TensorStore", "__version__", "ignore_streamed_in_ddp",
]

try:
    from .integrations.lightning import FuyouDDPStrategy, FuyouFabricStrategy, FuyouStrategy, register as _register
except ImportError as _error:  # lightning is a dependency; this only guards a broken install
    _LIGHTNING_ERROR: ImportError | None = _error
else:
    _LIGHTNING_ERROR = None
    _register()


def __getattr__(name: str) -> Any:
    if name == "FuyouCallback":
        from .integrations.hf import FuyouCallback

        return FuyouCallback
    if name in ("FuyouStrategy", "FuyouDDPStrategy", "FuyouFabricStrategy") and _LIGHTNING_ERROR is not None:
        raise ImportError(f"{name} needs lightning: {_LIGHTNING_ERROR}") from _LIGHTNING_ERROR
    raise AttributeError(f"module 'fuyou_strategy' has no attribute {name!r}")
