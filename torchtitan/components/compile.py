"""torch.compile of each transformer block, shared by every model's parallelize.py."""

import logging

import torch
import torch.nn as nn

from torchtitan.config.job_config import JobConfig
from torchtitan.tools.dtypes import TORCH_DTYPES
from torchtitan.tools.grouped_mm import probe_grouped_mm_for_compile

logger = logging.getLogger(__name__)


def model_compile_enabled(job_config: JobConfig) -> bool:
    return job_config.compile.enable and "model" in job_config.compile.components


def _has_moe(block: nn.Module) -> bool:
    return any(hasattr(module, "moe") for module in block.modules())


def apply_compile(model: nn.Module, job_config: JobConfig, device: torch.device) -> None:
    """Compile each block of `model.layers` in place (after AC wrapping, before FSDP).

    Per-block compilation reuses one compiled graph for identical blocks, so compile time
    does not grow with depth. Dense blocks compile as one full graph; blocks with an MoE
    allow graph breaks, since routing's data-dependent sizes (and expert parallelism's host
    reads of split sizes) break the graph unless `compile.capture_scalar_outputs` lets
    dynamo trace them.
    """
    capture = job_config.compile.capture_scalar_outputs
    torch._dynamo.config.capture_scalar_outputs = capture
    t = job_config.training
    grouped = probe_grouped_mm_for_compile(
        device, {TORCH_DTYPES[t.dtype], TORCH_DTYPES[t.mixed_precision_param]}
    )
    moe_reads_host = not grouped or job_config.parallelism.expert_parallel_degree > 1
    if _has_moe(model) and moe_reads_host and not capture:
        logger.warning(
            "MoE blocks read token counts on the host (expert-parallel split sizes, or the expert "
            "loop where grouped matmul cannot be traced for this dtype). With "
            "compile.capture_scalar_outputs = false that read breaks the graph, and inside an "
            "activation checkpoint the whole block then runs eagerly: same numbers, no speed-up. "
            "Set compile.capture_scalar_outputs = true to compile those blocks."
        )
    kinds = set()
    for name, block in list(model.layers.named_children()):
        fullgraph = not _has_moe(block)
        kinds.add("full graph" if fullgraph else "graph breaks allowed (MoE)")
        compiled = torch.compile(block, backend=job_config.compile.backend, fullgraph=fullgraph)
        model.layers.register_module(name, compiled)
    logger.info(
        f"Compiled each transformer block with torch.compile ({job_config.compile.backend}; "
        f"{', '.join(sorted(kinds))}; capture_scalar_outputs {job_config.compile.capture_scalar_outputs})"
    )
