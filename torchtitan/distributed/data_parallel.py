"""Data parallelism shared by every model: FSDP2/HSDP (`fully_shard` per block, then the root),
or DDP (the composable `replicate`) when ranks replicate without sharding."""

import dataclasses
import logging

import torch
import torch.nn as nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.torch_version import TorchVersion

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.expert_parallel import mark_expert_params
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.tools.dtypes import TORCH_DTYPES

logger = logging.getLogger(__name__)


def _reshard_policy(setting: str, pipelined: bool = False) -> tuple[bool, bool, bool]:
    """(blocks, last block, root) reshard_after_forward for `parallelism.fsdp_reshard_after_forward`.

    "default" frees each block's gathered weights after its forward, except those of the last
    block and the root (norm, output): backward needs them first, so freeing them would only
    make FSDP gather them again at once. The embedding, which backward needs last, is freed as
    a block is (see `apply_fsdp`). Under pipeline parallelism (`pipelined`) "default" frees
    nothing, as torchtitan: a stage runs the forwards of several microbatches before their
    backwards, and freeing would gather its weights again for each one.
    """
    policies = {"default": (True, False, False), "always": (True, True, True), "never": (False, False, False)}
    if setting == "default" and pipelined:
        return policies["never"]
    return policies[setting]


def data_parallel_mesh(parallel_dims: ParallelDims) -> DeviceMesh:
    """The mesh FSDP shards over: 1-D dp_shard, or 2-D (dp_replicate, dp_shard) for HSDP; under
    context parallelism dp_shard_cp in place of dp_shard."""
    if parallel_dims.dp_replicate > 1:
        return parallel_dims.submesh("hsdp")
    return parallel_dims.submesh(parallel_dims.fsdp_mesh_name())


def apply_fsdp(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    experts: list[nn.Module] = (),
) -> None:
    """Shard `model` in place: the embedding and each block of `model.layers` are FSDP units,
    the rest (final norm, output) the root. With tied embeddings (no `model.output`) the
    embedding is the output projection too, and stays in the root. A pipeline stage's model
    may lack any of these parts; each stage is a root of its own.

    `experts` (the expert-parallel `GroupedExperts`, already split over "ep") become FSDP units
    of their own over `parallel_dims.expert_dp_mesh()`. When no other rank holds the same
    experts (expert_dp_degree 1) they stay local Parameters instead (plain, or TP DTensors),
    neither sharded nor gathered nor reduced by FSDP, nor cast by its mixed-precision policy.

    Mixed precision follows `training.mixed_precision_param/_reduce`; CPU offload follows
    `training.enable_cpu_offload` (see `_check_cpu_offload`).
    """
    t = job_config.training
    kwargs = {
        "mesh": data_parallel_mesh(parallel_dims),
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=TORCH_DTYPES[t.mixed_precision_param],
            reduce_dtype=TORCH_DTYPES[t.mixed_precision_reduce],
        ),
    }
    if t.enable_cpu_offload:
        kwargs["offload_policy"] = cpu_offload_policy(job_config)
    policy = job_config.parallelism.fsdp_reshard_after_forward
    reshard_blocks, reshard_last, reshard_root = _reshard_policy(policy, parallel_dims.pp_enabled)
    blocks = list(model.layers.values())

    def reshard(module: nn.Module) -> bool:
        in_last_block = any(module is m for m in blocks[-1].modules())
        return reshard_last if in_last_block else reshard_blocks

    if experts and parallel_dims.expert_dp_degree > 1:
        expert_kwargs = {**kwargs, "mesh": parallel_dims.expert_dp_mesh()}
        for module in experts:
            fully_shard(module, reshard_after_forward=reshard(module), **expert_kwargs)
            mark_expert_params(module)
    elif experts:
        # Every unit needs them: the root would otherwise take the blocks' ignored ones.
        kwargs["ignored_params"] = {p for module in experts for p in module.parameters()}
    if model.tok_embeddings is not None and model.output is not None:
        # Its own unit, freed after its forward: in the root it stayed gathered through the
        # whole step, at the peak too (1 GiB per rank for Llama 3 8B in bf16).
        fully_shard(model.tok_embeddings, reshard_after_forward=reshard_blocks, **kwargs)
    # A block's inputs are the activations, already in param_dtype (the embedding's weight is),
    # and the RoPE table, which must stay fp32: cast, its angles lose precision at long range
    # (cos/sin off by up to 2e-3 at 4096 positions in bf16).
    uncast = dataclasses.replace(kwargs["mp_policy"], cast_forward_inputs=False)
    block_kwargs = {**kwargs, "mp_policy": uncast}
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard(block), **block_kwargs)
    fully_shard(model, reshard_after_forward=reshard_root, **kwargs)


