"""DeepSeek-V3 hyperparameters and the FLOPs/parameter accounting the trainer logs.

Attention is multi-head latent attention (MLA): queries optionally through a low-rank
bottleneck (`q_lora_rank`, 0 = one plain projection), keys and values through a shared latent
of width `kv_lora_rank` plus one decoupled RoPE key head of width `qk_rope_head_dim`. Each
query/key head is `qk_nope_head_dim + qk_rope_head_dim` wide, each value head `v_head_dim`.

The first `n_dense_layers` blocks use a SwiGLU feed-forward of width `inter_dim`; the rest a
routed MoE of experts of width `moe_inter_dim` (plus shared experts, see `MoEArgs`).

RoPE: `rope_scaling` holds the published YaRN constants (`YaRNScaling`), applied, as in
DeepSeek's reference code and torchtitan, only when the RoPE table (`max_seq_len`, i.e.
`training.seq_len`) is longer than the original context: pre-training at 4k runs plain RoPE,
longer sequences YaRN (frequencies and softmax scale). `always_apply_yarn` (`model.always_apply_yarn`)
applies it at any length, as Hugging Face runs the published weights, which their last training
stages (context extension, post-training) ran with YaRN. Not implemented: the
multi-token-prediction (MTP) module.
"""

from dataclasses import dataclass, field

import torch.nn as nn

from torchtitan.models.flops import decoder_flops_per_token
from torchtitan.models.layers import AttentionArgs
from torchtitan.models.moe import MoEArgs
from torchtitan.models.rope import YaRNScaling


@dataclass
class DeepSeekV3ModelArgs(AttentionArgs):
    vocab_size: int = 129280
    dim: int = 7168
    inter_dim: int = 18432
    moe_inter_dim: int = 2048
    n_layers: int = 61
    n_dense_layers: int = 3
    n_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: YaRNScaling | None = None  # see the module docstring
    norm_eps: float = 1e-6
    moe_args: MoEArgs = field(
        default_factory=lambda: MoEArgs(
            num_experts=256, num_shared_experts=1, top_k=8, score_func="sigmoid", route_norm=True,
            route_scale=2.5, num_expert_groups=8, num_limited_groups=4, load_balance_coeff=1e-3,
        )
    )  # fmt: skip
    max_seq_len: int = 4096
    always_apply_yarn: bool = False  # see the module docstring
    depth_init: bool = True
    tie_word_embeddings: bool = False

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"n_dense_layers = {self.n_dense_layers} must be in [0, {self.n_layers}]")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim = {self.qk_rope_head_dim} must be even (RoPE rotates pairs)")

    @property
    def applied_rope_scaling(self) -> YaRNScaling | None:
        """`rope_scaling` when the RoPE table outgrows its original context or
        `always_apply_yarn` is set, else None."""
        scaling = self.rope_scaling
        if scaling is not None and (
            self.always_apply_yarn or self.max_seq_len > scaling.original_max_position_embeddings
        ):
            return scaling
        return None

    @property
    def qk_head_dim(self) -> int:
        """Width of one query/key head: the position-free part plus the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_heads(self) -> int:
        # MLA expands the latent to a key and value per query head: no grouping.
        return self.n_heads

    def num_flops_per_token(self, model: nn.Module, seq_len: int) -> tuple[int, float]:
        """(non-embedding parameters, training FLOPs per token); see `decoder_flops_per_token`."""
        return decoder_flops_per_token(
            model,
            self.n_layers,
            self.n_heads,
            self.qk_head_dim,
            self.attention_span(seq_len),
            self.tie_word_embeddings,
            v_head_dim=self.v_head_dim,
        )
