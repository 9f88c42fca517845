"""Llama 3: GQA attention with RoPE, RMSNorm, SwiGLU feed-forward, built on the meta device."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan.components.loss_head import ChunkedLoss
from torchtitan.distributed.context_parallel import rope_rows, tokens_for_masks
from torchtitan.distributed.param_init import init_param_, part_rng
from torchtitan.models.attention import AttentionMasks, build_attention, masks_under_context_parallel
from torchtitan.models.layers import DecoderBlock, FeedForward, RMSNorm, depth_scaled_std, trunc_normal
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.rope import Rotary, precompute_rope_cache


class Attention(nn.Module):
    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.sdpa = build_attention(args.attn_backend)
        self.rotary = Rotary()

    def forward(
        self, x: torch.Tensor, rope_cache: torch.Tensor, masks: AttentionMasks | None = None
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its local heads.
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = self.normalize_qk(q, k)
        q, k = self.rotary(q, rope_cache), self.rotary(k, rope_cache)
        out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), masks=masks)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook before RoPE on (batch, seq, heads, head_dim) queries and keys; none in Llama 3."""
        return q, k

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init_param_(linear.weight, trunc_normal(0.02))
        init_param_(self.wo.weight, trunc_normal(out_std))


class TransformerBlock(DecoderBlock):
    def __init__(self, layer_id: int, args: TransformerModelArgs):
        out_std = depth_scaled_std(layer_id, args.n_layers, args.depth_init)
        mlp = FeedForward(args.dim, args.ffn_hidden_dim)
        super().__init__(args.dim, args.norm_eps, Attention(args), mlp, "feed_forward", out_std)


class Transformer(nn.Module):
    """Decoder-only Llama 3. Blocks live in `self.layers` (a ModuleDict keyed "0", "1", ...),
    which is where activation checkpointing and FSDP find them.

    With `tie_word_embeddings` there is no `output` module: logits reuse the embedding matrix.
    A model family that differs only in its blocks subclasses this and sets `block_cls`.
    """

    block_cls = TransformerBlock

    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.block_cls(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = None if args.tie_word_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)

    def _rope_cache(self) -> torch.Tensor:
        a = self.args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Fill every parameter and buffer in place (after `to_empty`), same for any layout.

        Each part (the embedding, each block, the output projection) draws from its own
        stream of the global seed (`part_rng`), so a pipeline stage that holds some of the
        parts gets the weights the whole model has.
        """
        rope_cache = self._rope_cache()
        self.rope_cache = rope_cache.to(buffer_device or self.rope_cache.device)
        device = next(self.parameters()).device
        if self.tok_embeddings is not None:
            with part_rng(0, device):
                if self.args.tie_word_embeddings:
                    # Tied logits reuse the embedding, so it takes the output projection's scale.
                    init_param_(self.tok_embeddings.weight, trunc_normal(self.args.dim**-0.5))
                else:
                    init_param_(self.tok_embeddings.weight, nn.init.normal_)
        for layer_id, block in self.layers.items():
            with part_rng(1 + int(layer_id), device):
                block.init_weights()
        if self.norm is not None:
            init_param_(self.norm.weight, nn.init.ones_)
        if self.output is not None:
            with part_rng(1 + self.args.n_layers, device):
                init_param_(self.output.weight, trunc_normal(self.args.dim**-0.5))

    def forward(
        self, tokens: torch.Tensor, labels: torch.Tensor | None = None, loss: ChunkedLoss | None = None
    ) -> torch.Tensor:
        """Logits of `tokens` ([batch, seq] ids), or with `labels` ([batch, seq]) the mean loss
        that `loss` computes from the final hidden states, which never holds the whole logits
        when it runs in chunks.

        A pipeline stage holds some of the parts (see `pipeline_parallel.prune_to_stage`): one
        without the embedding takes the previous stage's hidden states instead of ids, one
        without the final norm returns its hidden states. Under context parallelism `tokens`
        are this rank's share of each sequence (`context_parallel.ContextParallel.sharded`).
        """
        # Once per batch, not per layer: block_causal's mask depends on where this batch's EOS are.
        masks = masks_under_context_parallel(self.args.build_layer_masks(tokens_for_masks(tokens)))
        rope_cache = rope_rows(self.rope_cache)
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        for layer_id, block in self.layers.items():
            h = block(h, rope_cache, masks[int(layer_id)])
        if self.norm is None:
            return h
        h = self.norm(h)
        if labels is None:
            return self.project(h)
        # Inside this forward, so that FSDP gathers the output weight once for all the chunks.
        return loss(self.project, h, labels, self.linear_head_weight(), self.args.vocab_size)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the final norm's output: the output projection, or the embedding when tied."""
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    def linear_head_weight(self) -> torch.Tensor | None:
        """The weight `project` is a plain `F.linear` of (the fused loss head reads it), or None
        when the output projection is something else (a float8 layer)."""
        if self.output is None:
            return self.tok_embeddings.weight
        return self.output.weight if type(self.output) is nn.Linear else None
