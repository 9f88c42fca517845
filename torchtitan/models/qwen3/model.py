"""Qwen3 (dense): Llama 3's decoder with per-head q/k RMSNorm, an independent head_dim and an
explicit feed-forward width, built on the meta device.

What Qwen3 shares with Llama 3 is imported, not copied: the GQA projections and their init
(`Attention`), the SwiGLU `FeedForward`, and the decoder's `init_weights` and `forward`
(embedding -> blocks -> norm -> tied or untied logits). Attention and RoPE are the shared
modules (`build_attention`, `apply_rope`).
"""

import torch
import torch.nn as nn

from torchtitan.distributed.param_init import init_param_
from torchtitan.models.layers import DecoderBlock, FeedForward, RMSNorm, depth_scaled_std
from torchtitan.models.llama3.model import Attention, Transformer
from torchtitan.models.moe import MoE
from torchtitan.models.qwen3.args import Qwen3ModelArgs
from torchtitan.models.rope import precompute_rope_cache


class Qwen3Attention(Attention):
    """Llama 3's GQA attention (wq/wk/wv/wo of width heads * head_dim, SDPA, init) plus
    Qwen3's qk-norm: an RMSNorm over head_dim applied to every query and key head before RoPE.

    The norms see (batch, seq, heads, head_dim) and normalize the last dim only, so under
    tensor parallelism they work unchanged on each rank's local heads.
    """

    def __init__(self, args: Qwen3ModelArgs):
        super().__init__(args)
        self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def init_weights(self, out_std: float) -> None:
        super().init_weights(out_std)
        if self.q_norm is not None:
            for norm in (self.q_norm, self.k_norm):
                init_param_(norm.weight, nn.init.ones_)


class Qwen3Block(DecoderBlock):
    """Llama 3's pre-norm block with Qwen3 attention; dense flavors hold a `feed_forward`, MoE
    flavors a routed `moe` in its place."""

    def __init__(self, layer_id: int, args: Qwen3ModelArgs):
        out_std = depth_scaled_std(layer_id, args.n_layers, args.depth_init)
        if args.moe_args is None:
            mlp, name = FeedForward(args.dim, args.hidden_dim), "feed_forward"
        else:
            mlp, name = MoE(args.dim, args.moe_hidden_dim, args.moe_args), "moe"
        super().__init__(args.dim, args.norm_eps, Qwen3Attention(args), mlp, name, out_std)


class Qwen3Model(Transformer):
    """Decoder-only Qwen3. Blocks live in `self.layers` (a ModuleDict keyed "0", "1", ...),
    which is where activation checkpointing and FSDP find them.

    With `tie_word_embeddings` (0.6B, 1.7B, 4B) there is no `output` module: logits reuse the
    embedding matrix. `init_weights` and `forward` are Llama 3's.
    """

    block_cls = Qwen3Block

    def _rope_cache(self) -> torch.Tensor:
        a = self.args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta)
