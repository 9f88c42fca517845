"""Small building blocks shared by several models."""

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
