"""Float8 training of the Linear layers (`model.converters = ["float8"]`, `[float8]`) via torchao.

The converter swaps `nn.Linear` modules for torchao's `Float8Linear` on the meta model, before
tensor parallelism, AC, compile and FSDP, so every later stage sees the final modules. The
weights stay high-precision parameters (checkpoints and Hugging Face exports are unchanged);
each matmul casts its inputs to float8 with dynamic scales and runs `torch._scaled_mm`.

Kept in high precision: Linear layers whose FQN contains an entry of `float8.filter_fqns`
(the output projection by default), MoE router gates (their scores choose the experts),
layers whose dimensions are not multiples of 16, which `_scaled_mm` cannot take, and, when
`filter_fqns` holds "auto_filter_small_kn" (as upstream), layers torchao's size heuristic for
the recipe finds too small to gain from float8. MoE experts
are grouped matmuls, not Linear layers, so they stay in high precision too.

Pitfalls:
    * Float8 matmuls need a GPU of compute capability 8.9 or newer (H100, H200, L4, ...);
      `float8.emulate = true` runs them in high precision elsewhere. On the CPU torch runs
      `_scaled_mm` itself, so the tests exercise the real casts.
    * `enable_fsdp_float8_all_gather` all-gathers float8 weights, which gloo cannot do; it
      needs FSDP on an accelerator backend such as NCCL. Only gloo is refused, so the memory
      estimator's fake process group accepts it.
    * op-SAC sees each float8 matmul as `aten.mm` on torchao's float8 tensors, so it saves and
      alternates them like high-precision ones; the amax reductions behind the scales
      (`aten.max`) are saved too, so a recompute casts with the forward's scales.
"""

import dataclasses
import logging

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)

# `torch._scaled_mm` needs both matrix dimensions divisible by 16.
_SCALED_MM_MULTIPLE = 16
_FLOAT8_CAPABILITY = (8, 9)
_ROUTER_GATE_SUFFIX = "router.gate"
# The `float8.filter_fqns` entry that asks, as upstream, for torchao's size filter.
AUTO_FILTER = "auto_filter_small_kn"


def _import_torchao(device: torch.device):
    # torchao logs a warning for each CUDA kernel library it cannot load; the CPU needs none.
    torchao_logger = logging.getLogger("torchao")
    level = torchao_logger.level
    if device.type == "cpu":
        torchao_logger.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError:
        raise ConfigError(
            "'model.converters' includes 'float8', which needs torchao: pip install 'torchao>=0.16' "
            "(or install this project with its float8 extra), or remove float8 from model.converters."
        ) from None
    finally:
        torchao_logger.setLevel(level)
    return float8


