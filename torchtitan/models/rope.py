"""Rotary position embeddings shared by every model, in the interleaved-pair layout.

Pairs are (x[2i], x[2i+1]), as in Meta's reference Llama code; Hugging Face checkpoints use
the half-split layout, which state-dict adapters convert by permuting q/k rows.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn


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


@dataclass
class YaRNScaling:
    """YaRN frequency scaling (DeepSeek-V3's long-context extension), with the field names and
    meaning of Hugging Face's `rope_scaling` of type "yarn".

    Frequencies that turn fewer than `beta_slow` times over the original context are divided by
    `factor` (interpolated), those turning more than `beta_fast` times are kept, and a linear ramp
    blends the dims between. Two magnitudes follow from `mscale` and `mscale_all_dim`:
    `cos_sin_factor` multiplies the cos/sin table, `softmax_scale_factor` the attention's
    softmax scale (1 for both when the two mscales are equal and nonzero, as published).
    """

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def cos_sin_factor(self) -> float:
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor, 1.0)

    def softmax_scale_factor(self) -> float:
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def hf_config(self) -> dict:
        """This scaling as config.json's `rope_scaling`."""
        fields = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                  "mscale_all_dim")  # fmt: skip
        return {"type": "yarn", "rope_type": "yarn", **{name: getattr(self, name) for name in fields}}


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_frequencies(freqs: torch.Tensor, head_dim: int, theta: float, scaling: YaRNScaling) -> torch.Tensor:
    def dim_turning(turns: float) -> float:
        """The (fractional) dim whose frequency turns `turns` times over the original context."""
        wavelengths = scaling.original_max_position_embeddings / (turns * 2 * math.pi)
        return head_dim * math.log(wavelengths) / (2 * math.log(theta))

    low = max(math.floor(dim_turning(scaling.beta_fast)), 0)
    high = min(math.ceil(dim_turning(scaling.beta_slow)), head_dim - 1)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)
    interpolated = ramp.clamp(0, 1)  # 0: keep the frequency, 1: divide it by factor
    return freqs / scaling.factor * interpolated + freqs * (1 - interpolated)


def precompute_rope_cache(
    head_dim: int, max_seq_len: int, theta: float, scaling: RoPEScaling | YaRNScaling | None = None
) -> torch.Tensor:
    """(max_seq_len, head_dim // 2, 2) tensor of cos and sin per position and frequency.

    `scaling`: Llama 3.1's (`RoPEScaling`) or YaRN's (`YaRNScaling`, whose cos/sin factor is
    applied too), or None for plain RoPE.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if isinstance(scaling, YaRNScaling):
        freqs = _yarn_frequencies(freqs, head_dim, theta, scaling)
    elif scaling is not None:
        freqs = _scale_frequencies(freqs, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    cache = torch.stack([angles.cos(), angles.sin()], dim=-1)
    if isinstance(scaling, YaRNScaling) and scaling.cos_sin_factor() != 1.0:
        cache = cache * scaling.cos_sin_factor()
    return cache


def apply_rope(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """Rotate `x` of shape (batch, seq, heads, head_dim) by the cache's first `seq` positions.

    Computed in fp32 and cast back, so bf16 activations keep accurate angles. Eagerly, as one
    complex multiply (19 kernels forward and backward, writing 12x q's bytes, where the
    real form's products, sums and stack took 35 and 33x); compiled, in the real form, which
    inductor fuses into one kernel but cannot generate complex code for. Both give the same
    bits.
    """
    seq_len = x.shape[1]
    pairs = x.float().unflatten(-1, (-1, 2))
    if not torch.compiler.is_compiling():
        rotations = torch.view_as_complex(rope_cache[:seq_len, None])
        return torch.view_as_real(torch.view_as_complex(pairs) * rotations).flatten(-2).type_as(x)
    cos, sin = rope_cache[:seq_len, None, :, 0], rope_cache[:seq_len, None, :, 1]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


class Rotary(nn.Module):
    """`apply_rope` as a module without parameters: a cheap region of the block (see
    `DecoderBlock.cheap_regions`) that AC can recompute alone. Its backward otherwise holds an
    fp32 copy of its input."""

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, rope_cache)
