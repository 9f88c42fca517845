"""The order every decoder model is parallelized in: TP -> EP -> AC -> compile -> data parallel.

A model's `parallelize.py` supplies what is its own (its TP plan and its AC save list) and
calls `parallelize_decoder`, so the order and the checks live in one place.
"""

import logging
from collections.abc import Callable

import torch
import torch.nn as nn

from torchtitan.components.compile import apply_compile, checked_backend
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig, model_compile_enabled
from torchtitan.distributed.activation_checkpoint import ACFacts, plan_activation_checkpointing
from torchtitan.distributed.data_parallel import apply_data_parallel
from torchtitan.distributed.expert_parallel import apply_expert_parallel
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import splits_backward
from torchtitan.distributed.tensor_parallel import (
    check_tp_divisibility,
    loss_parallel_enabled,
    maybe_enable_async_tp,
    shard_experts_over_tp,
)

logger = logging.getLogger(__name__)


def parallelize_decoder(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    *,
    apply_tp: Callable | None,
    op_sac_save_list: frozenset,
    use_flex_attn: bool = False,
    wrap_as_compiled: bool = False,
    expert_split_sizes: Callable | None = None,
) -> nn.Module:
    """Apply TP, EP, `[activation_checkpoint]`, `[compile]` and data parallelism in place.

    Args:
        model: a decoder with `args` (n_heads, kv_heads, tie_word_embeddings) and `layers` of
            `DecoderBlock`s.
        apply_tp: `(model, tp_mesh, loss_parallel) -> None`, the model's TP plan; None when
            the model has none yet, which refuses tensor_parallel_degree > 1.
        op_sac_save_list: the model's op-SAC save list (see `activation_checkpoint.save_list`).
        use_flex_attn: whether attention runs flex_attention (changes op-SAC wrapping).
        wrap_as_compiled: AC wraps the blocks as a compiled run does though compile is off (the
            memory estimator's eager estimate of a compiled run).
        expert_split_sizes: how expert parallelism learns the rows to send and receive (see
            `apply_expert_parallel`); the memory estimator simulates them.

    Pitfall: the order matters. AC wraps after TP and EP so that the per-op policy sees their
    collectives, compile sees the wrapped blocks, and FSDP's hooks stay outside AC.
    """
    compile_model = model_compile_enabled(job_config)
    if compile_model:
        checked_backend(job_config)
    ac_plan = plan_activation_checkpointing(
        job_config.activation_checkpoint,
        _ac_facts(model, parallel_dims, job_config, op_sac_save_list, use_flex_attn, wrap_as_compiled),
    )
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
        tp_mesh = parallel_dims.submesh("tp")
        apply_tp(model, tp_mesh, loss_parallel_enabled(parallel_dims, job_config))
        if not parallel_dims.ep_borrows_tp:
            shard_experts_over_tp(model, tp_mesh)
    experts = []
    # A pipeline stage may hold only dense blocks (DeepSeek-V3's first ones): nothing to split.
    has_moe = any(block.is_moe for block in model.layers.values())
    if job_config.parallelism.expert_parallel_degree > 1 and (has_moe or not parallel_dims.pp_enabled):
        check_ep_supported(model, parallel_dims, job_config)
        experts = apply_expert_parallel(
            model,
            parallel_dims.submesh("ep"),
            data_ranks=parallel_dims.ep_data_ranks,
            rows_split_mesh=parallel_dims.submesh("tp") if parallel_dims.ep_borrows_tp else None,
            split_sizes=expert_split_sizes,
        )
        _log_expert_layout(model, parallel_dims)
    ac_plan.apply(model)
    if compile_model:
        apply_compile(model, job_config, device)
    apply_data_parallel(model, parallel_dims, job_config, device, experts)
    return model


def _ac_facts(model, parallel_dims, job_config, save_list, use_flex_attn, wrap_as_compiled) -> ACFacts:
    """What the AC plan needs to know of this run (see `ACFacts`)."""
    compile_model = model_compile_enabled(job_config)
    return ACFacts(
        compile_enabled=compile_model or wrap_as_compiled,
        compiles=compile_model,
        compile_backend=job_config.compile.backend,
        capture_scalar_outputs=job_config.compile.capture_scalar_outputs,
        flex_attention=use_flex_attn,
        split_backward=splits_backward(job_config),
        tensor_parallel=parallel_dims.tp,
        expert_parallel=job_config.parallelism.expert_parallel_degree,
        context_parallel_group=parallel_dims.cp_exchange_group().group_name
        if parallel_dims.cp_enabled
        else "",
        has_moe=any(block.is_moe for block in model.layers.children()),
        save_list=frozenset(save_list),
        dump_folder=job_config.job.dump_folder,
    )


def _log_expert_layout(model: nn.Module, parallel_dims: ParallelDims) -> None:
    num_experts, ep = model.args.moe_args.num_experts, parallel_dims.ep
    holders = parallel_dims.expert_dp_degree
    shared = f"FSDP-sharded over the {holders} ranks holding them" if holders > 1 else "not sharded further"
    over = f"ep {ep}"
    if parallel_dims.ep_borrows_tp or parallel_dims.cp_enabled:
        over += f" ({parallel_dims.ep_parts()})"
    if parallel_dims.tp_enabled and not parallel_dims.ep_borrows_tp:
        shared += f", hidden units sharded over tp {parallel_dims.tp}"
    per_rank = num_experts // ep
    logger.info(f"Expert parallel: {num_experts} experts over {over} ({per_rank} per rank), {shared}")


def check_ep_supported(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> None:
    """Refuse the expert-parallel layouts not built yet, and models without experts.

    Raises:
        ConfigError: naming what to change.
    """
    ep = job_config.parallelism.expert_parallel_degree
    if parallel_dims.ep != ep:
        raise ConfigError(
            f"expert_parallel_degree {ep} with data_parallel_replicate_degree {parallel_dims.dp_replicate}"
            f" x data_parallel_shard_degree {parallel_dims.dp_shard} x tensor_parallel_degree "
            f"{parallel_dims.tp} is not supported: expert parallelism needs an expert_parallel_degree "
            "that divides data_parallel_shard_degree."
        )
    moe_args = getattr(model.args, "moe_args", None)
    if moe_args is None:
        raise ConfigError(
            f"expert_parallel_degree = {ep} needs a Mixture-of-Experts flavor, but "
            f"'{job_config.model.flavor}' has no experts; set parallelism.expert_parallel_degree = 1."
        )
    if moe_args.num_experts % ep:
        raise ConfigError(
            f"num_experts = {moe_args.num_experts} of flavor '{job_config.model.flavor}' is not "
            f"divisible by expert_parallel_degree = {ep}; choose a degree that divides it."
        )
