"""The order every decoder model is parallelized in: TP -> AC -> compile -> data parallel.

A model's `parallelize.py` supplies what is its own (its TP plan and its AC save list) and
calls `parallelize_decoder`, so the order and the checks live in one place.
"""

from collections.abc import Callable

import torch
import torch.nn as nn

from torchtitan.components.compile import apply_compile, model_compile_enabled
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import ConfigError
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.data_parallel import apply_data_parallel
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import (
    check_tp_divisibility,
    loss_parallel_enabled,
    maybe_enable_async_tp,
)


def parallelize_decoder(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    *,
    apply_tp: Callable | None,
    op_sac_save_list: frozenset,
    use_flex_attn: bool = False,
) -> nn.Module:
    """Apply TP, `[activation_checkpoint]`, `[compile]` and data parallelism in place.

    Args:
        model: a decoder with `args` (n_heads, kv_heads, tie_word_embeddings) and `layers`.
        apply_tp: `(model, tp_mesh, loss_parallel) -> None`, the model's TP plan; None when
            the model has none yet, which refuses tensor_parallel_degree > 1.
        op_sac_save_list: the model's op-SAC save list (see `activation_checkpoint.save_list`).
        use_flex_attn: whether attention runs flex_attention (changes op-SAC wrapping).

    Pitfall: the order matters. AC wraps after TP so that the per-op policy sees TP's
    collectives, compile sees the wrapped blocks, and FSDP's hooks stay outside AC.
    """
    compile_model = model_compile_enabled(job_config)
    maybe_enable_async_tp(parallel_dims, job_config, device)
    if parallel_dims.tp_enabled:
        if apply_tp is None:
            raise ConfigError(
                f"tensor parallelism for model '{job_config.model.name}' is not supported yet; set "
                "parallelism.tensor_parallel_degree = 1."
            )
        args = model.args
        if args.tie_word_embeddings:
            raise ConfigError(
                f"flavor '{job_config.model.flavor}' ties its embeddings, which tensor parallelism "
                "does not support yet; set parallelism.tensor_parallel_degree = 1."
            )
        check_tp_divisibility(parallel_dims, job_config, args.n_heads, args.kv_heads)
        apply_tp(model, parallel_dims.mesh["tp"], loss_parallel_enabled(parallel_dims, job_config))
    apply_ac(
        model,
        job_config.activation_checkpoint,
        model_compile_enabled=compile_model,
        use_flex_attn=use_flex_attn,
        op_sac_save_list=op_sac_save_list,
        base_folder=job_config.job.dump_folder,
    )
    if compile_model:
        apply_compile(model, job_config)
    apply_data_parallel(model, parallel_dims, job_config, device)
    return model
