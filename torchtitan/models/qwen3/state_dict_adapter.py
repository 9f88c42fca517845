"""Qwen3 <-> Hugging Face ``Qwen3ForCausalLM`` (dense) and ``Qwen3MoeForCausalLM`` (MoE flavors)."""

import logging

import torch

from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.state_dict_adapter import HFConfigError, split_indices

logger = logging.getLogger(__name__)

# Routed experts in the layout Hub checkpoints use, and transformers' `save_pretrained` writes
# (4.x and 5.x): one gate/up/down projection per expert, each laid out like an nn.Linear weight.
# Our GroupedExperts stack them: w1 (gate) and w3 (up) [E, hidden, dim], w2 (down) [E, dim, hidden].
# (transformers 5 fuses them in memory, `mlp.experts.gate_up_proj` [E, 2*hidden, dim] and
# `mlp.experts.down_proj`, converting from this layout on load and back on save.)
ROUTED_MOE_KEY_MAP = {
    "layers.{}.moe.router.gate.weight": "model.layers.{}.mlp.gate.weight",
    "layers.{}.moe.experts.w1": "model.layers.{}.mlp.experts.{}.gate_proj.weight",
    "layers.{}.moe.experts.w2": "model.layers.{}.mlp.experts.{}.down_proj.weight",
    "layers.{}.moe.experts.w3": "model.layers.{}.mlp.experts.{}.up_proj.weight",
}
QK_NORM_KEY_MAP = {
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}
_EXPERT_BIAS = "layers.{}.moe.expert_bias"
_ROUTER = "layers.{}.moe.router.gate.weight"


def expert_bias_keys(keys) -> list[str]:
    """The MoE expert-bias keys among our state-dict `keys`."""
    return [key for key in keys if split_indices(key)[0] == _EXPERT_BIAS]


def without_expert_bias(state_dict: dict[str, torch.Tensor], hf_model: str) -> dict[str, torch.Tensor]:
    """`state_dict` less the MoE expert bias (auxiliary-loss-free balancing), for HF models that
    have none; a nonzero bias is warned about, since the exported model then routes without it."""
    kept = {}
    for key, tensor in state_dict.items():
        if split_indices(key)[0] != _EXPERT_BIAS:
            kept[key] = tensor
        elif tensor.device.type != "meta" and tensor.any():  # meta: a key mapping only
            logger.warning(
                "%s is nonzero but Hugging Face %s has no expert bias: it is dropped, so the "
                "exported model may route some tokens to other experts",
                key,
                hf_model,
            )
    return kept


def with_zero_expert_bias(ours: dict[str, torch.Tensor], model_args) -> dict[str, torch.Tensor]:
    """`ours` (converted from an HF model without expert bias) with a zero bias per MoE layer
    (`model_args.moe_args.num_experts` wide; dense models have no router and get none: an MoE
    checkpoint's router keys are then left for the load to report as unexpected)."""
    if getattr(model_args, "moe_args", None) is None:
        return ours
    for key in list(ours):
        template, layer = split_indices(key)
        if template == _ROUTER:
            ours[_EXPERT_BIAS.format(*layer)] = torch.zeros(model_args.moe_args.num_experts)
    return ours


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
