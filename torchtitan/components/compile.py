"""torch.compile of each transformer block, shared by every model's parallelize.py."""

import hashlib
import logging
import re

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.tools.dtypes import TORCH_DTYPES
from torchtitan.tools.grouped_mm import probe_grouped_mm_for_compile

logger = logging.getLogger(__name__)


def _has_moe(block: nn.Module) -> bool:
    return any(hasattr(module, "moe") for module in block.modules())


# Before this release inductor fails on a checkpointed MoE block traced with
# capture_scalar_outputs (unbacked-symbol errors under full, op-SAC and memory_budget AC);
# checked on 2.11, fixed in 2.12.
_FIRST_TORCH_TO_COMPILE_CHECKPOINTED_SCALARS = (2, 12)
# From this release the partitioner leaves opaque inputs (the TP DeviceMesh) out of the tensors
# saved for backward, so compiled blocks under full AC and TP run again; checked on 2.14.1 (2.14.0
# was not run, so it stays refused).
_FIRST_TORCH_TO_RECOMPUTE_WITH_MESH_INPUTS = (2, 14, 1)


def _release(torch_version: str) -> tuple[int, ...]:
    """``"2.14.1+cu130"`` as ``(2, 14, 1)``; pre-release and local tags are dropped."""
    numbers = torch_version.split("+")[0].split(".")[:3]
    return tuple(int(re.match(r"\d*", n).group() or 0) for n in numbers)


def compiles_checkpointed_scalars(torch_version: str = torch.__version__) -> bool:
    """Whether this torch compiles checkpointed MoE blocks with capture_scalar_outputs."""
    return _release(torch_version)[:2] >= _FIRST_TORCH_TO_COMPILE_CHECKPOINTED_SCALARS


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


def check_compile_supported(model: nn.Module, job_config: JobConfig, torch_version: str = torch.__version__):
    """Refuse compile settings that this torch is known to get wrong (ConfigError, exit code 2)."""
    _refuse_block_ac_of_tensor_parallel(job_config, torch_version)
    c, ac = job_config.compile, job_config.activation_checkpoint
    if not (c.capture_scalar_outputs and ac.mode != "none" and _has_moe(model)):
        return
    if not compiles_checkpointed_scalars(torch_version):
        need = ".".join(map(str, _FIRST_TORCH_TO_COMPILE_CHECKPOINTED_SCALARS))
        raise ConfigError(
            f"'compile.capture_scalar_outputs' = true with 'activation_checkpoint.mode' = '{ac.mode}' "
            f"on MoE blocks fails inside inductor in torch {torch_version}. Set "
            f"compile.capture_scalar_outputs = false (the MoE blocks then fall back where they read "
            f"counts on the host), or use torch >= {need}."
        )


def _refuse_block_ac_of_tensor_parallel(job_config: JobConfig, torch_version: str) -> None:
    """Full AC (or selective N) of compiled blocks under tensor parallelism fails in the first
    step where torch passes the TP DeviceMesh into compiled graphs as an opaque object and does
    not yet keep it out of the saved tensors (torch 2.13 here; 2.11, which passes no mesh, and
    2.14.1 run it): the recomputed attention kernel, which torch tags as random for its dropout,
    gets its RNG state saved after the mesh, where AOTAutograd expects only tensors
    ("AssertionError: expected all tensors_saved_with_vc_check to be Tensors"). Checked when
    blocks compile, not when the config is parsed, so the memory estimator (which runs the
    step eagerly) still takes such configs (the Llama 3 405B preset is one)."""
    ac, tp = job_config.activation_checkpoint, job_config.parallelism.tensor_parallel_degree
    wraps_whole_blocks = ac.mode == "full" or (ac.mode == "selective" and ac.selective_ac_option != "op")
    fixed = _release(torch_version) >= _FIRST_TORCH_TO_RECOMPUTE_WITH_MESH_INPUTS
    if not (wraps_whole_blocks and tp > 1 and compile_sees_device_meshes()) or fixed:
        return
    mode = f"'{ac.mode}'"
    if ac.mode == "selective":
        mode += f" with 'activation_checkpoint.selective_ac_option' = '{ac.selective_ac_option}'"
    raise ConfigError(
        f"'activation_checkpoint.mode' = {mode} with compile.enable and "
        f"'parallelism.tensor_parallel_degree' = {tp} fails in torch {torch_version}'s compiler "
        "(it saves the tensor-parallel DeviceMesh among the tensors for backward when it "
        'recomputes attention). Set mode = "selective" and selective_ac_option = "op" (both: the '
        'option\'s default is "2"), or mode = "memory_budget", or compile.enable = false; torch '
        "2.11 and torch >= 2.14.1 run this combination."
    )


def compile_sees_device_meshes() -> bool:
    """Whether this torch registers DeviceMesh as an opaque type, so that a mesh a module's
    hook holds becomes an input of the compiled graph."""
    import torch.distributed.device_mesh

    return hasattr(torch.distributed.device_mesh, "_register_distributed_opaque_types")


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
    check_compile_supported(model, job_config)
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
    for name, block in list(model.layers.named_children()):
        fullgraph = not _has_moe(block)
        kinds.add("full graph" if fullgraph else "graph breaks allowed (MoE)")
        compiled = torch.compile(block, backend=checked_backend(job_config), fullgraph=fullgraph)
        model.layers.register_module(name, compiled)
    logger.info(
        f"Compiled each transformer block with torch.compile ({job_config.compile.backend}; "
        f"{', '.join(sorted(kinds))}; capture_scalar_outputs {job_config.compile.capture_scalar_outputs})"
    )
