"""torch.compile of each transformer block, shared by every model's parallelize.py."""

import hashlib
import logging

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.tools.dtypes import TORCH_DTYPES
from torchtitan.tools.grouped_mm import probe_grouped_mm_for_compile

logger = logging.getLogger(__name__)


def _has_moe(model: nn.Module) -> bool:
    """Whether a block of `model.layers` (a `DecoderBlock`, wrapped by AC or not) has an MoE."""
    return any(block.is_moe for block in model.layers.children())


def checked_backend(job_config: JobConfig) -> str:
    """`compile.backend`, once torch.compile is known to have it (ConfigError otherwise, which
    torch would raise as a traceback at the first compile)."""
    backend = job_config.compile.backend
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ConfigError(
            f"'compile.backend' = '{backend}' is not a torch.compile backend of torch {torch.__version__}; "
            f"use one of {', '.join(torch._dynamo.list_backends())} ('inductor' is the default)."
        )
    return backend


def tag_compile_caches_with_process_groups() -> None:
    """Key torch.compile's on-disk caches (FX graph, AOT autograd) by this rank's process groups.

    A compiled graph with collectives names its process groups, and the caches do not tell
    groups apart by name: a run of another layout (or another rank position) sharing the
    cache directory was handed code naming groups it does not have, and failed with "Could not
    resolve the process group registered under the name N" (seen with torch 2.13, a compiled
    loss under loss_parallel after a run of another TP layout). The tag, a digest of every
    group's name and ranks, sets `torch.compiler.config.cache_key_tag`, so a cached graph is
    reused only where the same names mean the same groups.

    Call once every process group the compiled code uses exists (after the mesh is built)
    and before the first compiled call. No-op without a process group.
    """
    if not dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _world

    groups = sorted((str(pg.group_name), tuple(dist.get_process_group_ranks(pg))) for pg in _world.pg_names)
    digest = hashlib.sha256(repr(groups).encode()).hexdigest()[:16]
    torch.compiler.config.cache_key_tag = f"torchtitan-process-groups-{digest}"


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
    # An MoE forward adds its routed counts and sets its aux loss once per step, and skips both
    # in an AC recompute (`moe._in_backward`). This flag lets dynamo trace those writes inside
    # a checkpointed block with that same meaning; without it they break the graph and the
    # whole checkpointed block runs eagerly.
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    t = job_config.training
    # Both dtypes are probed now, since a probe first reached while tracing breaks the graph;
    # the experts compute in the mixed-precision dtype (FSDP's param dtype, or autocast's).
    probe_grouped_mm_for_compile(device, {TORCH_DTYPES[t.dtype], TORCH_DTYPES[t.mixed_precision_param]})
    grouped = probe_grouped_mm_for_compile(device, {TORCH_DTYPES[t.mixed_precision_param]})
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
    backend = checked_backend(job_config)
    for name, block in list(model.layers.named_children()):
        fullgraph = not block.is_moe
        kinds.add("full graph" if fullgraph else "graph breaks allowed (MoE)")
        compiled = torch.compile(block, backend=backend, fullgraph=fullgraph)
        model.layers.register_module(name, compiled)
    logger.info(
        f"Compiled each transformer block with torch.compile ({job_config.compile.backend}; "
        f"{', '.join(sorted(kinds))}; capture_scalar_outputs {job_config.compile.capture_scalar_outputs})"
    )
