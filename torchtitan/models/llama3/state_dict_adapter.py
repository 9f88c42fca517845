"""Llama 3 <-> Hugging Face ``LlamaForCausalLM`` (model_type "llama").

The key maps here are the Llama-style names every HF decoder in this repo shares (Qwen3 and
DeepSeek-V3 reuse them).
"""

import torch

from torchtitan.protocols.state_dict_adapter import StateDictAdapter

# Embedding, block norms, dense SwiGLU feed-forward, final norm and logits.
DECODER_KEY_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Grouped-query attention projections.
GQA_KEY_MAP = {
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
}


class Llama3StateDictAdapter(StateDictAdapter):
    """Llama 3 <-> ``LlamaForCausalLM``.

    RoPE: our q/k rows pair (2i, 2i+1) per head, HF's rotate-half pairs (i, i + head_dim/2), so
    ``wq``/``wk`` rows are permuted per head both ways (Meta's original checkpoints <-> HF).
    Llama 3.1 frequency scaling exports as ``rope_scaling`` of type "llama3".
    """

    key_map = {**DECODER_KEY_MAP, **GQA_KEY_MAP}
    rope_permuted = frozenset({"layers.{}.attention.wq.weight", "layers.{}.attention.wk.weight"})

    @property
    def rope_head_dim(self) -> int:
        return self.model_args.head_dim

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict:
        a = self.model_args
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **self.base_hf_config(dtype),
            "intermediate_size": a.ffn_hidden_dim,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "mlp_bias": False,
        }
        if a.rope_scaling is not None:
            config["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": a.rope_scaling.factor,
                "low_freq_factor": a.rope_scaling.low_freq_factor,
                "high_freq_factor": a.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": a.rope_scaling.original_max_position_embeddings,
            }
        return config
