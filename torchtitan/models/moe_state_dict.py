"""How MoE layers map to Hugging Face checkpoints, shared by the Qwen3 MoE and DeepSeek-V3
state-dict adapters: the routed experts' keys, and the expert bias (auxiliary-loss-free
balancing) that some HF models lack."""

import logging

import torch

from torchtitan.protocols.state_dict_adapter import split_indices

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
