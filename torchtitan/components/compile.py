"""torch.compile of each transformer block, shared by every model's parallelize.py."""

import logging

import torch
import torch.nn as nn

from torchtitan.config.job_config import JobConfig

logger = logging.getLogger(__name__)


def model_compile_enabled(job_config: JobConfig) -> bool:
    return job_config.compile.enable and "model" in job_config.compile.components


def apply_compile(model: nn.Module, job_config: JobConfig, fullgraph: bool = True) -> None:
    """Compile each block of `model.layers` in place (after AC wrapping, before FSDP).

    Per-block compilation reuses one compiled graph for identical blocks, so compile time
    does not grow with depth.
    """
    for name, block in list(model.layers.named_children()):
        compiled = torch.compile(block, backend=job_config.compile.backend, fullgraph=fullgraph)
        model.layers.register_module(name, compiled)
    logger.info(f"Compiled each transformer block with torch.compile ({job_config.compile.backend})")
