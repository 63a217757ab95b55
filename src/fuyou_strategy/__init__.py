"""fuyou-strategy: fine-tune models larger than GPU memory on one machine, with NVMe SSDs.

An implementation of Fuyou (Liao et al., arXiv 2403.06504). The core (`FuyouAdamW`,
`FuyouEngine`, `FuyouConfig`) needs torch alone. With Lightning installed (``[lightning]`` extra),
importing the package registers ``strategy="fuyou"`` with Lightning's ``Trainer`` and ``Fabric``;
``FuyouCallback`` (the Hugging Face ``Trainer``, ``[hf]`` extra) is imported on first use, so
transformers loads only when needed. A name whose framework is missing raises an ImportError that
says which extra to install.

The building blocks live in their subpackages: ``fuyou_strategy.storage`` (`TensorStore`,
`HostBufferPool`, `IOEngine`), ``fuyou_strategy.activations`` (`ActivationSwapper`, `Policy`,
`SwapStats`), ``fuyou_strategy.optim`` (`StepStats`), ``fuyou_strategy.params``.
"""

import importlib
import warnings
from typing import Any

from ._extras import MissingExtraError
from .config import ConfigError, FuyouConfig
from .engine import FuyouEngine, ignore_streamed_in_ddp
from .optim import FuyouAdamW
from .params import SafetensorsInit

__version__ = "0.1.0"
__all__ = [
    "ConfigError", "FuyouAdamW", "FuyouCallback", "FuyouConfig", "FuyouDDPStrategy", "FuyouEngine",
    "FuyouFabricDDPStrategy", "FuyouFabricStrategy", "FuyouStrategy", "SafetensorsInit", "__version__", "ignore_streamed_in_ddp",
]

_LIGHTNING_NAMES = ("FuyouStrategy", "FuyouDDPStrategy", "FuyouFabricStrategy", "FuyouFabricDDPStrategy")
# Top-level names of 0.1 that now live only in their subpackage's __all__: still importable from here for
# one more release, with a DeprecationWarning that says where they went.
_MOVED = {
    "HostBufferPool": "storage", "IOEngine": "storage", "TensorStore": "storage",
    "ActivationSwapper": "activations", "Policy": "activations", "SwapStats": "activations",
    "StepStats": "optim",
}

try:
    from .integrations.lightning import (FuyouDDPStrategy, FuyouFabricDDPStrategy, FuyouFabricStrategy, FuyouStrategy,
                                         register as _register)
except MissingExtraError:  # no [lightning] extra: nothing to register; the names raise the install line
    pass
except ImportError as _error:  # Lightning installed but broken: the core still imports; the names raise this again
    warnings.warn(f'strategy="fuyou" is not registered: importing Lightning failed: {_error}', RuntimeWarning,
                  stacklevel=2)
else:
    _register()


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING_NAMES:  # reached only when importing Lightning failed: raises that error again
        return getattr(importlib.import_module(".integrations.lightning", __name__), name)
    if name == "FuyouCallback":
        from .integrations.hf import FuyouCallback

        return FuyouCallback
    if name in _MOVED:
        where = f"{__name__}.{_MOVED[name]}"
        warnings.warn(f"{__name__}.{name} moved to {where}: import it from there (the top-level name will be removed)",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(where), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
