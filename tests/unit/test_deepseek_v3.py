"""DeepSeek-V3: published sizes, MLA with and without the query bottleneck, dense-then-MoE
blocks, activation checkpointing, FLOPs and refused settings (init and causality:
test_model_families.py)."""

import math
from dataclasses import replace

import pytest
import torch

from tests.model_testing import (
    init_on_cpu,
    next_token_loss_and_grads,
    tiny_deepseek_v3,
    tiny_deepseek_v3_args,
)
from torchtitan.config import ActivationCheckpoint, ConfigError
from torchtitan.config.manager import parse_args
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models import get_train_spec
from torchtitan.models.deepseek_v3 import deepseek_v3_flavors
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model, MultiHeadLatentAttention
from torchtitan.models.deepseek_v3.parallelize import DEEPSEEK_V3_SAVE_LIST
from torchtitan.models.moe import MoE
from torchtitan.models.rope import precompute_rope_cache

# Sources of the shapes below (Hugging Face config.json):
#   671B: deepseek-ai/DeepSeek-V3. Published total: 671B for the main model; the repository's
#     685B adds the 14B multi-token-prediction module, which is not built here (model card).
#   16B: deepseek-ai/DeepSeek-V2-Lite (the shapes torchtitan's DeepSeek-V3 16B flavor uses).
#     Published total: 15.7B ("DeepSeek-V2-Lite ... with 15.7B parameters", DeepSeek-V2 README).
# Columns: vocab, dim, dense inter, moe inter, layers, dense layers, heads, q_lora_rank (0 = none),
# kv_lora_rank, nope, rope, v, routed experts, shared experts, top_k, has e_score_correction_bias.
HF_CONFIGS = {
    "16B": (102400, 2048, 10944, 1408, 27, 1, 16, 0, 512, 128, 64, 128, 64, 2, 6, False),
    "671B": (129280, 7168, 18432, 2048, 61, 3, 128, 1536, 512, 128, 64, 128, 256, 1, 8, True),
}
PUBLISHED_TOTALS = {"16B": 15.7e9, "671B": 671e9}


def _count_from_hf_config(config: tuple) -> tuple[int, int]:
    """(HF parameter count, how much of it is the routing-correction bias, a buffer here)."""
    vocab, dim, inter, moe_inter, layers, dense, heads, q_lora, kv_lora, nope, rope, v = config[:12]
    experts, shared, _, correction_bias = config[12:]
    qk = nope + rope
    q = dim * heads * qk if q_lora == 0 else dim * q_lora + q_lora + q_lora * heads * qk
    kv = dim * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v)
    attention = q + kv + heads * v * dim + 2 * dim  # + the two block norms
    bias = experts if correction_bias else 0
    moe = experts * dim + 3 * experts * dim * moe_inter + 3 * dim * moe_inter * shared + bias
    total = 2 * vocab * dim + dim + layers * attention + dense * 3 * dim * inter + (layers - dense) * moe
    return total, (layers - dense) * bias


def _meta_model(args: DeepSeekV3ModelArgs) -> DeepSeekV3Model:
    with torch.device("meta"):
        return DeepSeekV3Model(args)


def _num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("flavor", list(HF_CONFIGS))
def test_parameter_count_matches_published_total(flavor):
    count = _num_params(_meta_model(deepseek_v3_flavors[flavor]))
    hf_count, bias_buffers = _count_from_hf_config(HF_CONFIGS[flavor])
    # Exactly the HF config's count, except the routing bias, which is a buffer (expert_bias).
    assert count == hf_count - bias_buffers
    published = PUBLISHED_TOTALS[flavor]
    assert abs(count - published) / published < 0.005, count


@pytest.mark.parametrize("flavor", list(HF_CONFIGS))
def test_flavor_hyperparameters_match_the_hf_config(flavor):
    a = deepseek_v3_flavors[flavor]
    got = (
        a.vocab_size, a.dim, a.inter_dim, a.moe_inter_dim, a.n_layers, a.n_dense_layers, a.n_heads,
        a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim,
        a.moe_args.num_experts, a.moe_args.num_shared_experts, a.moe_args.top_k,
    )  # fmt: skip
    assert got == HF_CONFIGS[flavor][:15]
    assert (a.rope_theta, a.norm_eps, a.tie_word_embeddings) == (10000.0, 1e-6, False)


def test_671b_routes_like_deepseek_v3():
    m = deepseek_v3_flavors["671B"].moe_args
    assert (m.score_func, m.route_norm, m.route_scale) == ("sigmoid", True, 2.5)
    assert (m.num_expert_groups, m.num_limited_groups) == (8, 4)


