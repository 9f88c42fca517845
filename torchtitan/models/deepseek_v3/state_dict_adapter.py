"""DeepSeek-V3 <-> Hugging Face ``DeepseekV3ForCausalLM`` (model_type "deepseek_v3"), and
softmax-routed flavors (the 16B, DeepSeek-V2-Lite's shapes) <-> ``DeepseekV2ForCausalLM``."""

import torch

from torchtitan.models.llama3.state_dict_adapter import DECODER_KEY_MAP
from torchtitan.models.moe_state_dict import (
    ROUTED_MOE_KEY_MAP,
    expert_bias_keys,
    with_zero_expert_bias,
    without_expert_bias,
)
from torchtitan.protocols.state_dict_adapter import HFConfigError, StateDictAdapter, split_indices

# Multi-head latent attention; the query bottleneck keys (wq_a, q_norm, wq_b) replace wq when
# q_lora_rank > 0.
MLA_KEY_MAP = {
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wq_a.weight": "model.layers.{}.self_attn.q_a_proj.weight",
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_a_layernorm.weight",
    "layers.{}.attention.wq_b.weight": "model.layers.{}.self_attn.q_b_proj.weight",
    "layers.{}.attention.wkv_a.weight": "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight",
    "layers.{}.attention.kv_norm.weight": "model.layers.{}.self_attn.kv_a_layernorm.weight",
    "layers.{}.attention.wkv_b.weight": "model.layers.{}.self_attn.kv_b_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
}
SHARED_EXPERTS_KEY_MAP = {
    "layers.{}.moe.expert_bias": "model.layers.{}.mlp.gate.e_score_correction_bias",
    "layers.{}.moe.shared_experts.w1.weight": "model.layers.{}.mlp.shared_experts.gate_proj.weight",
    "layers.{}.moe.shared_experts.w2.weight": "model.layers.{}.mlp.shared_experts.down_proj.weight",
    "layers.{}.moe.shared_experts.w3.weight": "model.layers.{}.mlp.shared_experts.up_proj.weight",
}
# HF builds the latent norms (q_a_layernorm, kv_a_layernorm) with this eps, whatever rms_norm_eps.
_HF_LATENT_NORM_EPS = 1e-6


