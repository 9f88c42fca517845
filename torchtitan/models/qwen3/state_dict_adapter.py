"""Qwen3 <-> Hugging Face ``Qwen3ForCausalLM`` (dense) and ``Qwen3MoeForCausalLM`` (MoE flavors)."""

import torch

from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.models.moe_state_dict import (
    ROUTED_MOE_KEY_MAP,
    expert_bias_keys,
    with_zero_expert_bias,
    without_expert_bias,
)
from torchtitan.protocols.state_dict_adapter import HFConfigError

QK_NORM_KEY_MAP = {
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}


class Qwen3StateDictAdapter(Llama3StateDictAdapter):
    """Qwen3 <-> ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``.

    RoPE: as for Llama 3, q/k rows are permuted per head; so are the q/k norm weights, whose
    entries follow the rotary pairs of the head_dim they scale.

    MoE: experts per `ROUTED_MOE_KEY_MAP`, the router as ``mlp.gate.weight``. HF Qwen3-MoE has no
    expert bias (auxiliary-loss-free balancing): `to_hf` drops ``expert_bias`` (warning when it is
    nonzero, since HF then routes without it) and `from_hf` fills it with zeros. The MoE's
    ``tokens_per_expert`` counts are not persistent, so never in a state dict.
    """

    key_map = {**Llama3StateDictAdapter.key_map, **QK_NORM_KEY_MAP, **ROUTED_MOE_KEY_MAP}
    rope_permuted = Llama3StateDictAdapter.rope_permuted | {
        "layers.{}.attention.q_norm.weight",
        "layers.{}.attention.k_norm.weight",
    }

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return super().to_hf(without_expert_bias(state_dict, "Qwen3-MoE"))

    def left_out_of_hf(self, keys) -> list[str]:
        return expert_bias_keys(keys)

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return with_zero_expert_bias(super().from_hf(hf_state_dict), self.model_args)

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict:
        a = self.model_args
        if not a.qk_norm:
            raise HFConfigError("Hugging Face Qwen3 always applies q/k norms; qk_norm = False has none")
        config = {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **self.base_hf_config(dtype),
            "intermediate_size": a.hidden_dim,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "use_sliding_window": False,
            "max_window_layers": a.n_layers,
        }
        if a.moe_args is None:
            return config
        return {**config, **self._moe_hf_config(), "architectures": ["Qwen3MoeForCausalLM"]}

    def _moe_hf_config(self) -> dict:
        """HF Qwen3-MoE routes every layer by softmax top-k, optionally renormalized, with no
        scale, groups or shared experts; other routing settings raise HFConfigError."""
        m = self.model_args.moe_args
        unsupported = {
            "score_func": m.score_func != "softmax",
            "route_scale": m.route_scale != 1.0,
            "num_expert_groups": m.num_expert_groups is not None,
            "num_shared_experts": m.num_shared_experts != 0,
        }
        if bad := [name for name, is_bad in unsupported.items() if is_bad]:
            raise HFConfigError(
                f"Hugging Face Qwen3-MoE cannot express MoEArgs {', '.join(bad)} = "
                f"{', '.join(str(getattr(m, name)) for name in bad)}: it routes by softmax top-k "
                "without scale, expert groups or shared experts"
            )
        return {
            "model_type": "qwen3_moe",
            "moe_intermediate_size": self.model_args.moe_hidden_dim,
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "norm_topk_prob": m.route_norm,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
