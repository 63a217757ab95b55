"""The out-of-core optimizer: `FuyouAdamW` and the chunk pipeline it runs on."""

from .adamw import FuyouAdamW, StepStats
from .pipeline import ChunkJob, ChunkPipeline, PipelineError

__all__ = ["ChunkJob", "ChunkPipeline", "FuyouAdamW", "PipelineError", "StepStats"]
