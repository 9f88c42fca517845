"""Cross-entropy over next-token logits, computed in fp32."""

import torch
import torch.nn.functional as F

from torchtitan.components.compile import checked_backend

# Labels of this value count for nothing (`F.cross_entropy`'s default).
IGNORE_INDEX = -100


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy; logits are upcast so bf16 training keeps an exact loss."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX)


def build_cross_entropy_loss(job_config):
    """The loss function, compiled when `compile.components` includes "loss"."""
    if job_config.compile.enable and "loss" in job_config.compile.components:
        return torch.compile(cross_entropy_loss, backend=checked_backend(job_config))
    return cross_entropy_loss
