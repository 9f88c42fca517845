"""Model families; importing this package registers every model's TrainSpec."""

from torchtitan.models import deepseek_v3 as deepseek_v3  # noqa: F401
from torchtitan.models import llama3, qwen3  # noqa: F401
from torchtitan.models.registry import (
    build_run_state_dict_adapter,
    build_state_dict_adapter,
    get_train_spec,
)

__all__ = ["build_run_state_dict_adapter", "build_state_dict_adapter", "get_train_spec"]
