"""Rotary position embeddings shared by every model, in the interleaved-pair layout.

Pairs are (x[2i], x[2i+1]), as in Meta's reference Llama code; Hugging Face checkpoints use
the half-split layout, which state-dict adapters convert by permuting q/k rows.
"""

import math
from dataclasses import dataclass

import torch


@dataclass
class RoPEScaling:
    """Llama 3.1 frequency scaling for long context."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def _scale_frequencies(freqs: torch.Tensor, scaling: RoPEScaling) -> torch.Tensor:
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / scaling.factor, freqs)
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, blended, scaled)


def precompute_rope_cache(
    head_dim: int, max_seq_len: int, theta: float, scaling: RoPEScaling | None = None
) -> torch.Tensor:
    """(max_seq_len, head_dim // 2, 2) tensor of cos and sin per position and frequency."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is not None:
        freqs = _scale_frequencies(freqs, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """Rotate `x` of shape (batch, seq, heads, head_dim) by the cache's first `seq` positions.

    Computed in fp32 and cast back, so bf16 activations keep accurate angles.
    """
    seq_len = x.shape[1]
    cos, sin = rope_cache[:seq_len, None, :, 0], rope_cache[:seq_len, None, :, 1]
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)
