"""DeepSeek-V3 parallelization: its AC save list and (for now) a refusal of tensor
parallelism; the order is `parallelize_decoder`'s."""

import torch
import torch.nn as nn

from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import ConfigError
from torchtitan.distributed.activation_checkpoint import save_list
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import parallelize_decoder

# Every flavor has MoE blocks, so op-SAC keeps the default's routing topk and expert
# all-to-all: a recompute must route exactly as the forward did. The router gate's matmul is
# recomputed through the default per_op_sac_force_recompute_mm_shapes_by_fqns.
DEEPSEEK_V3_SAVE_LIST = save_list()


def apply_tp(model: nn.Module, tp_mesh, loss_parallel: bool) -> None:
    """Refuses: MLA needs its own TP plan (wkv_a/kv_norm replicated, wkv_b and wq/wq_b
    colwise, wo rowwise), which is not written yet."""
    raise ConfigError(
        "tensor parallelism for DeepSeek-V3 (multi-head latent attention) is not supported yet; "
        "set parallelism.tensor_parallel_degree = 1."
    )


def parallelize_deepseek_v3(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig, device: torch.device
) -> nn.Module:
    """Apply `[activation_checkpoint]`, `[compile]` and data parallelism to `model` in place."""
    return parallelize_decoder(
        model, parallel_dims, job_config, device, apply_tp=apply_tp, op_sac_save_list=DEEPSEEK_V3_SAVE_LIST
    )
