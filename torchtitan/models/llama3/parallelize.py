"""Llama 3 parallelization: AC -> compile -> FSDP (tensor parallelism will precede AC)."""

import torch
import torch.nn as nn

from torchtitan.components.compile import apply_compile, model_compile_enabled
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import MOE_ONLY_OPS, apply_ac, save_list
from torchtitan.distributed.data_parallel import apply_fsdp
from torchtitan.distributed.parallel_dims import ParallelDims

# A dense model never routes tokens: MoE routing and the expert all-to-all are dropped.
LLAMA3_SAVE_LIST = save_list(drop=MOE_ONLY_OPS)


def parallelize_llama(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig, device: torch.device
) -> nn.Module:
    """Apply `[activation_checkpoint]`, `[compile]` and data parallelism to `model` in place."""
    compile_model = model_compile_enabled(job_config)
    apply_ac(
        model,
        job_config.activation_checkpoint,
        model_compile_enabled=compile_model,
        op_sac_save_list=LLAMA3_SAVE_LIST,
        base_folder=job_config.job.dump_folder,
    )
    if compile_model:
        apply_compile(model, job_config)
    if parallel_dims.dp_degree > 1:
        apply_fsdp(model, parallel_dims, job_config, device)
    return model
