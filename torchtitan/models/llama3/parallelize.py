"""Llama 3 parallelization: its TP plan and AC save list; the order is `parallelize_decoder`'s."""

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import MOE_ONLY_OPS, save_list
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import parallelize_decoder
from torchtitan.distributed.tensor_parallel import apply_tp_to_ends, mlp_plan

# A dense model never routes tokens: MoE routing and the expert all-to-all are dropped. The
# default keeps reduce_scatter, so op-SAC saves what sequence parallelism scatters.
LLAMA3_SAVE_LIST = save_list(drop=MOE_ONLY_OPS)


def apply_tp(model: nn.Module, tp_mesh, loss_parallel: bool) -> None:
    """Megatron-style TP with sequence parallelism over `tp_mesh`, in place.

    Norms and residuals run on sequence shards (Shard(1)); attention and the feed-forward
    gather the sequence, run column-wise then row-wise sharded linears over local heads, and
    reduce-scatter back to sequence shards (an MoE block's MLP follows `mlp_plan`, so models
    that reuse this plan get MoE TP too). With loss parallel the logits stay vocab-sharded.
    """
    apply_tp_to_ends(model, tp_mesh, loss_parallel)
    attention_plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, attention_plan | mlp_plan(block, tp_mesh.size()))


def parallelize_llama(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig, device: torch.device, **options
) -> nn.Module:
    """Apply TP, `[activation_checkpoint]`, `[compile]` and data parallelism to `model` in place;
    `options`: `parallelize_decoder`'s."""
    return parallelize_decoder(
        model,
        parallel_dims,
        job_config,
        device,
        apply_tp=apply_tp,
        op_sac_save_list=LLAMA3_SAVE_LIST,
        use_flex_attn=model.args.attn_backend == "flex",
        **options,
    )
