"""The one attention module every model uses; backends are chosen by name.

Only `sdpa` (causal scaled-dot-product attention) exists so far. Models call
`build_attention(backend)` and never branch on the backend or the device themselves.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

ATTENTION_BACKENDS = ("sdpa",)


class ScaledDotProductAttention(nn.Module):
    """Causal attention over (batch, heads, seq, head_dim) tensors via `F.scaled_dot_product_attention`.

    Keys and values with fewer heads than the queries (GQA) are repeated to the query head
    count first, so every SDPA kernel (including CPU flash) applies.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        repeats = q.shape[1] // k.shape[1]
        if repeats > 1:
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def build_attention(backend: str) -> nn.Module:
    """The attention module for `backend`; raises ValueError for an unknown name."""
    if backend == "sdpa":
        return ScaledDotProductAttention()
    raise ValueError(f"unknown attention backend '{backend}'; valid: {', '.join(ATTENTION_BACKENDS)}")
