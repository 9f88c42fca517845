"""Tensor-parallel pieces shared by every model: loss parallel and async TP.

Each model's TP plan lives in its own `parallelize.py`; what is the same for all of them
lives here.
"""

import contextlib

import torch
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import ConfigError
from torchtitan.distributed.parallel_dims import ParallelDims


def loss_parallel_enabled(parallel_dims: ParallelDims, job_config: JobConfig) -> bool:
    """Cross-entropy runs on vocab-sharded logits (no gather) under TP unless disabled."""
    return parallel_dims.tp_enabled and not job_config.parallelism.disable_loss_parallel


def loss_context(parallel_dims: ParallelDims, job_config: JobConfig):
    """The context that loss computation and backward must run in (loss_parallel or nothing)."""
    if loss_parallel_enabled(parallel_dims, job_config):
        return loss_parallel()
    return contextlib.nullcontext()


def check_tp_divisibility(
    parallel_dims: ParallelDims, job_config: JobConfig, n_heads: int, n_kv_heads: int
) -> None:
    """Refuse a TP degree that does not divide the head counts or the sequence length."""
    tp = parallel_dims.tp
    for what, value in (("attention heads", n_heads), ("kv heads", n_kv_heads),
                        ("training.seq_len", job_config.training.seq_len)):  # fmt: skip
        if value % tp:
            raise ConfigError(
                f"'parallelism.tensor_parallel_degree' = {tp} does not divide the {value} {what} of "
                f"flavor '{job_config.model.flavor}'; choose a degree that divides {value}."
            )


def maybe_enable_async_tp(parallel_dims: ParallelDims, job_config: JobConfig, device: torch.device) -> None:
    """Turn on async TP (compute/communication overlap done by inductor) when asked.

    It is a compiler pass over symmetric-memory collectives, so it needs compile and CUDA.
    """
    if not job_config.parallelism.enable_async_tensor_parallel:
        return
    from torchtitan.components.compile import model_compile_enabled

    if not parallel_dims.tp_enabled or not model_compile_enabled(job_config) or device.type != "cuda":
        raise ConfigError(
            "'parallelism.enable_async_tensor_parallel' = true needs tensor_parallel_degree > 1, "
            'compile.enable = true with "model" in compile.components, and CUDA devices; this run '
            f"has tp {parallel_dims.tp}, compile {model_compile_enabled(job_config)}, device "
            f"{device.type}. Remove the key or meet all three."
        )
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(parallel_dims.mesh["tp"].get_group().group_name)
