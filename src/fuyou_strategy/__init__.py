"""fuyou-strategy: fine-tune models larger than GPU memory on one machine, with NVMe SSDs.

An implementation of Fuyou (Liao et al., arXiv 2403.06504).
"""

from .config import ConfigError, FuyouConfig
from .optim import FuyouAdamW, StepStats
from .storage import HostBufferPool, IOEngine, TensorStore

__version__ = "0.1.0"
__all__ = ["ConfigError", "FuyouAdamW", "FuyouConfig", "StepStats", "HostBufferPool", "IOEngine", "TensorStore", "__version__"]
