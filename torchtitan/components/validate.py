"""Held-out loss: one pass over the validation split, averaged over all data-parallel ranks."""

import torch
import torch.nn as nn

from torchtitan.distributed.rank_agreement import all_reduce_mean
from torchtitan.distributed.tensor_helpers import plain_tensor


class Validator:
    """Evaluates the mean next-token loss of a model on a finite loader.

    Args:
        dataloader: finite loader of (input, label) batches; rewound before each pass.
        loss_fn: the `ChunkedLoss` the model computes its loss with; in chunks, validation
            never holds the whole logits either.
        max_steps: batches per pass; -1 for all the loader has (every whole global batch of
            the split: up to local batch x dp - 1 windows at its end are left out).
        pipeline: under pipeline parallelism, the trainer's `Pipeline`, whose schedule runs
            the batches through the stages (forward only); None otherwise.
    """

    def __init__(self, dataloader, loss_fn, device: torch.device, max_steps: int = -1, pipeline=None):
        self.dataloader, self.loss_fn = dataloader, loss_fn
        self.device, self.max_steps, self.pipeline = device, max_steps, pipeline

    @torch.no_grad()
    def validate(self, model: nn.Module) -> float:
        """The mean loss over the split (same value on every rank)."""
        model.eval()
        self.dataloader.dataset.load_state_dict({"sample_index": 0})
        total, batches = torch.zeros((), device=self.device), 0
        for inputs, labels in self.dataloader:
            if batches == self.max_steps:
                break
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            if self.pipeline is not None:
                loss = self.pipeline.eval_loss(inputs, labels)
            else:
                loss = model(inputs, labels, self.loss_fn)
            total += plain_tensor(loss.detach())
            batches += 1
        model.train()
        return all_reduce_mean(total.item() / max(batches, 1), self.device)
