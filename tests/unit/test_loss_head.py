"""The chunked output head and loss (`ChunkedLoss`): the loss and every gradient of the whole
logits, with no op ever making more than one chunk's logits, in forward or in backward.

Tolerance (fp32, u = 2^-24): chunking regroups two sums over the batch's 256 tokens, the loss's
mean and the output weight's gradient, into per-chunk sums that are then added. Each regrouping
moves a sum by ~sqrt(n) u relative at worst-typical, about 16 u = 1e-6 for n = 256, and the
chunk weights (tokens of the chunk / all tokens) are exact here. Measured: at most 2.1e-7.
"""

import math
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchtitan.components.loss import cross_entropy_loss
from torchtitan.components.loss_head import ChunkedLoss
from torchtitan.models.deepseek_v3 import deepseek_v3_flavors
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.qwen3 import qwen3_flavors
from torchtitan.models.qwen3.model import Qwen3Model

RTOL = 1e-6
SEQ_LEN, BATCH = 64, 4
MODELS = {
    "llama3": (Transformer, llama3_flavors["debugmodel"]),
    "qwen3 tied": (Qwen3Model, replace(qwen3_flavors["debugmodel"], tie_word_embeddings=True)),
    "qwen3 moe": (Qwen3Model, qwen3_flavors["debugmodel_moe"]),
    "deepseek_v3": (DeepSeekV3Model, deepseek_v3_flavors["debugmodel"]),
}


def _model(name: str) -> torch.nn.Module:
    cls, args = MODELS[name]
    torch.manual_seed(0)
    model = cls(replace(args, max_seq_len=SEQ_LEN))
    model.init_weights()
    return model


def _tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))


def _loss_and_grads(model, tokens, chunks: int) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], tokens[:, 1:], ChunkedLoss(cross_entropy_loss, chunks))
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunks", [3, 16])  # 3: chunks of 86, 85 and 85 tokens
@pytest.mark.parametrize("name", MODELS)
def test_the_chunked_loss_and_every_gradient_equal_the_whole_logits(name, chunks):
    model = _model(name)
    tokens = _tokens(model.args.vocab_size)
    whole_loss, whole = _loss_and_grads(model, tokens, 1)
    loss, grads = _loss_and_grads(model, tokens, chunks)
    assert abs(loss - whole_loss) <= RTOL * abs(whole_loss)
    assert grads.keys() == whole.keys()
    for name_, want in whole.items():
        assert (grads[name_] - want).norm() <= RTOL * want.norm(), name_


def test_the_chunked_loss_is_the_whole_logits_cross_entropy():
    model = _model("llama3")
    tokens = _tokens(model.args.vocab_size)
    with torch.no_grad():
        want = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).item()
        got = model(tokens[:, :-1], tokens[:, 1:], ChunkedLoss(cross_entropy_loss, 16)).item()
    assert got == pytest.approx(want, rel=RTOL)


class _LargestLogits(TorchDispatchMode):
    """The most rows of logits (a new tensor with `vocab` in its last dim) any op makes. Views
    make no memory (and the output weight and its gradient, transposed, are no logits)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def _largest_logits_in_a_step(chunks: int) -> int:
    model = _model("llama3")
    tokens = _tokens(model.args.vocab_size)
    with _LargestLogits(model.args.vocab_size) as tracker:
        model(tokens[:, :-1], tokens[:, 1:], ChunkedLoss(cross_entropy_loss, chunks)).backward()
    return tracker.rows


@pytest.mark.parametrize("chunks", [1, 3, 16])
def test_no_op_in_forward_or_backward_makes_more_than_one_chunks_logits(chunks):
    # The output weight's gradient ([vocab, dim]) has vocab in its first dim, not its last.
    assert _largest_logits_in_a_step(chunks) == math.ceil(BATCH * SEQ_LEN / chunks)


def test_without_labels_the_model_returns_the_whole_logits():
    model = _model("llama3")
    tokens = _tokens(model.args.vocab_size)
    assert model(tokens[:, :-1]).shape == (BATCH, SEQ_LEN, model.args.vocab_size)


def test_a_forward_with_fewer_tokens_than_chunks_runs_one_chunk_per_token():
    model = _model("llama3")
    tokens = _tokens(model.args.vocab_size)[:1, :4]  # 3 tokens, 16 chunks
    with torch.no_grad():
        want = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).item()
        got = model(tokens[:, :-1], tokens[:, 1:], ChunkedLoss(cross_entropy_loss, 16)).item()
    assert got == pytest.approx(want, rel=RTOL)


def _logits_saved_for_backward(chunks: int) -> int:
    """Rows of logits that forward leaves saved for backward (outside a recomputed region)."""
    model = _model("llama3")
    tokens = _tokens(model.args.vocab_size)
    vocab, rows = model.args.vocab_size, 0

    def pack(t):
        nonlocal rows
        if t.dim() >= 2 and t.shape[-1] == vocab:
            rows += t.numel() // vocab
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens[:, :-1], tokens[:, 1:], ChunkedLoss(cross_entropy_loss, chunks))
    return rows


def test_a_chunked_forward_saves_no_logits_for_backward():
    # Unchunked, the cross-entropy saves its log-softmax of every token; chunked, each chunk's
    # region saves only its inputs, and backward recomputes the logits.
    assert _logits_saved_for_backward(1) >= BATCH * SEQ_LEN
    assert _logits_saved_for_backward(16) == 0
