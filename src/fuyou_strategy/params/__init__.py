"""Compute weights: streaming a block's frozen weights from host memory or SSD."""

from .streaming import StreamStats, Tier, WeightStreamer

__all__ = ["StreamStats", "Tier", "WeightStreamer"]
