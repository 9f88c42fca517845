"""The output head and the loss, run over chunks of the tokens so that the full logits never exist.

At Llama 3's vocabulary (128,256) one 8192-token sequence has 4.2 GB of fp32 logits, and the
loss's backward holds as much again. `ChunkedLoss` splits the final norm's output along the
tokens; each chunk's projection, upcast and loss is one region that saves only its inputs
(`recompute_in_backward`), so forward frees a chunk's logits before the next chunk and backward
recomputes them, uses them and frees them the same way.
"""

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate

from torchtitan.distributed.activation_checkpoint import recompute_in_backward


class ChunkedLoss:
    """The loss of a decoder's final hidden states, computed `chunks` token ranges at a time.

    Args:
        loss_fn: `(logits, labels) -> mean loss` over [batch, seq, vocab] logits and [batch, seq]
            labels, the spec's loss (compiled when `compile.components` has "loss").
        chunks: token ranges per forward; 1 computes the whole logits at once, as a model
            without a chunked head does. A forward with fewer tokens (a short validation batch)
            runs one chunk per token; the trainer's config check refuses that for training.

    Each chunk's loss is weighted by its share of the tokens, so the sum is the mean over every
    token, whatever the chunk sizes. The output weight is read once per chunk, in forward and
    again in backward; its gradient accumulates across the chunks in autograd's buffer.

    Pitfalls:
        Call it inside the module that owns the output weight (the model's forward), so that
        FSDP gathers that weight once per forward and reduces its gradient once per backward,
        not once per chunk.
        Under sequence parallelism the hidden states are gathered once, before chunking; under
        loss parallelism each chunk's logits stay sharded over the vocabulary. The recomputed
        loss of a chunk issues loss parallelism's two small all-reduces (of one value per
        token) again.
    """

    def __init__(self, loss_fn: Callable, chunks: int = 1):
        self.loss_fn, self.chunks = loss_fn, chunks

    def __call__(self, project: Callable, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean loss of `labels` ([batch, seq]) under `project(hidden)`'s logits.

        Args:
            project: hidden states [batch, tokens, dim] -> logits [batch, tokens, vocab]: the
                model's output projection.
            hidden: the final norm's output, [batch, seq, dim].
        """
        tokens = labels.numel()
        chunks = min(self.chunks, tokens)
        if chunks == 1:
            return self.loss_fn(project(hidden), labels)
        hidden = _replicated(hidden).reshape(1, tokens, hidden.shape[-1])
        sizes = _chunk_sizes(tokens, chunks)
        total = None
        for h, y in zip(hidden.split(sizes, dim=1), labels.reshape(1, tokens).split(sizes, dim=1)):
            part = recompute_in_backward(self._chunk_loss, project, h, y, y.numel() / tokens)
            total = part if total is None else total + part
        return total

    def _chunk_loss(self, project: Callable, hidden: torch.Tensor, labels: torch.Tensor, share: float):
        return self.loss_fn(project(hidden), labels) * share


def build_chunked_loss(job_config, build_loss_fn: Callable) -> ChunkedLoss:
    """The run's `ChunkedLoss`: the spec's loss (`build_loss_fn(job_config)`) over
    `training.loss_chunks` chunks."""
    return ChunkedLoss(build_loss_fn(job_config), job_config.training.loss_chunks)


def _chunk_sizes(tokens: int, chunks: int) -> list[int]:
    """`chunks` sizes that sum to `tokens` and differ by at most one, the larger first."""
    base, extra = divmod(tokens, chunks)
    return [base + 1] * extra + [base] * (chunks - extra)


def _replicated(hidden: torch.Tensor) -> torch.Tensor:
    """`hidden` whole on every rank: sequence-parallel shards are gathered once here, rather
    than once per chunk by the output projection."""
    if isinstance(hidden, DTensor):
        return hidden.redistribute(hidden.device_mesh, [Replicate()] * hidden.device_mesh.ndim)
    return hidden
