"""The output head and the loss, run over chunks of the tokens so that the full logits never exist.

At Llama 3's vocabulary (128,256) one 8192-token sequence has 4.2 GB of fp32 logits, and the
loss's backward holds as much again. `ChunkedLoss` splits the final norm's output along the
tokens and takes one of two paths:

* fused (`LinearCrossEntropy`), where the head is a plain linear layer and the loss the stock
  cross-entropy: forward keeps each token's log-sum-exp, and backward recomputes each chunk's
  logits, turns them into their gradient in place, and adds the chunk's share of the output
  weight's gradient into one buffer (`addmm_`);
* generic, for any other head or loss (a vocabulary-sharded head under loss parallelism, a
  compiled loss, float8): each chunk's projection, upcast and loss is one region that saves only
  its inputs (`recompute_in_backward`). Autograd then sums the chunks' weight gradients out of
  place, three weight-gradient-sized buffers at once.
"""

import math
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate

from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_loss
from torchtitan.distributed.activation_checkpoint import recompute_in_backward
from torchtitan.distributed.tensor_parallel import loss_parallel_enabled

# With `training.loss_chunks = 0` each chunk holds at most this many logits (64 MiB in fp32).
AUTO_CHUNK_LOGITS = 2**24


def auto_loss_chunks(tokens: int, vocab_size: int) -> int:
    """The chunk count `training.loss_chunks = 0` takes: the fewest chunks whose fp32 logits
    are each at most `AUTO_CHUNK_LOGITS` (1 for a small head, whose logits cost little)."""
    rows_per_chunk = max(1, AUTO_CHUNK_LOGITS // vocab_size)
    return math.ceil(tokens / rows_per_chunk)


class ChunkedLoss:
    """The loss of a decoder's final hidden states, computed `chunks` token ranges at a time.

    Args:
        loss_fn: `(logits, labels) -> mean loss` over [batch, seq, vocab] logits and [batch, seq]
            labels, the spec's loss (compiled when `compile.components` has "loss").
        chunks: token ranges per forward; 1 computes the whole logits at once, as a model
            without a chunked head does; 0 picks the count per forward (`auto_loss_chunks`). A
            forward with fewer tokens (a short validation batch) runs one chunk per token; the
            trainer's config check refuses that for training.
        fused: whether `LinearCrossEntropy` may run the chunks (see `__call__`). The trainer
            turns it off under pipeline parallelism, whose schedules may split a backward in
            two passes.
        vocab_shards: the ranks each chunk's logits are split over (the TP degree under loss
            parallelism, else 1); `chunks` 0 sizes the chunks by a rank's share.

    Each chunk's loss is weighted by its share of the tokens, so the sum is the mean over every
    token, whatever the chunk sizes. The output weight is read once per chunk, in forward and
    again in backward.

    Pitfalls:
        Call it inside the module that owns the output weight (the model's forward), so that
        FSDP gathers that weight once per forward and reduces its gradient once per backward,
        not once per chunk.
        Under sequence parallelism the hidden states are gathered once, before chunking; under
        loss parallelism each chunk's logits stay sharded over the vocabulary. The recomputed
        loss of a chunk issues loss parallelism's two small all-reduces (of one value per
        token) again.
    """

    def __init__(self, loss_fn: Callable, chunks: int = 1, fused: bool = True, vocab_shards: int = 1):
        self.loss_fn, self.chunks, self.fused, self.vocab_shards = loss_fn, chunks, fused, vocab_shards

    def __call__(
        self,
        project: Callable,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        linear_weight: torch.Tensor | None = None,
        vocab_size: int | None = None,
    ) -> torch.Tensor:
        """The mean loss of `labels` ([batch, seq]) under `project(hidden)`'s logits.

        Args:
            project: hidden states [batch, tokens, dim] -> logits [batch, tokens, vocab]: the
                model's output projection.
            hidden: the final norm's output, [batch, seq, dim].
            linear_weight: the weight `project` is a plain `F.linear` of, or None if it is
                something else (float8). The fused path needs it, a plain tensor (not a
                tensor-parallel DTensor), the stock cross-entropy and no autocast.
            vocab_size: the logits' width, for `chunks` 0 (default: `linear_weight`'s rows).
        """
        tokens = labels.numel()
        vocab_size = vocab_size or (linear_weight.shape[0] if linear_weight is not None else None)
        chunks = self.chunks or auto_loss_chunks(tokens, vocab_size // self.vocab_shards)
        chunks = min(chunks, tokens)
        if chunks == 1:
            return self.loss_fn(project(hidden), labels)
        if self._can_fuse(hidden, linear_weight):
            return LinearCrossEntropy.apply(
                hidden.reshape(tokens, -1), linear_weight, labels.reshape(tokens), math.ceil(tokens / chunks)
            )
        hidden = _replicated(hidden).reshape(1, tokens, hidden.shape[-1])
        sizes = _chunk_sizes(tokens, chunks)
        total = None
        for h, y in zip(hidden.split(sizes, dim=1), labels.reshape(1, tokens).split(sizes, dim=1)):
            part = recompute_in_backward(self._chunk_loss, project, h, y, y.numel() / tokens)
            total = part if total is None else total + part
        return total

    def _can_fuse(self, hidden: torch.Tensor, linear_weight: torch.Tensor | None) -> bool:
        return (
            self.fused
            and self.loss_fn is cross_entropy_loss
            and linear_weight is not None
            and not isinstance(linear_weight, DTensor)
            and not isinstance(hidden, DTensor)
            and not torch.is_autocast_enabled(hidden.device.type)
        )

    def _chunk_loss(self, project: Callable, hidden: torch.Tensor, labels: torch.Tensor, share: float):
        return self.loss_fn(project(hidden), labels) * share


class LinearCrossEntropy(torch.autograd.Function):
    """`cross_entropy_loss(F.linear(hidden, weight), labels)`, `chunk` tokens at a time.

    Forward computes each chunk's logits, upcasts them, and keeps only each token's fp32
    log-sum-exp; the loss is fp32, as `cross_entropy_loss` computes it. Backward recomputes a
    chunk's logits, makes them the softmax gradient in place, and writes the chunk's rows of the
    hidden states' gradient and adds its share of the weight's gradient into one buffer
    (`addmm_`), in the weight's dtype. At most one chunk's logits exist at any time, and one
    weight-gradient-sized buffer.

    torch 2.13's `F.linear_cross_entropy` chunks the same way, but returns the loss in the
    input's dtype (bf16 under FSDP's mixed precision), which would change the logged loss.

    Args (of `apply`):
        hidden: [tokens, dim]. weight: [vocab, dim]. labels: [tokens] class indices;
        `IGNORE_INDEX` counts for nothing, as in `F.cross_entropy`. chunk: tokens per chunk.

    Pitfall: the weight gradient adds the chunks in the weight's dtype. In bf16 that rounds
    once per chunk (the unchunked matmul rounds once), like autograd's sum of the generic path.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int):
        counted = labels != IGNORE_INDEX
        targets = labels.masked_fill(~counted, 0)
        log_sum_exp = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, labels.numel(), chunk):
            rows = slice(start, start + chunk)
            logits = (hidden[rows] @ weight.t()).float()
            log_sum_exp[rows] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, targets[rows, None]).squeeze(1)
            total += ((log_sum_exp[rows] - picked) * counted[rows]).sum()
            del logits
        ctx.save_for_backward(hidden, weight, targets, counted, log_sum_exp)
        ctx.chunk = chunk
        return total / counted.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets, counted, log_sum_exp = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        # d(mean loss)/d(logits) = (softmax - one_hot) / counted tokens, per counted token.
        scale = (grad_loss / counted.sum()).float()
        for start in range(0, targets.numel(), ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            probs = (hidden[rows] @ weight.t()).float()
            probs.sub_(log_sum_exp[rows, None]).exp_()
            probs.scatter_add_(1, targets[rows, None], probs.new_full((probs.shape[0], 1), -1.0))
            probs.mul_((scale * counted[rows])[:, None])
            grad_logits = probs.to(weight.dtype)
            del probs
            if want_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[rows])
            if want_weight:
                grad_weight.addmm_(grad_logits.t(), hidden[rows])
            del grad_logits
        return grad_hidden, grad_weight, None, None


def build_chunked_loss(job_config, build_loss_fn: Callable, parallel_dims) -> ChunkedLoss:
    """The run's `ChunkedLoss`: the spec's loss (`build_loss_fn(job_config)`) over
    `training.loss_chunks` chunks, fused unless under pipeline parallelism."""
    shards = parallel_dims.tp if loss_parallel_enabled(parallel_dims, job_config) else 1
    loss_fn, chunks = build_loss_fn(job_config), job_config.training.loss_chunks
    return ChunkedLoss(loss_fn, chunks, fused=not parallel_dims.pp_enabled, vocab_shards=shards)


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
