"""Qwen3 parallelization: its TP plan (Llama 3's plus the qk-norms) and AC save list; the order
is `parallelize_decoder`'s."""

import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import MOE_ONLY_OPS, save_list
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import parallelize_decoder
from torchtitan.models.llama3.parallelize import apply_tp as apply_llama3_tp

# Dense Qwen3 never routes tokens, so like Llama 3 it drops the MoE routing and expert
# all-to-all ops; the qk-norms are cheap elementwise work and are recomputed. The default keeps
# the sequence-parallel reduce-scatter (op-SAC under TP re-issues only the all-gathers, see
# TP_ALL_GATHER_OPS).
QWEN3_SAVE_LIST = save_list(drop=MOE_ONLY_OPS)
# MoE flavors keep the default's routing topk and expert all-to-all: recompute must route
# exactly as the forward did. The router gate's matmul is recomputed rather than counted,
# through the default per_op_sac_force_recompute_mm_shapes_by_fqns (its "moe.router.gate").
QWEN3_MOE_SAVE_LIST = save_list()

# q_norm/k_norm run after the column-wise wq/wk, on the rank's local heads laid out as
# (batch, seq, local heads, head_dim). Declaring that input as sharded on the heads dim keeps
# the weights replicated, makes their gradient the sum over all heads (all-reduced over TP),
# and hands a local tensor back to RoPE and attention, as without TP.
QK_NORM_TP_PLAN = {
    "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
}


def apply_tp(model: nn.Module, tp_mesh, loss_parallel: bool) -> None:
    """Megatron-style TP with sequence parallelism over `tp_mesh`, in place.

    The embedding, norms, projections and feed-forward or MoE follow Llama 3's plan (same module
    names); the qk-norms are added on top of it.
    """
    apply_llama3_tp(model, tp_mesh, loss_parallel)
    if model.args.qk_norm:
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, QK_NORM_TP_PLAN)


def parallelize_qwen3(
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
        op_sac_save_list=QWEN3_SAVE_LIST if model.args.moe_args is None else QWEN3_MOE_SAVE_LIST,
        use_flex_attn=model.args.attn_backend == "flex",
        **options,
    )
