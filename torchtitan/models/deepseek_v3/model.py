"""DeepSeek-V3: multi-head latent attention (MLA), a few dense SwiGLU blocks, then routed-MoE
blocks with shared experts, built on the meta device.

Reused, not copied: the shared SwiGLU `FeedForward` (dense blocks), Llama 3's decoder (`Transformer`:
embedding -> blocks -> norm -> logits, and its `init_weights`), the shared `MoE` layer, RoPE
(`apply_rope`, interleaved pairs) and attention (`build_attention`).
"""

import torch
import torch.nn as nn

from torchtitan.distributed.param_init import init_param_
from torchtitan.models.attention import AttentionMasks, build_attention
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from torchtitan.models.layers import DecoderBlock, FeedForward, RMSNorm, depth_scaled_std, trunc_normal
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.moe import MoE
from torchtitan.models.rope import Rotary, precompute_rope_cache


class MultiHeadLatentAttention(nn.Module):
    """MLA over (batch, seq, dim) inputs.

    Queries: `wq` (dim -> heads * qk_head_dim) when `q_lora_rank` is 0, else the bottleneck
    `wq_b(q_norm(wq_a(x)))`. Keys and values: `wkv_a` projects to a latent of `kv_lora_rank`
    plus one shared rotary key head of `qk_rope_head_dim`; the latent goes through `kv_norm`
    and `wkv_b` to per-head position-free keys (`qk_nope_head_dim`) and values (`v_head_dim`).
    RoPE touches only the rotary parts; the one rotary key head is broadcast to every head.

    The softmax scale is the backends' default, 1 / sqrt(q's last dim) = 1 / sqrt(nope + rope),
    times YaRN's `softmax_scale_factor` when YaRN applies (see `args.applied_rope_scaling`).
    Value heads may be narrower or wider than q/k heads: SDPA and flex_attention both allow a
    different last dim for v.
    """

    def __init__(self, args: DeepSeekV3ModelArgs):
        super().__init__()
        self.nope_dim, self.rope_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_dim = args.v_head_dim
        self.qk_head_dim = args.qk_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        q_out = args.n_heads * args.qk_head_dim
        if args.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        else:
            self.wq = None
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, eps=args.norm_eps)
        kv_out = args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)
        self.wkv_b = nn.Linear(args.kv_lora_rank, kv_out, bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        # Identity; under tensor parallelism it sums the rotary key's gradient over the ranks,
        # since the one rotary key head feeds every rank's own heads.
        self.shared_rope_key = nn.Identity()
        self.sdpa = build_attention(args.attn_backend)
        self.rotary = Rotary()
        yarn = args.applied_rope_scaling
        self.softmax_scale = None if yarn is None else args.qk_head_dim**-0.5 * yarn.softmax_scale_factor()

    def forward(
        self, x: torch.Tensor, rope_cache: torch.Tensor, masks: AttentionMasks | None = None
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 heads: under tensor parallelism each rank holds only its local heads.
        q_nope, q_pe = q.view(batch, seq_len, -1, self.qk_head_dim).split([self.nope_dim, self.rope_dim], -1)
        q = torch.cat([q_nope, self.rotary(q_pe, rope_cache)], dim=-1)

        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_pe = self.rotary(k_pe.unsqueeze(2), rope_cache)  # one rotary key head: (batch, seq, 1, rope)
        k_pe = self.shared_rope_key(k_pe)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq_len, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)

        out = self.sdpa(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), masks=masks, scale=self.softmax_scale
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                init_param_(linear.weight, trunc_normal(0.02))
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                init_param_(norm.weight, nn.init.ones_)
        init_param_(self.wo.weight, trunc_normal(out_std))


class DeepSeekV3Block(DecoderBlock):
    """Pre-norm block with MLA. Blocks with `layer_id < n_dense_layers` hold a SwiGLU
    `feed_forward` of width `inter_dim`; the others a routed `moe` (experts of width
    `moe_inter_dim`, plus shared experts) in its place."""

    def __init__(self, layer_id: int, args: DeepSeekV3ModelArgs):
        out_std = depth_scaled_std(layer_id, args.n_layers, args.depth_init)
        if layer_id < args.n_dense_layers:
            mlp, name = FeedForward(args.dim, args.inter_dim), "feed_forward"
        else:
            mlp, name = MoE(args.dim, args.moe_inter_dim, args.moe_args), "moe"
        super().__init__(args.dim, args.norm_eps, MultiHeadLatentAttention(args), mlp, name, out_std)


class DeepSeekV3Model(Transformer):
    """Decoder-only DeepSeek-V3 (without the multi-token-prediction module). Blocks live in
    `self.layers` (a ModuleDict keyed "0", "1", ...), where activation checkpointing and FSDP
    find them. `init_weights` and `forward` are Llama 3's; the RoPE table covers only the
    rotary head width `qk_rope_head_dim`.
    """

    block_cls = DeepSeekV3Block

    def _rope_cache(self) -> torch.Tensor:
        a = self.args
        return precompute_rope_cache(a.qk_rope_head_dim, a.max_seq_len, a.rope_theta, a.applied_rope_scaling)
