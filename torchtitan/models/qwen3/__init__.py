"""Qwen3 dense and MoE flavors and their TrainSpec registration."""

from dataclasses import replace

from torchtitan.components.dataloader import build_text_dataloader
from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_scheduler
from torchtitan.components.optimizer import build_optimizer
from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.models.moe import MoEArgs, load_balance_step, pop_aux_loss
from torchtitan.models.qwen3.args import Qwen3ModelArgs
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.parallelize import parallelize_qwen3
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

# Published sizes, from each model's Hugging Face config.json (Qwen/Qwen3-<size>): all use
# head_dim 128, 8 kv heads, vocab 151936, rope_theta 1e6, RMSNorm eps 1e-6 and qk-norm; the
# three smallest tie their embeddings. The debug model keeps head_dim (32) apart from
# dim / n_heads (16), as the real sizes do, and matches the bundled 2048-token tokenizer.
qwen3_flavors = {
    "debugmodel": Qwen3ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=8, head_dim=32, hidden_dim=768, vocab_size=2048
    ),
    "0.6B": Qwen3ModelArgs(
        dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=3072, tie_word_embeddings=True
    ),
    "1.7B": Qwen3ModelArgs(
        dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144, tie_word_embeddings=True
    ),
    "4B": Qwen3ModelArgs(
        dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=9728, tie_word_embeddings=True
    ),
    "8B": Qwen3ModelArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288),
    "14B": Qwen3ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, hidden_dim=17408),
    "32B": Qwen3ModelArgs(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, hidden_dim=25600),
    # MoE: 128 routed experts, top-8 with renormalized softmax weights, no shared expert
    # (Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json); auxiliary-loss-free balancing.
    "debugmodel_moe": Qwen3ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=8, head_dim=32, vocab_size=2048, moe_hidden_dim=256,
        moe_args=MoEArgs(num_experts=8, top_k=2, route_norm=True, load_balance_coeff=1e-3),
    ),
    "30B-A3B": Qwen3ModelArgs(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, hidden_dim=6144, moe_hidden_dim=768,
        moe_args=MoEArgs(num_experts=128, top_k=8, route_norm=True, load_balance_coeff=1e-3),
    ),
    "235B-A22B": Qwen3ModelArgs(
        dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, moe_hidden_dim=1536,
        moe_args=MoEArgs(num_experts=128, top_k=8, route_norm=True, load_balance_coeff=1e-3),
    ),
}  # fmt: skip
# The debug models under flex attention with packed documents kept apart (block_causal at EOS).
for _name in ("debugmodel", "debugmodel_moe"):
    qwen3_flavors[f"{_name}_flex_attn"] = replace(
        qwen3_flavors[_name], attn_backend="flex", attn_mask_type="block_causal"
    )

register_train_spec(
    TrainSpec(
        name="qwen3",
        model_cls=Qwen3Model,
        flavors=qwen3_flavors,
        parallelize_fn=parallelize_qwen3,
        build_optimizer_fn=build_optimizer,
        build_lr_scheduler_fn=build_lr_scheduler,
        build_dataloader_fn=build_text_dataloader,
        build_tokenizer_fn=build_hf_tokenizer,
        build_loss_fn=build_cross_entropy_loss,
        extra_loss_fn=pop_aux_loss,
        post_optimizer_step_fn=load_balance_step,
        state_dict_adapter=Qwen3StateDictAdapter,
    )
)
