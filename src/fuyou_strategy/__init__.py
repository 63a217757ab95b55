"""fuyou-strategy: fine-tune models larger than GPU memory on one machine, with NVMe SSDs.

An implementation of Fuyou (Liao et al., arXiv 2403.06504). The core (`FuyouAdamW`,
`FuyouEngine`, `FuyouConfig`) needs torch alone. With Lightning installed (``[lightning]`` extra),
``strategy="fuyou"`` is registered with Lightning's ``Trainer`` and ``Fabric`` once both this package
and Lightning are imported, in either order; ``FuyouCallback`` (the Hugging Face ``Trainer``, ``[hf]``
extra) is imported on first use, so transformers loads only when needed. A name whose framework is
missing raises an ImportError that says which extra to install.

Importing the package imports no torch: `FuyouConfig` and `ConfigError` need none, every other name is
imported on first use, so that the ``fuyou`` command answers ``--help`` at once.

The building blocks live in their subpackages: ``fuyou_strategy.storage`` (`TensorStore`,
`HostBufferPool`, `IOEngine`), ``fuyou_strategy.activations`` (`ActivationSwapper`, `Policy`,
`SwapStats`), ``fuyou_strategy.optim`` (`StepStats`), ``fuyou_strategy.params``.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

from ._extras import MissingExtraError
from .config import ConfigError, FuyouConfig

__version__ = "0.1.0"
__all__ = [
    "ConfigError", "FuyouAdamW", "FuyouCallback", "FuyouConfig", "FuyouDDPStrategy", "FuyouEngine",
    "FuyouFabricDDPStrategy", "FuyouFabricStrategy", "FuyouStrategy", "SafetensorsInit", "__version__", "ignore_streamed_in_ddp",
]

# Each name imported on first use, from its module (torch and the frameworks load then, not on `import fuyou_strategy`).
_LAZY = {
    "FuyouEngine": "engine", "ignore_streamed_in_ddp": "engine", "FuyouAdamW": "optim", "SafetensorsInit": "params",
    "FuyouCallback": "integrations.hf",
    **dict.fromkeys(("FuyouStrategy", "FuyouDDPStrategy", "FuyouFabricStrategy", "FuyouFabricDDPStrategy"),
                    "integrations.lightning"),
}
# Top-level names of 0.1 that now live only in their subpackage's __all__: still importable from here for
# one more release, with a DeprecationWarning that says where they went.
_MOVED = {
    "HostBufferPool": "storage", "IOEngine": "storage", "TensorStore": "storage",
    "ActivationSwapper": "activations", "Policy": "activations", "SwapStats": "activations",
    "StepStats": "optim",
}


def _register_with_lightning() -> None:
    """Register ``strategy="fuyou"`` with Lightning's Trainer and Fabric (Lightning is imported): importing
    ``fuyou_strategy.integrations.lightning`` registers it, at the module's end."""
    if any(f"{__name__}.integrations.{name}" in sys.modules for name in ("lightning", "lightning_internals")):
        return  # Lightning was imported by our integration's own import, which registers once it is complete
    try:
        importlib.import_module(".integrations.lightning", __name__)
    except MissingExtraError:  # a partial install: the names raise the install line
        pass
    except ImportError as error:  # Lightning broken: the core still works; the names raise this again
        warnings.warn(f'strategy="fuyou" is not registered: importing Lightning failed: {error}', RuntimeWarning,
                      stacklevel=2)


class _RegisterWhenLightningLoads(importlib.abc.MetaPathFinder):
    """[Note: registering without importing Lightning] Lightning finds a strategy by name in its registry, and
    only code that runs can fill it; importing Lightning here would cost every ``import fuyou_strategy`` (and
    the ``fuyou`` command) torch and seconds. So this finder waits for ``import lightning`` (``lightning.pytorch``
    or ``lightning.fabric`` import it first), lets Lightning's own loader run it, then registers: once, in
    either import order. It leaves ``sys.meta_path`` after its one use."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "lightning":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister(importlib.abc.Loader):
    """Lightning's loader, registering ``"fuyou"`` once it has run the module."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self.loader
        self.loader.exec_module(module)
        _register_with_lightning()

    def __getattr__(self, name: str) -> Any:  # the rest of the loader's interface (resource readers, ...)
        return getattr(self.loader, name)


if "lightning" in sys.modules:
    _register_with_lightning()
elif importlib.util.find_spec("lightning") is not None:
    sys.meta_path.insert(0, _RegisterWhenLightningLoads())


def __getattr__(name: str) -> Any:
    if name in _LAZY:  # a missing framework raises its install line here
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _MOVED:
        where = f"{__name__}.{_MOVED[name]}"
        warnings.warn(f"{__name__}.{name} moved to {where}: import it from there (the top-level name will be removed)",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(where), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