def apply_ddp(model: nn.Module, parallel_dims: ParallelDims) -> None:
    """Replicate `model` over dp_replicate; gradients are all-reduced in buckets during backward.

    DDP has no mixed-precision policy: the trainer autocasts instead.
    """
    replicate(model, device_mesh=parallel_dims.submesh("dp_replicate"), bucket_cap_mb=100)


def set_gradient_sync(model: nn.Module, parallel_dims: ParallelDims, sync: bool) -> None:
    """Whether the next backward reduces gradients across data-parallel replicas.

    With gradient accumulation only the last micro-batch of a step needs to. DDP then
    all-reduces the summed local gradients once per step instead of once per micro-batch, and
    HSDP skips its all-reduce across replicas (the reduce-scatter within a replica still runs
    every micro-batch, so gradients stay sharded). Plain FSDP is left alone: skipping its
    reduce-scatter would hold unsharded gradients, trading memory for communication.

    Pitfall: call it before the forward, not just before backward; DDP reads it there.
    """
    if parallel_dims.fsdp_enabled and parallel_dims.dp_replicate > 1:
        model.set_requires_all_reduce(sync)
    elif parallel_dims.ddp_enabled:
        model.set_requires_gradient_sync(sync)


def apply_data_parallel(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    experts: list[nn.Module] = (),
) -> None:
    """FSDP/HSDP when dp_shard > 1, DDP when only dp_replicate > 1, else nothing.

    `experts` (FSDP only): the expert-parallel experts, see `apply_fsdp`.
    """
    _check_cpu_offload(job_config.training.enable_cpu_offload, parallel_dims, device)
    if parallel_dims.fsdp_enabled:
        apply_fsdp(model, parallel_dims, job_config, device, experts)
    elif parallel_dims.ddp_enabled:
        apply_ddp(model, parallel_dims)


def cpu_offload_policy(job_config: JobConfig, torch_version: str = torch.__version__) -> CPUOffloadPolicy:
    """FSDP's offload policy for `training.enable_cpu_offload`: pinned host memory, except where
    `optimizer.early_step_in_backward` is on and torch is older than 2.13.

    Pitfall: with pinned memory FSDP copies each reduced gradient to the host without waiting,
    and before torch 2.13 it ran the post-accumulate-grad hooks, where the early step runs,
    before that copy was done, so the optimizer stepped on a gradient still being written.
    Unpinned, the copy finishes first (slower host copies, right updates).
    """
    waits_for_hooked_grads = TorchVersion(torch_version) >= (2, 13)
    if job_config.optimizer.early_step_in_backward and not waits_for_hooked_grads:
        logger.warning(
            f"'training.enable_cpu_offload' with 'optimizer.early_step_in_backward' on torch "
            f"{torch_version}: offloading to unpinned host memory, because this torch's FSDP would "
            "step on gradients still being copied to pinned memory (fixed in torch 2.13)."
        )
        return CPUOffloadPolicy(pin_memory=False)
    return CPUOffloadPolicy()


def _check_cpu_offload(enabled: bool, parallel_dims: ParallelDims, device: torch.device) -> None:
    """CPU offload is FSDP's, from an accelerator: refused, not ignored, anywhere else."""
    if not enabled:
        return
    if device.type == "cpu":
        raise ConfigError(
            "'training.enable_cpu_offload' = true offloads from an accelerator to the CPU, but "
            "this run has no accelerator; remove the key."
        )
    if not parallel_dims.fsdp_enabled:
        raise ConfigError(
            "'training.enable_cpu_offload' = true offloads FSDP-sharded parameters, but this run "
            f"does not shard them (data_parallel_shard_degree {parallel_dims.dp_shard}); remove the "
            "key, or train on more processes with data_parallel_shard_degree > 1."
        )
