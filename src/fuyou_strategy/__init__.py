"""fuyou-strategy: fine-tune models larger than GPU memory on one machine, with NVMe SSDs.

An implementation of Fuyou (Liao et al., arXiv 2403.06504).
"""

from .activations import ActivationSwapper, Policy, SwapStats
from .config import ConfigError, FuyouConfig
from .optim import FuyouAdamW, StepStats
from .storage import HostBufferPool, IOEngine, TensorStore

__version__ = "0.1.0"
__all__ = [
    "ActivationSwapper", "ConfigError", "FuyouAdamW", "FuyouConfig", "HostBufferPool", "IOEngine", "Policy",
    "StepStats", "SwapStats", "TensorStore", "__version__",
]
