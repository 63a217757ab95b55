"""Activation swapping: block discovery, per-block policies, saved-tensor hooks."""

from .blocks import Policy, discover_blocks, resolve_policies
from .swap import ActivationSwapper, SwapStats

__all__ = ["ActivationSwapper", "Policy", "SwapStats", "discover_blocks", "resolve_policies"]
