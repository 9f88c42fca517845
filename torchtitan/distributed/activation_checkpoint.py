"""The one place that applies activation checkpointing (AC) to a model.

Every model's `parallelize.py` calls `apply_ac` after tensor parallelism and before compile
and FSDP. It sees blocks only through `model.layers` and knows no model by name; a model
passes its own save list, built from `DEFAULT_SAVE_LIST` (see `save_list`).

Modes (`[activation_checkpoint].mode`):
    none: nothing is wrapped.
    full: every block recomputes its whole forward in backward.
    selective + "N": every Nth block of this model is fully checkpointed.
    selective + "op": every block saves the outputs of the ops in the save list and
        recomputes the rest, except that every second matmul is recomputed.
    memory_budget: no wrapping; torch.compile's partitioner chooses what to save so that
        activations stay within a fraction of what saving everything costs.
"""

import logging
from collections import defaultdict

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper as ptd_checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.config.job_config import ActivationCheckpoint
from torchtitan.config.manager import ConfigError

logger = logging.getLogger(__name__)

_aten = torch.ops.aten

# Ops whose outputs are worth keeping: expensive to recompute, cheap to store, or
# collectives whose recompute would communicate again.
DEFAULT_SAVE_LIST: frozenset = frozenset(
    {
        _aten.mm.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops._c10d_functional.all_to_all_single.default,
        # amax feeding float8 scales: tiny outputs whose recompute would change scaling.
        _aten.max.default,
    }
)


def save_list(add=(), drop=()) -> frozenset:
    """A model's save list: the shared default plus `add`, minus `drop`."""
    return (DEFAULT_SAVE_LIST | frozenset(add)) - frozenset(drop)


def _validate(ac_config: ActivationCheckpoint, model_compile_enabled: bool) -> None:
    option = ac_config.selective_ac_option
    if ac_config.mode == "selective" and option != "op" and not (option.isdigit() and int(option) > 0):
        raise ConfigError(
            f"'activation_checkpoint.selective_ac_option' = '{option}' is invalid: use \"op\" "
            'for per-op selective AC or a positive integer N (as a string, e.g. "2").'
        )
    if ac_config.mode == "memory_budget" and not model_compile_enabled:
        raise ConfigError(
            "'activation_checkpoint.mode' = 'memory_budget' works through torch.compile's "
            'partitioner: set compile.enable = true with "model" in compile.components.'
        )


def _wrap(block: nn.Module, ac_config: ActivationCheckpoint, context_fn=None) -> nn.Module:
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}
    return ptd_checkpoint_wrapper(
        block,
        preserve_rng_state=ac_config.preserve_rng_state,
        early_stop=ac_config.early_stop,
        determinism_check="default",
        **kwargs,
    )


def _forced_recompute_mm_shapes(model: nn.Module, fqns: list[str]) -> set[tuple[int, int]]:
    """Weight shapes (transposed, as mm sees them) of the Linear modules matching `fqns`.

    A pattern that matches no module at all is fine: not every model has a router. A pattern
    that matches only non-Linear modules is a config mistake.
    """
    shapes = set()
    for pattern in fqns:
        matches = [(n, m) for n, m in model.named_modules() if pattern in n]
        linears = [m for _, m in matches if isinstance(m, nn.Linear)]
        if matches and not linears:
            raise ConfigError(
                f"'activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns' entry "
                f"'{pattern}' matches {matches[0][0]} ({type(matches[0][1]).__name__}), not an "
                "nn.Linear; name Linear modules only."
            )
        shapes |= {(m.in_features, m.out_features) for m in linears}
    return shapes


def _is_device_to_host_copy(func, args, kwargs) -> bool:
    return (
        func == _aten._to_copy.default
        and args[0].device.type != "cpu"
        and kwargs.get("device") == torch.device("cpu")
    )


def _op_sac_policy(save_ops: frozenset, forced_mm_shapes: set, counts: dict):
    def policy(ctx, func, *args, **kwargs):
        if _is_device_to_host_copy(func, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        if func == _aten.mm.default:
            if tuple(args[1].shape) in forced_mm_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            key = "recompute_mm_count" if ctx.is_recompute else "forward_mm_count"
            counts[key] += 1
            # Recomputing every second matmul halves their memory for ~1/2 extra matmul time.
            if counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if func in save_ops:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_sac_context_fn(save_ops: frozenset, forced_mm_shapes: set):
    """A context_fn whose forward and recompute of one block share fresh matmul counters."""

    def context_fn():
        return create_selective_checkpoint_contexts(
            _op_sac_policy(save_ops, forced_mm_shapes, defaultdict(int))
        )

    return context_fn


def apply_ac(
    model: nn.Module,
    ac_config: ActivationCheckpoint,
    *,
    model_compile_enabled: bool = False,
    use_flex_attn: bool = False,
    op_sac_save_list: frozenset | set | None = None,
    base_folder: str = "",
) -> None:
    """Apply `[activation_checkpoint]` to every block in `model.layers`, in place.

    Args:
        model: has `layers`, a ModuleDict or ModuleList of transformer blocks.
        ac_config: the `[activation_checkpoint]` section.
        model_compile_enabled: whether blocks will be compiled (required by memory_budget).
        use_flex_attn: whether attention runs flex_attention (affects op-SAC; unused until
            the flex backend exists).
        op_sac_save_list: ops whose outputs op-SAC saves; default `DEFAULT_SAVE_LIST`.
        base_folder: where memory_budget writes its pareto plot.

    Pitfalls: call after tensor parallelism and before torch.compile and FSDP. Models with
    dropout need `preserve_rng_state = true`, or recompute draws different masks.

    Raises:
        ConfigError: for an invalid option or a mode the rest of the config cannot support.
    """
    _validate(ac_config, model_compile_enabled)
    if ac_config.mode == "none":
        return
    if ac_config.mode == "memory_budget":
        torch._functorch.config.activation_memory_budget = ac_config.memory_budget
        if ac_config.visualize_memory_budget_pareto:
            torch._functorch.config.visualize_memory_budget_pareto = True
            torch._functorch.config.memory_budget_pareto_dir = base_folder or "."
        logger.info(f"Applied memory-budget AC (budget {ac_config.memory_budget}) via compile")
        return
    context_fn = None
    if ac_config.mode == "selective" and ac_config.selective_ac_option == "op":
        shapes = _forced_recompute_mm_shapes(model, ac_config.per_op_sac_force_recompute_mm_shapes_by_fqns)
        context_fn = _op_sac_context_fn(frozenset(op_sac_save_list or DEFAULT_SAVE_LIST), shapes)
    every = int(ac_config.selective_ac_option) if context_fn is None and ac_config.mode == "selective" else 1
    for index, (name, block) in enumerate(list(model.layers.named_children())):
        if index % every == 0:
            wrapped = _wrap(block, ac_config, context_fn)
            model.layers.register_module(name, wrapped)
    kind = (
        ac_config.mode
        if context_fn is None and every == 1
        else ("op-selective" if context_fn is not None else f"every-{every}-layer selective")
    )
    logger.info(f"Applied {kind} activation checkpointing to the model")
