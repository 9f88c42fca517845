"""The protocol every model's args dataclass follows."""

from typing import Protocol

import torch.nn as nn

from torchtitan.config.job_config import JobConfig


class BaseModelArgs(Protocol):
    """Hyperparameters of one flavor, plus what the trainer needs to know about them."""

    def update_from_config(self, job_config: JobConfig) -> None:
        """Adopt settings that live in the job config (e.g. seq_len, vocab of the tokenizer)."""

    def num_flops_per_token(self, model: nn.Module, seq_len: int) -> tuple[int, float]:
        """(parameter count without embeddings, training FLOPs per token at `seq_len`)."""

    def describe_attention(self) -> str:
        """The attention the layers run (backend, mask), for the startup log."""
