"""Process groups, meshes, data parallelism and activation checkpointing."""

from torchtitan.distributed.parallel_dims import ParallelDims

__all__ = ["ParallelDims"]
