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
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchtitan.components.loss import IGNORE_INDEX, build_cross_entropy_loss, cross_entropy_loss
from torchtitan.components.loss_head import (
    ChunkedLoss,
    LinearCrossEntropy,
    auto_loss_chunks,
    build_chunked_loss,
)
from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
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


def _loss_and_grads(model, tokens, chunks: int, fused: bool = True) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], tokens[:, 1:], ChunkedLoss(cross_entropy_loss, chunks, fused))
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("path", ["fused", "generic"])
@pytest.mark.parametrize("chunks", [3, 16])  # 3: chunks of 86, 85 and 85 tokens
@pytest.mark.parametrize("name", MODELS)
def test_the_chunked_loss_and_every_gradient_equal_the_whole_logits(name, chunks, path):
    model = _model(name)
    tokens = _tokens(model.args.vocab_size)
    whole_loss, whole = _loss_and_grads(model, tokens, 1)
    loss, grads = _loss_and_grads(model, tokens, chunks, fused=path == "fused")
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


def test_the_default_chunk_count_keeps_each_chunks_fp32_logits_within_64_mib():
    chunks = auto_loss_chunks(8192, 128256)  # Llama 3 8B at 8192 tokens
    assert chunks == 64
    assert math.ceil(8192 / chunks) * 128256 * 4 <= 64 * 2**20 < math.ceil(8192 / (chunks - 1)) * 128256 * 4
    assert auto_loss_chunks(2048, 2048) == 1  # the debug model's 8 x 256 tokens: 16 MiB whole
    assert auto_loss_chunks(3, 10**9) == 3  # never more chunks than tokens


def _fake_head_peak(fused: bool, chunks: int, vocab: int = 4096, dim: int = 64, tokens: int = 256) -> int:
    """Bytes the head holds at its peak above its inputs, forward and backward, fp32."""
    with FakeTensorMode():
        weight = torch.empty(vocab, dim, requires_grad=True)
        hidden = torch.empty(1, tokens, dim, requires_grad=True)
        labels = torch.zeros(1, tokens, dtype=torch.long)
        tracker = MemTracker()
        tracker.track_external(weight, hidden, labels)
        with tracker:
            before = tracker.get_tracker_snapshot("current")
            loss = ChunkedLoss(cross_entropy_loss, chunks, fused)
            loss(lambda h: F.linear(h, weight), hidden, labels, weight).backward()
            peak = tracker.get_tracker_snapshot("peak")
    device = next(iter(peak))
    return peak[device]["Total"] - before.get(device, {}).get("Total", 0)


def test_the_fused_head_holds_one_weight_gradient_and_one_chunks_logits():
    vocab, dim, tokens, chunks = 4096, 64, 256, 16
    weight_grad, hidden_grad, chunk_logits = vocab * dim * 4, tokens * dim * 4, tokens // chunks * vocab * 4
    fused = _fake_head_peak(True, chunks)
    # Autograd sums the generic path's per-chunk weight gradients out of place: three at once.
    assert _fake_head_peak(False, chunks) >= 3 * weight_grad
    assert weight_grad + hidden_grad <= fused <= weight_grad + hidden_grad + 2 * chunk_logits + 2**16


def test_the_fused_loss_is_fp32_from_bf16_inputs_as_the_unchunked_loss():
    torch.manual_seed(0)
    hidden = torch.randn(96, 32).bfloat16()
    weight = torch.randn(300, 32).bfloat16()
    labels = torch.randint(0, 300, (96,))
    got = LinearCrossEntropy.apply(hidden, weight, labels, 10)
    want = cross_entropy_loss(F.linear(hidden, weight)[None], labels[None])
    assert got.dtype == want.dtype == torch.float32
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_ignored_labels_count_for_nothing_in_the_fused_loss_and_its_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(40, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (40,))
    labels[::3] = IGNORE_INDEX
    want = cross_entropy_loss(F.linear(hidden, weight)[None], labels[None])
    want_grads = torch.autograd.grad(want, (hidden, weight))
    got = LinearCrossEntropy.apply(hidden, weight, labels, 7)
    got_grads = torch.autograd.grad(got, (hidden, weight))
    assert got.item() == pytest.approx(want.item(), rel=RTOL)
    for g, w in zip(got_grads, want_grads):
        assert (g - w).norm() <= RTOL * w.norm()


@pytest.mark.parametrize(
    "loss_fn, fused, uses_fused",
    [(cross_entropy_loss, True, True), (cross_entropy_loss, False, False),
     (lambda logits, labels: cross_entropy_loss(logits, labels), True, False)],
    ids=["stock loss", "fused off (pipeline parallelism)", "another loss"],
)  # fmt: skip
def test_the_fused_path_runs_only_for_the_stock_loss_when_allowed(monkeypatch, loss_fn, fused, uses_fused):
    calls = []
    monkeypatch.setattr(LinearCrossEntropy, "apply", lambda *args: calls.append(args) or torch.zeros(()))
    model = _model("llama3")
    tokens = _tokens(model.args.vocab_size)
    model(tokens[:, :-1], tokens[:, 1:], ChunkedLoss(loss_fn, 4, fused))
    assert bool(calls) == uses_fused


@pytest.mark.parametrize(
    "argv, dims, shards, fused",
    [([], ParallelDims(1, 8, 1, 8), 1, True),
     (["--parallelism.tensor_parallel_degree", "8"], ParallelDims(1, 1, 8, 8), 8, True),
     (["--parallelism.tensor_parallel_degree", "8", "--parallelism.disable_loss_parallel"],
      ParallelDims(1, 1, 8, 8), 1, True),
     (["--parallelism.pipeline_parallel_degree", "2"], ParallelDims(1, 4, 1, 8, pp=2), 1, False)],
    ids=["fsdp", "tp, loss parallel", "tp, gathered logits", "pp"],
)  # fmt: skip
def test_the_runs_chunked_loss_sizes_chunks_by_a_ranks_logits_and_fuses_outside_pp(argv, dims, shards, fused):
    loss = build_chunked_loss(parse_args(argv, env={}), build_cross_entropy_loss, dims)
    assert (loss.vocab_shards, loss.fused, loss.chunks) == (shards, fused, 0)