class Float8Converter:
    """Swaps Linear layers for torchao's `Float8Linear` and keeps FSDP's float8 scales current.

    Args:
        job_config: the run's config; reads `[float8]`.
        parallel_dims: the run's layout (the float8 all-gather needs FSDP).
        device: the training device (float8 matmuls need a capable GPU unless emulated).

    Raises:
        ConfigError: torchao is missing, the GPU cannot run float8 matmuls, or the float8
            all-gather is asked for without FSDP or on the CPU.
    """

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims, device: torch.device):
        self.config = c = job_config.float8
        self.float8 = _import_torchao(device)
        _check_device(c, device)
        if c.enable_fsdp_float8_all_gather:
            _check_float8_all_gather(parallel_dims, device)
        if c.recipe_name == "tensorwise":
            linear_config = self.float8.Float8LinearConfig(
                enable_fsdp_float8_all_gather=c.enable_fsdp_float8_all_gather, emulate=c.emulate
            )
        else:
            linear_config = self.float8.Float8LinearConfig.from_recipe_name(c.recipe_name)
            linear_config = _with_emulate(linear_config, c.emulate)
            _match_eager_casts_in_compiled_code()
        self.linear_config = linear_config

    def keeps_high_precision(self, module: nn.Module, fqn: str) -> str | None:
        """Why the Linear `module` at `fqn` stays in high precision, or None to convert it."""
        patterns = [p for p in self.config.filter_fqns if p != AUTO_FILTER]
        if any(pattern in fqn for pattern in patterns):
            return "float8.filter_fqns"
        if fqn.endswith(_ROUTER_GATE_SUFFIX):
            return "MoE router gate"
        if module.in_features % _SCALED_MM_MULTIPLE or module.out_features % _SCALED_MM_MULTIPLE:
            return f"dimensions not multiples of {_SCALED_MM_MULTIPLE}"
        if AUTO_FILTER in self.config.filter_fqns and not self._worth_float8(module, fqn):
            return f"too small to gain ({AUTO_FILTER})"
        return None

    def _worth_float8(self, module: nn.Module, fqn: str) -> bool:
        """torchao's size heuristic for the recipe (H100 measurements), as upstream applies it."""
        from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

        return _auto_filter_for_recipe(self.config.recipe_name, filter_fqns=[])(module, fqn)

    def convert(self, model: nn.Module) -> None:
        """Swap `model`'s eligible Linear layers in place (on any device, meta included)."""
        kept: dict[str, str] = {}

        def convert_this(module: nn.Linear, fqn: str) -> bool:
            reason = self.keeps_high_precision(module, fqn)
            if reason is not None:
                kept[fqn] = reason
            return reason is None

        self.float8.convert_to_float8_training(
            model, config=self.linear_config, module_filter_fn=convert_this
        )
        converted = sum(isinstance(m, self.float8.float8_linear.Float8Linear) for m in model.modules())
        logger.info(
            f"Float8 training ({self.config.recipe_name}{', emulated' if self.config.emulate else ''}"
            f"{', float8 all-gather' if self.config.enable_fsdp_float8_all_gather else ''}): "
            f"{converted} Linear layers converted, {len(kept)} kept in high precision "
            f"({_summarize(kept)})"
        )

    def post_optimizer_hook(self, model: nn.Module) -> None:
        """After each optimizer step: one all-reduce for every weight's float8 scale (if asked)."""
        if self.config.precompute_float8_dynamic_scale_for_fsdp:
            self.float8.precompute_float8_dynamic_scale_for_fsdp(model)


def _match_eager_casts_in_compiled_code() -> None:
    """Rowwise scales under compile and AC: inductor fuses away the low-precision roundings
    eager performs, differently in forward and in recompute, and the scales computed from the
    two differ; training then diverges to NaN (pytorch/pytorch#150859). Upstream torchtitan sets
    the same process-wide flag for its rowwise recipe."""
    import torch._inductor.config

    if not torch._inductor.config.emulate_precision_casts:
        torch._inductor.config.emulate_precision_casts = True
        logger.info("Float8 rowwise: set torch._inductor.config.emulate_precision_casts (pytorch#150859)")


def _check_device(config, device: torch.device) -> None:
    if device.type != "cuda" or config.emulate:
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < _FLOAT8_CAPABILITY:
        needed, found = ".".join(map(str, _FLOAT8_CAPABILITY)), ".".join(map(str, capability))
        raise ConfigError(
            f"float8 training needs a GPU of compute capability {needed} or newer, but this one is "
            f"{found}; set float8.emulate = true to run the float8 casts with high-precision matmuls, "
            "or remove float8 from model.converters."
        )


def _check_float8_all_gather(parallel_dims: ParallelDims, device: torch.device) -> None:
    if not parallel_dims.fsdp_enabled:
        raise ConfigError(
            "'float8.enable_fsdp_float8_all_gather' = true needs FSDP (data_parallel_shard_degree > 1), "
            "which this run does not use; turn it off."
        )
    if device.type == "cpu" and dist.is_initialized() and "gloo" in str(dist.get_backend()):
        raise ConfigError(
            "'float8.enable_fsdp_float8_all_gather' = true cannot run on the CPU: gloo cannot all-gather "
            "float8 tensors. Turn it off (the weights are then gathered in the FSDP param dtype)."
        )


def _with_emulate(linear_config, emulate: bool):
    return dataclasses.replace(linear_config, emulate=emulate) if emulate else linear_config


def _summarize(kept: dict[str, str], limit: int = 4) -> str:
    if not kept:
        return "none"
    by_reason: dict[str, list[str]] = {}
    for fqn, reason in kept.items():
        by_reason.setdefault(reason, []).append(fqn)
    parts = []
    for reason, fqns in by_reason.items():
        shown = ", ".join(fqns[:limit]) + (f", ... {len(fqns) - limit} more" if len(fqns) > limit else "")
        parts.append(f"{reason}: {shown}")
    return "; ".join(parts)
