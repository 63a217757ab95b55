"""Compute weights: streaming each block's weights from host memory or SSD, loading a checkpoint lazily."""

from .pretrained import SafetensorsInit
from .streaming import DeviceMeter, StreamStats, Tier, WeightStreamer

__all__ = ["DeviceMeter", "SafetensorsInit", "StreamStats", "Tier", "WeightStreamer"]