def test_first_layers_are_dense_then_moe():
    model = _meta_model(deepseek_v3_flavors["671B"])
    kinds = ["moe" if "moe" in b._modules else "dense" for b in model.layers.values()]
    assert kinds == ["dense"] * 3 + ["moe"] * 58
    dense, moe = model.layers["0"], model.layers["3"]
    assert "moe" not in dense._modules and dense.feed_forward.w1.weight.shape == (18432, 7168)
    assert "feed_forward" not in moe._modules and isinstance(moe.moe, MoE)
    assert moe.moe.experts.w1.shape == (256, 2048, 7168)
    assert moe.moe.shared_experts.w1.weight.shape == (2048, 7168)


def test_mla_projection_shapes_with_and_without_query_bottleneck():
    big = _meta_model(deepseek_v3_flavors["671B"]).layers["0"].attention
    assert big.wq is None
    assert big.wq_a.weight.shape == (1536, 7168) and big.q_norm.weight.shape == (1536,)
    assert big.wq_b.weight.shape == (128 * 192, 1536)
    assert big.wkv_a.weight.shape == (512 + 64, 7168) and big.kv_norm.weight.shape == (512,)
    assert big.wkv_b.weight.shape == (128 * (128 + 128), 512)
    assert big.wo.weight.shape == (7168, 128 * 128)
    lite = _meta_model(deepseek_v3_flavors["16B"]).layers["0"].attention
    assert lite.wq_a is None and lite.q_norm is None and lite.wq_b is None
    assert lite.wq.weight.shape == (16 * 192, 2048)


def test_query_bottleneck_changes_the_parameters_as_expected():
    plain = _num_params(_meta_model(tiny_deepseek_v3_args()))
    lora = _num_params(_meta_model(tiny_deepseek_v3_args(q_lora_rank=24)))
    q_out = 4 * 16
    per_layer = (32 * 24 + 24 + 24 * q_out) - 32 * q_out
    assert lora - plain == 3 * per_layer


def test_mla_scores_use_the_qk_head_width_and_one_shared_rotary_key_head():
    model = tiny_deepseek_v3()
    seen = {}
    hook = lambda m, args, out: seen.update(qkv=args, out=out)  # noqa: E731
    model.layers["0"].attention.sdpa.register_forward_hook(hook)
    model(torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0)))
    q, k, v = seen["qkv"]  # (batch, heads, seq, 8 + 8), same for k; v (batch, heads, seq, 12)
    assert q.shape == k.shape == (1, 4, 16, 16) and v.shape == (1, 4, 16, 12)
    # The rotary key part is one head broadcast to all; the position-free parts differ per head.
    assert all(torch.equal(k[:, h, :, 8:], k[:, 0, :, 8:]) for h in range(4))
    assert not torch.equal(k[:, 1, :, :8], k[:, 0, :, :8])
    # Causal softmax attention with scale 1 / sqrt(nope + rope).
    scores = q @ k.transpose(-2, -1) / (8 + 8) ** 0.5
    scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(seen["out"], scores.softmax(-1) @ v, atol=1e-5)


def test_671b_flops_count_the_37b_activated_parameters():
    args = deepseek_v3_flavors["671B"]
    model = _meta_model(args)
    _, flops = args.num_flops_per_token(model, seq_len=4096)
    attention = 6 * args.n_layers * args.n_heads * 4096 * (args.qk_head_dim + args.v_head_dim)
    counted = (flops - attention) / 6 + model.tok_embeddings.weight.numel()
    assert abs(counted - 37e9) / 37e9 < 0.02, counted


def test_attention_flops_run_scores_at_the_qk_width_and_values_at_the_v_width():
    model = _meta_model(tiny_deepseek_v3_args())
    params, flops = model.args.num_flops_per_token(model, seq_len=16)
    assert params == _num_params(model) - 64 * 32
    idle_experts = 2 * (4 - 2) * 3 * 32 * 16  # 2 MoE layers, 2 of 4 experts idle, w1/w2/w3 of 32 x 16
    scores, values = 6 * 3 * 4 * 16 * (8 + 8), 6 * 3 * 4 * 16 * 12  # layers, heads, seq_len, width
    assert flops == 6 * (params - idle_experts) + scores + values


@pytest.mark.parametrize("flavor", ["16B", "671B"])
def test_published_yarn_applies_only_when_the_rope_table_outgrows_4096_positions(flavor):
    """As in DeepSeek's reference code and torchtitan: pre-training at 4k runs plain RoPE."""
    args = replace(deepseek_v3_flavors[flavor], max_seq_len=4096)
    longer = replace(args, max_seq_len=8192)
    assert args.applied_rope_scaling is None and longer.applied_rope_scaling is args.rope_scaling
    plain = precompute_rope_cache(args.qk_rope_head_dim, 8192, args.rope_theta)
    scaled = precompute_rope_cache(args.qk_rope_head_dim, 8192, args.rope_theta, longer.applied_rope_scaling)
    # The fastest frequency is kept, the slowest divided by factor 40 (angles at position 1).
    angle = torch.atan2(scaled[1, :, 1], scaled[1, :, 0]) / torch.atan2(plain[1, :, 1], plain[1, :, 0])
    assert angle[0].item() == pytest.approx(1.0) and angle[-1].item() == pytest.approx(1 / 40, rel=1e-4)
    with torch.device("meta"):
        mla = MultiHeadLatentAttention(longer)
    mscale = 0.1 * args.rope_scaling.mscale_all_dim * math.log(40) + 1
    assert mla.softmax_scale == pytest.approx(192**-0.5 * mscale**2)


