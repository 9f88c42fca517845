"""Model families; importing this package registers every model's TrainSpec."""

from torchtitan.models import llama3, qwen3  # noqa: F401
