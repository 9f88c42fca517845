"""Model converters (`model.converters`): module swaps applied to the meta model before it is
parallelized, and their per-step hooks. The one built here is float8 (`components/float8.py`).
"""

import torch
import torch.nn as nn

from torchtitan.config.job_config import CONVERTERS, JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims


class ModelConverters:
    """The converters `model.converters` names, in order; empty when it names none."""

    def __init__(self, converters: list):
        self.converters = converters

    def convert(self, model: nn.Module) -> None:
        """Apply every converter to `model` in place; call before `parallelize_fn`."""
        for converter in self.converters:
            converter.convert(model)

    def post_optimizer_hook(self, model: nn.Module) -> None:
        """Call after every optimizer step (float8 refreshes FSDP's weight scales here)."""
        for converter in self.converters:
            converter.post_optimizer_hook(model)


def build_model_converters(
    job_config: JobConfig, parallel_dims: ParallelDims, device: torch.device
) -> ModelConverters:
    """The converters of `model.converters` (names already validated by the config).

    Raises:
        ConfigError: a converter cannot run here (for float8: see `Float8Converter`).
    """
    converters = []
    for name in dict.fromkeys(CONVERTERS[entry] for entry in job_config.model.converters):
        if name == "float8":
            from torchtitan.components.float8 import Float8Converter

            converters.append(Float8Converter(job_config, parallel_dims, device))
    return ModelConverters(converters)
