"""Helpers that many test files share: seeded CPU init of a meta-built model, a tiny model of
each family, and one next-token training step that returns the loss and every gradient,
gathered."""

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3.args import Qwen3ModelArgs
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.tools.fqn import clean_fqn


def init_on_cpu(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Allocate `model`, built on the meta device, on the CPU and fill it with `model.init_weights()`
    after `torch.manual_seed(seed)`; return the model. Call it after any parallelize or `apply_ac`
    step that has to see the meta model, as the trainer does. It seeds the global RNG, so random
    numbers drawn afterwards depend on `seed`; a model already on a real device is reallocated
    empty, losing its values."""
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def _gathered(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def next_token_loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor, context=None):
    """One forward and backward of next-token prediction: `model(tokens[:, :-1])` scored by
    cross-entropy against `tokens[:, 1:]`, run inside `context` (say a loss-parallel one) when
    given. Returns `(loss, grads)`: the detached loss and `{clean_fqn(name): gradient}` over
    `model.named_parameters()`, a DTensor of either gathered whole with `full_tensor()` (a
    collective: every rank must call it). Gradients accumulate onto what the parameters already
    hold, and the plain-tensor gradients returned are the parameters' own `.grad` objects, not
    copies: zero them in place afterwards and the returned ones change too."""
    with context if context is not None else contextlib.nullcontext():
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    grads = {clean_fqn(name): _gathered(param.grad) for name, param in model.named_parameters()}
    return _gathered(loss.detach()), grads


VOCAB, SEQ_LEN = 64, 16  # of every tiny model


def tiny_llama3(seed: int = 0, **overrides) -> Transformer:
    """A 2-block Llama 3 (dim 32, 4 heads, 2 kv heads, vocab 64, 16 positions) built on the meta
    device and initialized on the CPU from `seed`; `overrides` replace fields of its
    `TransformerModelArgs`. Every call builds and initializes a new model (milliseconds)."""
    base = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=SEQ_LEN)
    args = TransformerModelArgs(**{**base, **overrides})
    with torch.device("meta"):
        model = Transformer(args)
    return init_on_cpu(model, seed)


def tiny_qwen3(seed: int = 0, **overrides) -> Qwen3Model:
    """A 2-block dense Qwen3 (dim 32, 4 heads of head_dim 16, so not dim / heads, 2 kv heads,
    hidden 64, vocab 64, 16 positions) built on the meta device and initialized on the CPU from
    `seed`; `overrides` replace fields of its `Qwen3ModelArgs` (say `tie_word_embeddings=True`)."""
    base = dict(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=64, vocab_size=VOCAB,
        max_seq_len=SEQ_LEN,
    )  # fmt: skip
    args = Qwen3ModelArgs(**{**base, **overrides})
    with torch.device("meta"):
        model = Qwen3Model(args)
    return init_on_cpu(model, seed)


def tiny_deepseek_v3_args(**overrides) -> DeepSeekV3ModelArgs:
    """Args of a 3-block DeepSeek-V3 (one dense block, then two MoE blocks of 4 sigmoid-routed
    experts in 2 groups, top 2, one shared expert), MLA without the query bottleneck
    (q_lora_rank 0; pass `q_lora_rank=24` for one), vocab 64, 16 positions; `overrides` replace
    any field. Its v_head_dim (12) differs from the q/k head width (8 + 8) on purpose."""
    moe = MoEArgs(
        num_experts=4, num_shared_experts=1, top_k=2, score_func="sigmoid", route_norm=True,
        num_expert_groups=2, num_limited_groups=1, load_balance_coeff=1e-3,
    )  # fmt: skip
    base = dict(
        vocab_size=VOCAB, dim=32, inter_dim=64, moe_inter_dim=16, n_layers=3, n_dense_layers=1, n_heads=4,
        q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        moe_args=moe, max_seq_len=SEQ_LEN,
    )  # fmt: skip
    return DeepSeekV3ModelArgs(**{**base, **overrides})


def tiny_deepseek_v3(seed: int = 0, **overrides) -> DeepSeekV3Model:
    """The model of `tiny_deepseek_v3_args(**overrides)`, built on the meta device and initialized
    on the CPU from `seed`."""
    with torch.device("meta"):
        model = DeepSeekV3Model(tiny_deepseek_v3_args(**overrides))
    return init_on_cpu(model, seed)
