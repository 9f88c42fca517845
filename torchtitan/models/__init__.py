"""Model families; importing this package registers every model's TrainSpec."""

from torchtitan.models import deepseek_v3 as deepseek_v3  # noqa: F401
from torchtitan.models import llama3, qwen3  # noqa: F401
