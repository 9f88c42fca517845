"""Llama 3 flavors and their TrainSpec registration."""

from dataclasses import replace

from torchtitan.components.dataloader import build_text_dataloader
from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_scheduler
from torchtitan.components.optimizer import build_optimizer
from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.models.rope import RoPEScaling
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

# Llama 3.1 hyperparameters as published; 3.2 (1B, 3B) share the vocab and tie embeddings.
llama3_flavors = {
    "debugmodel": TransformerModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2048, rope_theta=500000
    ),
    "1B": TransformerModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_scaling=RoPEScaling(factor=32.0),
        tie_word_embeddings=True,
    ),
    "3B": TransformerModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        rope_scaling=RoPEScaling(factor=32.0),
        tie_word_embeddings=True,
    ),
    "8B": TransformerModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_scaling=RoPEScaling(),
    ),
    "70B": TransformerModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_scaling=RoPEScaling(),
    ),
    "405B": TransformerModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_scaling=RoPEScaling(),
    ),
}
# The debug model under flex attention with packed documents kept apart (block_causal at EOS).
llama3_flavors["debugmodel_flex_attn"] = replace(
    llama3_flavors["debugmodel"], attn_backend="flex", attn_mask_type="block_causal"
)

register_train_spec(
    TrainSpec(
        name="llama3",
        model_cls=Transformer,
        flavors=llama3_flavors,
        parallelize_fn=parallelize_llama,
        build_optimizer_fn=build_optimizer,
        build_lr_scheduler_fn=build_lr_scheduler,
        build_dataloader_fn=build_text_dataloader,
        build_tokenizer_fn=build_hf_tokenizer,
        build_loss_fn=build_cross_entropy_loss,
        state_dict_adapter=Llama3StateDictAdapter,
    )
)
