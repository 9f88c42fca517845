"""Qwen3 hyperparameters and the FLOPs/parameter accounting the trainer logs.

Unlike Llama 3, Qwen3 sets `head_dim` (128 in every published size) independently of
`dim / n_heads`, and gives the feed-forward width explicitly (`hidden_dim`, Hugging Face's
`intermediate_size`) instead of deriving it from `dim`.
"""

from dataclasses import dataclass

import torch.nn as nn

from torchtitan.models.flops import decoder_flops_per_token
from torchtitan.models.layers import AttentionArgs
from torchtitan.models.moe import MoEArgs


@dataclass
class Qwen3ModelArgs(AttentionArgs):
    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int | None = 8
    head_dim: int = 128
    hidden_dim: int = 12288
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    # RMSNorm over head_dim on every query and key head, before RoPE.
    qk_norm: bool = True
    tie_word_embeddings: bool = False
    max_seq_len: int = 40960
    depth_init: bool = True
    # MoE flavors: every block's feed-forward is a routed MoE of experts of width moe_hidden_dim.
    moe_args: MoEArgs | None = None
    moe_hidden_dim: int = 768

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

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
