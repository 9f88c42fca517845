"""DeepSeek-V3 flavors and their TrainSpec registration."""

from dataclasses import replace

from torchtitan.components.dataloader import build_text_dataloader
from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_scheduler
from torchtitan.components.optimizer import build_optimizer
from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseek_v3
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from torchtitan.models.moe import MoEArgs, load_balance_step, pop_aux_loss
from torchtitan.models.rope import YaRNScaling
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

# Sources:
#   671B: deepseek-ai/DeepSeek-V3 config.json (hidden_size 7168, intermediate_size 18432,
#     moe_intermediate_size 2048, 61 layers, first_k_dense_replace 3, 128 heads, q_lora_rank
#     1536, kv_lora_rank 512, qk_nope/rope/v head dims 128/64/128, 256 routed + 1 shared
#     experts, top-8, sigmoid scoring, norm_topk_prob, routed_scaling_factor 2.5, n_group 8,
#     topk_group 4, vocab 129280, rope_theta 1e4, rms_norm_eps 1e-6). The model card's 671B
#     excludes the 14B multi-token-prediction module, which is not built here either.
#   16B: DeepSeek-V2-Lite shapes (deepseek-ai/DeepSeek-V2-Lite config.json: hidden 2048,
#     intermediate 10944, moe_intermediate 1408, 27 layers, first_k_dense_replace 1, 16 heads,
#     no q_lora, kv_lora_rank 512, 64 routed + 2 shared experts, top-6 softmax, vocab 102400),
#     as torchtitan's DeepSeek-V3 16B flavor uses them; published total 15.7B.
#   YaRN (both): rope_scaling of their config.json (factor 40 over an original 4096 positions,
#     beta_fast 32, beta_slow 1; mscale and mscale_all_dim 1.0 for V3, 0.707 for V2-Lite),
#     applied only when training.seq_len exceeds 4096, or always with model.always_apply_yarn
#     (see args.py).
# The debug model matches the bundled 2048-token tokenizer and stays cheap on a CPU.
deepseek_v3_flavors = {
    "debugmodel": DeepSeekV3ModelArgs(
        vocab_size=2048, dim=256, inter_dim=768, moe_inter_dim=256, n_layers=6, n_dense_layers=1,
        n_heads=16, q_lora_rank=0, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32,
        moe_args=MoEArgs(
            num_experts=8, num_shared_experts=1, top_k=2, score_func="sigmoid", route_norm=True,
            route_scale=1.0, num_expert_groups=2, num_limited_groups=1, load_balance_coeff=1e-3,
        ),
    ),
    "16B": DeepSeekV3ModelArgs(
        vocab_size=102400, dim=2048, inter_dim=10944, moe_inter_dim=1408, n_layers=27, n_dense_layers=1,
        n_heads=16, q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128,
        moe_args=MoEArgs(
            num_experts=64, num_shared_experts=2, top_k=6, score_func="softmax", route_norm=False,
            route_scale=1.0, load_balance_coeff=1e-3,
        ),
        rope_scaling=YaRNScaling(mscale=0.707, mscale_all_dim=0.707),
    ),
    "671B": DeepSeekV3ModelArgs(
        vocab_size=129280, dim=7168, inter_dim=18432, moe_inter_dim=2048, n_layers=61, n_dense_layers=3,
        n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128,
        moe_args=MoEArgs(
            num_experts=256, num_shared_experts=1, top_k=8, score_func="sigmoid", route_norm=True,
            route_scale=2.5, num_expert_groups=8, num_limited_groups=4, load_balance_coeff=1e-3,
        ),
        rope_scaling=YaRNScaling(),
    ),
}  # fmt: skip
# The debug model under flex attention with packed documents kept apart (block_causal at EOS).
deepseek_v3_flavors["debugmodel_flex_attn"] = replace(
    deepseek_v3_flavors["debugmodel"], attn_backend="flex", attn_mask_type="block_causal"
)

register_train_spec(
    TrainSpec(
        name="deepseek_v3",
        model_cls=DeepSeekV3Model,
        flavors=deepseek_v3_flavors,
        parallelize_fn=parallelize_deepseek_v3,
        build_optimizer_fn=build_optimizer,
        build_lr_scheduler_fn=build_lr_scheduler,
        build_dataloader_fn=build_text_dataloader,
        build_tokenizer_fn=build_hf_tokenizer,
        build_loss_fn=build_cross_entropy_loss,
        extra_loss_fn=pop_aux_loss,
        post_optimizer_step_fn=load_balance_step,
        state_dict_adapter=DeepSeekV3StateDictAdapter,
    )
)
