"""The pieces of one training step that the trainer and the memory estimator share."""

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan.components.loss_head import ChunkedLoss
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.context_parallel import ContextParallel, sharded_or_whole
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_helpers import plain_tensor
from torchtitan.distributed.tensor_parallel import loss_context
from torchtitan.tools.dtypes import TORCH_DTYPES


def gradient_accumulation_steps(job_config: JobConfig, dp_degree: int) -> int:
    """Micro-batches per optimizer step: global batch / (local batch x dp degree).

    Raises:
        ConfigError: when the global batch is not a multiple of local batch x dp degree.
    """
    t = job_config.training
    per_micro_batch = t.local_batch_size * dp_degree
    global_batch = per_micro_batch if t.global_batch_size == -1 else t.global_batch_size
    if global_batch % per_micro_batch:
        raise ConfigError(
            f"'training.global_batch_size' = {global_batch} is not a multiple of "
            f"local_batch_size {t.local_batch_size} x data-parallel degree {dp_degree} = "
            f"{per_micro_batch}; choose a multiple."
        )
    return global_batch // per_micro_batch


def _autocast_dtype(job_config: JobConfig, parallel_dims: ParallelDims) -> str | None:
    """bf16 autocast for a run without FSDP; under FSDP its MixedPrecisionPolicy casts."""
    t = job_config.training
    if parallel_dims.fsdp_enabled or t.mixed_precision_param == t.dtype:
        return None
    return t.mixed_precision_param


def autocast_context(job_config: JobConfig, parallel_dims: ParallelDims, device: torch.device):
    dtype = _autocast_dtype(job_config, parallel_dims)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=TORCH_DTYPES[dtype])


def describe_layout(job_config: JobConfig, parallel_dims: ParallelDims) -> str:
    """One line naming the ranks, their split, the data parallelism and the dtypes, e.g.
    "8 rank(s): dp_replicate 2 x dp_shard 2 x tp 2, HSDP; float32 weights, params bfloat16,
    reduce float32"; under pipeline parallelism the split starts with "pp N x", and context
    parallelism adds "x cp N" before tp. Expert
    parallelism borrows its ranks from dp_shard, so it is shown there, or after tp when it
    borrows the CP or TP ranks too."""
    d, t = parallel_dims, job_config.training
    ep_in_shard = d.ep_enabled and not (d.ep_borrows_tp or d.cp_enabled)
    ep = f" (ep {d.ep})" if ep_in_shard else ""
    cp = f" x cp {d.cp}" if d.cp_enabled else ""
    split = f"dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard}{ep}{cp} x tp {d.tp}"
    if d.ep_enabled and not ep_in_shard:
        split += f" (ep {d.ep} = {d.ep_parts()})"
    if d.pp_enabled:
        split = f"pp {d.pp} x {split}"
    if d.fsdp_enabled:
        kind = "HSDP" if d.dp_replicate > 1 else "FSDP"
        precision = f"params {t.mixed_precision_param}, reduce {t.mixed_precision_reduce}"
    else:
        kind = "DDP" if d.ddp_enabled else "no data parallelism"
        autocast = _autocast_dtype(job_config, d)
        precision = f"{autocast} autocast" if autocast else "no autocast"
    return f"{d.world_size} rank(s): {split}, {kind}; {t.dtype} weights, {precision}"


def forward_backward(
    model: nn.Module,
    loss_fn: ChunkedLoss,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    accum_steps: int,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    *,
    extra_loss_fn,
    context_parallel: ContextParallel | None = None,
) -> torch.Tensor:
    """Forward, loss (scaled by 1/accum_steps) and backward of one micro-batch.

    The model computes the loss itself, with `loss_fn`, so that a chunked head never holds the
    whole logits (see `components.loss_head`).
    `extra_loss_fn(model)` returns a loss the model adds (e.g. MoE auxiliary losses) or None; it
    joins backward but not the returned loss. It is the spec's `extra_loss_fn`, required so that
    no caller (the trainer, the memory estimator) leaves a model's own losses out of backward;
    None for a model that adds none. Under `context_parallel` the model runs on this rank's
    share of each sequence, and the loss is the mean over those tokens (every rank holds as
    many, so FSDP's average over the ranks is the whole sequence's mean). Returns the detached
    scaled loss as a plain tensor on the device (no host sync).
    """
    sharded = sharded_or_whole(context_parallel, inputs, labels)
    with sharded as (inputs, labels), loss_context(parallel_dims, job_config):
        with autocast_context(job_config, parallel_dims, inputs.device):
            loss = model(inputs, labels, loss_fn) / accum_steps
        extra = extra_loss_fn(model) if extra_loss_fn is not None else None
        # Under loss parallel the loss is a (replicated) DTensor and the extra a local tensor.
        (loss if extra is None else plain_tensor(loss) + extra / accum_steps).backward()
    return plain_tensor(loss.detach())


def pipeline_forward_backward(
    pipeline, inputs: torch.Tensor, labels: torch.Tensor, parallel_dims: ParallelDims, job_config: JobConfig
) -> torch.Tensor:
    """`forward_backward` of one micro-batch under pipeline parallelism: the schedule runs its
    pipeline microbatches through this rank's stages. Returns the scaled loss on every rank of
    the pipeline (summed from the last stage, so that it is logged as one process logs it)."""
    with loss_context(parallel_dims, job_config), autocast_context(job_config, parallel_dims, inputs.device):
        loss = plain_tensor(pipeline.step(inputs, labels))
    dist.all_reduce(loss, group=pipeline.pp_group)
    return loss


def finite_or_raise(step: int, loss: float, grad_norm: float) -> None:
    """Stop at the first non-finite loss or gradient norm, naming the step, rather than train on
    (or checkpoint) the NaN weights the optimizer step made of them."""
    for name, value in (("loss", loss), ("gradient norm", grad_norm)):
        if not math.isfinite(value):
            raise FloatingPointError(
                f"{name} is {value} at step {step}, so the weights are no longer finite; lower "
                "optimizer.lr or check the data, then resume from the last checkpoint (none was "
                "written of this step)"
            )
