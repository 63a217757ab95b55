"""Compute weights: streaming each block's weights from host memory or SSD."""

from .streaming import DeviceMeter, StreamStats, Tier, WeightStreamer

__all__ = ["DeviceMeter", "StreamStats", "Tier", "WeightStreamer"]
