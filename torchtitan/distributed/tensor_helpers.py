"""Small tensor helpers the layouts share: an identity that scales its gradient, and a DTensor
made plain."""

import torch
from torch.distributed.tensor import DTensor


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity in forward; multiplies x's gradient by `scale` in backward."""
    return _ScaleGrad.apply(x, scale)


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` as a plain tensor: a DTensor (e.g. the loss under loss parallel) is materialized."""
    return t.full_tensor() if isinstance(t, DTensor) else t