def _run_args(model: str, flavor: str, *argv: str):
    cfg = parse_args(
        ["--model.name", model, "--model.flavor", flavor, "--training.seq_len", "4096", *argv], env={}
    )
    return get_train_spec(model).get_flavor(flavor).update_from_config(cfg)


@pytest.mark.parametrize("flavor", ["16B", "671B"])
def test_always_apply_yarn_runs_the_published_yarn_at_4096_tokens(flavor):
    args = _run_args("deepseek_v3", flavor, "--model.always_apply_yarn")
    assert args.max_seq_len == 4096 and args.applied_rope_scaling is args.rope_scaling is not None
    with torch.device("meta"):
        mla = MultiHeadLatentAttention(args)
    assert mla.softmax_scale == pytest.approx(192**-0.5 * args.rope_scaling.softmax_scale_factor())
    assert mla.softmax_scale != pytest.approx(192**-0.5)


def test_without_always_apply_yarn_a_4096_token_run_has_plain_rope():
    assert _run_args("deepseek_v3", "671B").applied_rope_scaling is None


@pytest.mark.parametrize(
    "model, flavor", [("llama3", "8B"), ("qwen3", "0.6B"), ("deepseek_v3", "debugmodel")]
)
def test_always_apply_yarn_on_a_flavor_without_yarn_is_refused_naming_the_key(model, flavor):
    with pytest.raises(
        ConfigError, match=rf"'model.always_apply_yarn' = true, but {model} flavor '{flavor}'"
    ):
        _run_args(model, flavor, "--model.always_apply_yarn")


def test_train_spec_and_debug_config():
    spec = get_train_spec("deepseek_v3")
    assert spec.model_cls is DeepSeekV3Model and spec.flavors is deepseek_v3_flavors
    cfg = parse_args(["--config", "deepseek_v3_debug_model.toml", "--training.seq_len", "64"], env={})
    assert (cfg.model.name, cfg.model.flavor) == ("deepseek_v3", "debugmodel")
    assert deepseek_v3_flavors["debugmodel"].update_from_config(cfg).max_seq_len == 64


def test_tensor_parallel_degree_must_divide_the_experts_hidden_width():
    from torchtitan.distributed.tensor_parallel import moe_plan

    block = _meta_model(deepseek_v3_flavors["debugmodel"]).layers["1"]
    hidden = block.moe.experts.w1.shape[1]
    # The routed experts are left to shard_experts_over_tp or to EP over the TP ranks.
    assert set(moe_plan(block.moe, 2)) >= {"moe", "moe.router", "moe.shared_experts.w2"}
    assert "moe.experts" not in moe_plan(block.moe, 2)
    with pytest.raises(ConfigError, match=f"does not divide the experts' hidden width {hidden}"):
        moe_plan(block.moe, 3)


def _debug_model(ac_mode: str, option: str = "op") -> DeepSeekV3Model:
    model = _meta_model(deepseek_v3_flavors["debugmodel"])
    apply_ac(
        model,
        ActivationCheckpoint(mode=ac_mode, selective_ac_option=option),
        op_sac_save_list=DEEPSEEK_V3_SAVE_LIST,
    )
    return init_on_cpu(model)


@pytest.fixture(scope="module")
def ac_tokens():
    return torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(1))


def _step(model, tokens):
    loss, grads = next_token_loss_and_grads(model, tokens)
    counts = [m.tokens_per_expert.clone() for m in model.modules() if isinstance(m, MoE)]
    return loss, grads, counts


@pytest.fixture(scope="module")
def no_ac_step(ac_tokens):
    return _step(_debug_model("none"), ac_tokens)


@pytest.mark.parametrize("ac_mode, option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_debug_model_ac_keeps_loss_gradients_and_routing_counts(ac_mode, option, ac_tokens, no_ac_step):
    ref_loss, ref_grads, ref_counts = no_ac_step
    loss, grads, counts = _step(_debug_model(ac_mode, option), ac_tokens)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[name], grad) for name, grad in ref_grads.items()), ac_mode
    assert len(counts) == 5 and all(torch.equal(a, b) for a, b in zip(counts, ref_counts))
