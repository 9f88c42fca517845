"""DeepSeek-V3 parallelization: its TP plan (multi-head latent attention, then the shared MLP
plan) and AC save list; the order is `parallelize_decoder`'s."""

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
from torchtitan.distributed.activation_checkpoint import save_list
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import parallelize_decoder
from torchtitan.distributed.tensor_parallel import ReplicatedParams, SumGradOverTP, apply_tp_to_ends, mlp_plan

# Every flavor has MoE blocks, so op-SAC keeps the default's routing topk and expert
# all-to-all: a recompute must route exactly as the forward did. The router gate's matmul is
# recomputed through the default per_op_sac_force_recompute_mm_shapes_by_fqns.
DEEPSEEK_V3_SAVE_LIST = save_list()


def mla_plan(q_lora_rank: int) -> dict:
    """Multi-head latent attention over local heads: the query and key/value up-projections
    (wq or wq_b, wkv_b) column-wise by head, wo row-wise; the small down-projections and their
    norms (wq_a, q_norm, wkv_a, kv_norm) whole on every rank. The rotary key head is shared by
    all heads, so its gradient is summed over the ranks (`shared_rope_key`)."""
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wkv_a": ReplicatedParams(),
        "attention.kv_norm": ReplicatedParams(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.shared_rope_key": SumGradOverTP(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    if q_lora_rank == 0:
        return plan | {"attention.wq": ColwiseParallel()}
    return plan | {
        "attention.wq_a": ReplicatedParams(),
        "attention.q_norm": ReplicatedParams(),
        "attention.wq_b": ColwiseParallel(),
    }


def apply_tp(model: nn.Module, tp_mesh, loss_parallel: bool) -> None:
    """Megatron-style TP with sequence parallelism over `tp_mesh`, in place: Llama 3's
    embedding, final norm and output, `mla_plan` for attention, and `mlp_plan` (dense or MoE)."""
    apply_tp_to_ends(model, tp_mesh, loss_parallel)
    attention = mla_plan(model.args.q_lora_rank)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, attention | mlp_plan(block, tp_mesh.size()))


def parallelize_deepseek_v3(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig, device: torch.device, **options
) -> nn.Module:
    """Apply TP, EP, `[activation_checkpoint]`, `[compile]` and data parallelism to `model` in place;
    `options`: `parallelize_decoder`'s."""
    return parallelize_decoder(
        model,
        parallel_dims,
        job_config,
        device,
        apply_tp=apply_tp,
        op_sac_save_list=DEEPSEEK_V3_SAVE_LIST,
        use_flex_attn=model.args.attn_backend == "flex",
        **options,
    )
