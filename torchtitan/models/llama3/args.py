"""Llama 3 hyperparameters and the FLOPs/parameter accounting the trainer logs."""

from dataclasses import dataclass

import torch.nn as nn

from torchtitan.models.flops import decoder_flops_per_token
from torchtitan.models.layers import AttentionArgs
from torchtitan.models.rope import RoPEScaling


@dataclass
class TransformerModelArgs(AttentionArgs):
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RoPEScaling | None = None
    max_seq_len: int = 131072
    depth_init: bool = True
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4*dim, times the multiplier, rounded up to multiple_of."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def num_flops_per_token(self, model: nn.Module, seq_len: int) -> tuple[int, float]:
        """(non-embedding parameters, training FLOPs per token); see `decoder_flops_per_token`."""
        return decoder_flops_per_token(
            model,
            self.n_layers,
            self.n_heads,
            self.head_dim,
            self.attention_span(seq_len),
            self.tie_word_embeddings,
        )