class DeepSeekV3StateDictAdapter(StateDictAdapter):
    """DeepSeek-V3 <-> ``DeepseekV3ForCausalLM``.

    RoPE: no permutation. DeepSeek's published weights keep the rotary parts of q and of the
    shared key (the last ``qk_rope_head_dim`` rows of each q head, and of ``kv_a_proj_with_mqa``)
    in interleaved pairs, as ours do, and the config's ``rope_interleave = true`` makes
    transformers rotate those pairs.

    MoE: routed experts per `ROUTED_MOE_KEY_MAP`, the router as ``mlp.gate.weight``, the expert
    bias as ``mlp.gate.e_score_correction_bias`` (fp32 in both), shared experts as
    ``mlp.shared_experts.*``. The MoE's ``tokens_per_expert`` counts are not persistent, so never
    in a state dict.

    `from_hf` skips the multi-token-prediction module that published checkpoints store as the
    layers past ``num_hidden_layers``: it is not built here.

    Softmax routing (``score_func = "softmax"``, as the 16B flavor has) is DeepSeek-V2's, which
    transformers builds as ``DeepseekV2ForCausalLM``: same keys and RoPE layout, but no expert
    bias, so `to_hf` drops ours (warning when nonzero) and `from_hf` fills it with zeros.
    """

    key_map = {**DECODER_KEY_MAP, **MLA_KEY_MAP, **ROUTED_MOE_KEY_MAP, **SHARED_EXPERTS_KEY_MAP}

    def ignores_hf_key(self, hf_key: str) -> bool:
        template, indices = split_indices(hf_key)
        is_mtp = template.startswith("model.layers.{}.") and indices[0] >= self.model_args.n_layers
        return is_mtp or super().ignores_hf_key(hf_key)

    @property
    def is_v2(self) -> bool:
        """Softmax-routed: exported as transformers' DeepSeek-V2."""
        return self.model_args.moe_args.score_func == "softmax"

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return super().to_hf(without_expert_bias(state_dict, "DeepSeek-V2") if self.is_v2 else state_dict)

    def left_out_of_hf(self, keys) -> list[str]:
        return expert_bias_keys(keys) if self.is_v2 else []

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ours = super().from_hf(hf_state_dict)
        return with_zero_expert_bias(ours, self.model_args) if self.is_v2 else ours

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict:
        if self.is_v2:
            return self._v2_hf_config(dtype)
        self._check_expressible()
        m = self.model_args.moe_args
        # Without node-limited routing, one group holding every expert selects the same experts.
        groups, limited = (m.num_expert_groups, m.num_limited_groups) if m.num_expert_groups else (1, 1)
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            **self._mla_hf_config(dtype),
            "rope_interleave": True,
            "norm_topk_prob": m.route_norm,
            "n_group": groups,
            "topk_group": limited,
            # Read by DeepSeek's own and other inference code; transformers implies them.
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "num_nextn_predict_layers": 0,
        }

    def _mla_hf_config(self, dtype: torch.dtype) -> dict:
        """The config fields DeepSeek-V2 and V3 share: the decoder, MLA, the MoE's sizes, YaRN."""
        a, m = self.model_args, self.model_args.moe_args
        return {
            **self.base_hf_config(dtype),
            "num_key_value_heads": a.n_heads,
            "intermediate_size": a.inter_dim,
            "first_k_dense_replace": a.n_dense_layers,
            "q_lora_rank": a.q_lora_rank or None,
            "kv_lora_rank": a.kv_lora_rank,
            "qk_nope_head_dim": a.qk_nope_head_dim,
            "qk_rope_head_dim": a.qk_rope_head_dim,
            "v_head_dim": a.v_head_dim,
            "moe_intermediate_size": a.moe_inter_dim,
            "n_routed_experts": m.num_experts,
            "n_shared_experts": m.num_shared_experts,
            "num_experts_per_tok": m.top_k,
            "routed_scaling_factor": m.route_scale,
            **self._yarn_hf_config(),
        }

    def _yarn_hf_config(self) -> dict:
        """`rope_scaling` when this model applies YaRN (see `applied_rope_scaling`), with the
        context it extends to as `max_position_embeddings` (163840 published): transformers
        releases that derive the factor from the two contexts then still get the same one."""
        a = self.model_args
        if (yarn := a.applied_rope_scaling) is None:
            return {}
        extended = round(yarn.factor * yarn.original_max_position_embeddings)
        return {"rope_scaling": yarn.hf_config(), "max_position_embeddings": max(a.max_seq_len, extended)}

    def _v2_hf_config(self, dtype: torch.dtype) -> dict:
        """``DeepseekV2ForCausalLM``: softmax top-k ("greedy"), never renormalized."""
        a, m = self.model_args, self.model_args.moe_args
        problems = {
            "route_norm = True (HF DeepSeek-V2 does not renormalize the top-k weights)": m.route_norm,
            "num_shared_experts = 0 (HF always has shared experts)": m.num_shared_experts == 0,
            # HF's group-limited greedy ranks groups by their best score, ours by the top-2 sum.
            "num_expert_groups (HF DeepSeek-V2 ranks groups differently)": m.num_expert_groups is not None,
            f"norm_eps = {a.norm_eps} (HF's latent norms use {_HF_LATENT_NORM_EPS})": (
                a.norm_eps != _HF_LATENT_NORM_EPS
            ),
        }
        if bad := [problem for problem, is_bad in problems.items() if is_bad]:
            raise HFConfigError(f"Hugging Face DeepSeek-V2 cannot express {'; '.join(bad)}")
        return {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            **self._mla_hf_config(dtype),
            "topk_method": "greedy",
            "norm_topk_prob": False,
            "scoring_func": "softmax",
        }

    def _check_expressible(self) -> None:
        """Raise HFConfigError for args ``DeepseekV3ForCausalLM`` computes differently."""
        a, m = self.model_args, self.model_args.moe_args
        experts_per_group = m.num_experts // (m.num_expert_groups or 1)
        problems = {
            f"score_func = '{m.score_func}' (HF scores experts by sigmoid)": m.score_func != "sigmoid",
            "num_shared_experts = 0 (HF always has shared experts)": m.num_shared_experts == 0,
            f"{experts_per_group} expert per group (HF ranks groups by their top 2)": experts_per_group < 2,
            f"norm_eps = {a.norm_eps} (HF's latent norms use {_HF_LATENT_NORM_EPS})": (
                a.norm_eps != _HF_LATENT_NORM_EPS
            ),
        }
        if bad := [problem for problem, is_bad in problems.items() if is_bad]:
            raise HFConfigError(f"Hugging Face DeepSeek-V3 cannot express {'; '.join(bad)}")
