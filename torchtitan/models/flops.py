"""Parameter and FLOP counts of the decoder models, for MFU and the step log."""

import torch.nn as nn

from torchtitan.models.moe import MoE


def decoder_flops_per_token(
    model: nn.Module,
    n_layers: int,
    n_heads: int,
    head_dim: int,
    attention_span: float,
    tied_embeddings: bool,
    v_head_dim: int | None = None,
) -> tuple[int, float]:
    """(non-embedding parameters, training FLOPs per token) of a decoder-only transformer.

    6 FLOPs per parameter per token (forward + backward) plus the attention score and value
    matmuls, 6 * layers * heads * attention_span * (head_dim + v_head_dim), where
    `attention_span` is the keys a query is counted against (`AttentionArgs.attention_span`: the
    sequence length for causal masks, causality not discounted, and on the same basis fewer for
    sliding and chunked masks). The scores run over the query/key width `head_dim`, the values
    over `v_head_dim` (the same unless given; DeepSeek-V3's latent attention has 192 and 128).
    With tied embeddings the logits still cost a (dim x vocab) matmul, which the non-embedding
    count no longer holds, so it is added back to the FLOPs (upstream torchtitan leaves it out,
    counting 19% and 15% fewer FLOPs for Llama 3.2 1B and Qwen3 0.6B). A token runs only its
    `top_k` of each MoE layer's routed experts, so only that share of the routed expert weights
    counts toward the FLOPs (the parameter count keeps them all).
    """
    embedding = model.tok_embeddings.weight.numel()
    non_embedding = sum(p.numel() for p in model.parameters()) - embedding
    matmul_params = non_embedding + (embedding if tied_embeddings else 0) - _idle_expert_params(model)
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    attention = 6 * n_layers * n_heads * attention_span * (head_dim + v_head_dim)
    return non_embedding, 6 * matmul_params + attention


def _idle_expert_params(model: nn.Module) -> int:
    """Routed expert weights a token does not run: (1 - top_k / num_experts) of each MoE's."""
    idle = 0
    for module in model.modules():
        if isinstance(module, MoE):
            routed = sum(p.numel() for p in module.experts.parameters())
            idle += routed * (module.num_experts - module.args.top_k) // module.num_experts
    return idle
