"""DeepSeek-V3 parallelization: its AC save list (no TP plan yet); the order is
`parallelize_decoder`'s."""

import torch
import torch.nn as nn

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import save_list
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import parallelize_decoder

# Every flavor has MoE blocks, so op-SAC keeps the default's routing topk and expert
# all-to-all: a recompute must route exactly as the forward did. The router gate's matmul is
# recomputed through the default per_op_sac_force_recompute_mm_shapes_by_fqns.
DEEPSEEK_V3_SAVE_LIST = save_list()


def parallelize_deepseek_v3(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig, device: torch.device
) -> nn.Module:
    """Apply `[activation_checkpoint]`, `[compile]` and data parallelism to `model` in place.

    No TP plan yet: multi-head latent attention needs its own (wkv_a/kv_norm replicated, wkv_b
    and wq/wq_b column-wise, wo row-wise), so tensor parallelism is refused.
    """
    return parallelize_decoder(
        model,
        parallel_dims,
        job_config,
        device,
        apply_tp=None,
        op_sac_save_list=DEEPSEEK_V3_SAVE_LIST,
        use_flex_attn=model.args.attn_backend == "flex",
    )
