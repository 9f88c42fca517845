"""Small building blocks shared by several models."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan.distributed.utils import init_param_


def trunc_normal(std: float):
    """An in-place init: normal(0, std) truncated at 3 std."""
    return lambda t: nn.init.trunc_normal_(t, mean=0.0, std=std, a=-3 * std, b=3 * std)


class FeedForward(nn.Module):
    """SwiGLU MLP `w2(silu(w1(x)) * w3(x))` of nn.Linear layers (named so that a TP plan shards
    w1/w3 column-wise and w2 row-wise): dense feed-forwards and MoE shared experts."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float) -> None:
        init_param_(self.w1.weight, trunc_normal(0.02))
        for linear in (self.w2, self.w3):
            init_param_(linear.weight, trunc_normal(out_std))


def depth_scaled_std(layer_id: int, n_layers: int, depth_init: bool) -> float:
    """Init std of a block's output projections: 0.02 / sqrt(2 * depth), where depth is the
    block's 1-based index (depth_init) or the layer count, so deep residual sums stay bounded."""
    depth = layer_id + 1 if depth_init else n_layers
    return 0.02 / math.sqrt(2 * depth)


class DecoderBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then h + mlp(norm(h)).

    `mlp` is registered as `feed_forward` (dense) or `moe` (routed experts), the names the AC
    module's flex rules and the TP plans look for; `self.mlp` is whichever is present.
    Subclasses build the model's own attention and mlp and pass them in.
    """

    def __init__(self, dim: int, norm_eps: float, attention: nn.Module, mlp: nn.Module, mlp_name: str,
                 out_std: float):  # fmt: skip
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.register_module(mlp_name, mlp)
        self.mlp_name, self.out_std = mlp_name, out_std

    @property
    def mlp(self) -> nn.Module:
        return getattr(self, self.mlp_name)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache)
        return h + self.mlp(self.ffn_norm(h))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            init_param_(norm.weight, nn.init.ones_)
        self.attention.init_weights(self.out_std)
        self.mlp.init_weights(self.out_std)
