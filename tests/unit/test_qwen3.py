"""Qwen3: published sizes, qk-norm, FLOPs, refused TP settings, and AC on the MoE flavor (init and
causality: test_model_families.py)."""

from dataclasses import replace

import pytest
import torch

from tests.model_testing import init_on_cpu, next_token_loss_and_grads, tiny_qwen3
from torchtitan.config import ConfigError
from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.qwen3 import qwen3_flavors
from torchtitan.models.qwen3.args import Qwen3ModelArgs
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.parallelize import parallelize_qwen3
from torchtitan.models.rope import apply_rope

# Source: the config.json of each Hugging Face repo Qwen/Qwen3-<size> (hidden_size,
# num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size,
# tie_word_embeddings); every size has head_dim 128, vocab_size 151936, rope_theta 1e6 and
# rms_norm_eps 1e-6. The last two columns are the model cards' "Number of Parameters" and
# "Number of Parameters (Non-Embedding)", in billions as printed (rounded).
HF_CONFIGS = {
    "0.6B": (1024, 28, 16, 8, 3072, True, 0.6, 0.44),
    "1.7B": (2048, 28, 16, 8, 6144, True, 1.7, 1.4),
    "4B": (2560, 36, 32, 8, 9728, True, 4.0, 3.6),
    "8B": (4096, 36, 32, 8, 12288, False, 8.2, 6.95),
    "14B": (5120, 40, 40, 8, 17408, False, 14.8, 13.2),
    "32B": (5120, 64, 64, 8, 25600, False, 32.8, 31.2),
}
HEAD_DIM, VOCAB = 128, 151936

# Exact totals implied by those configs: the embedding (and, untied, lm_head), per layer
# q/o (dim x heads*128), k/v (dim x kv*128), q/k norms (2 x 128), three SwiGLU matrices and
# two norms (2 x dim), and the final norm. Tied sizes count the shared matrix once.
PUBLISHED_TOTALS = {
    "0.6B": 596_049_920,
    "1.7B": 1_720_574_976,
    "4B": 4_022_468_096,
    "8B": 8_190_735_360,
    "14B": 14_768_307_200,
    "32B": 32_762_123_264,
}


def _count_from_hf_config(dim, layers, heads, kv_heads, intermediate, tied) -> int:
    attention = 2 * dim * heads * HEAD_DIM + 2 * dim * kv_heads * HEAD_DIM + 2 * HEAD_DIM
    layer = attention + 3 * dim * intermediate + 2 * dim
    return VOCAB * dim * (1 if tied else 2) + layers * layer + dim


def _meta_model(args: Qwen3ModelArgs) -> Qwen3Model:
    with torch.device("meta"):
        return Qwen3Model(args)


@pytest.mark.parametrize("flavor", list(HF_CONFIGS))
def test_flavor_hyperparameters_match_the_hf_config(flavor):
    dim, layers, heads, kv_heads, intermediate, tied, _, _ = HF_CONFIGS[flavor]
    args = qwen3_flavors[flavor]
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.hidden_dim) == (
        dim, layers, heads, kv_heads, intermediate
    )  # fmt: skip
    assert (args.head_dim, args.vocab_size, args.tie_word_embeddings) == (HEAD_DIM, VOCAB, tied)
    assert (args.rope_theta, args.norm_eps, args.qk_norm) == (1e6, 1e-6, True)


@pytest.mark.parametrize("flavor", list(HF_CONFIGS))
def test_parameter_count_matches_published_total(flavor):
    dim, layers, heads, kv_heads, intermediate, tied, card_total, card_non_embedding = HF_CONFIGS[flavor]
    count = sum(p.numel() for p in _meta_model(qwen3_flavors[flavor]).parameters())
    published = PUBLISHED_TOTALS[flavor]
    assert published == _count_from_hf_config(dim, layers, heads, kv_heads, intermediate, tied)
    assert count == published  # exact, so well within 0.5%
    # The model cards round: one decimal for totals, two for the 0.6B and 8B non-embedding
    # counts (which leave out lm_head as well as the embedding). Agree to half the last digit.
    vocab_matrices = VOCAB * dim * (1 if tied else 2)
    non_embedding_tolerance = 0.005 if flavor in ("0.6B", "8B") else 0.05
    assert abs(count / 1e9 - card_total) <= 0.05
    assert abs((count - vocab_matrices) / 1e9 - card_non_embedding) <= non_embedding_tolerance


def test_head_dim_is_independent_of_dim_over_heads():
    attention = _meta_model(qwen3_flavors["0.6B"]).layers["0"].attention
    assert qwen3_flavors["0.6B"].dim // qwen3_flavors["0.6B"].n_heads == 64
    assert attention.wq.weight.shape == (16 * 128, 1024)
    assert attention.wk.weight.shape == attention.wv.weight.shape == (8 * 128, 1024)
    assert attention.wo.weight.shape == (1024, 16 * 128)


def test_qk_norm_is_one_rmsnorm_over_head_dim_per_block():
    model = _meta_model(qwen3_flavors["8B"])
    for block in model.layers.values():
        for norm in (block.attention.q_norm, block.attention.k_norm):
            assert isinstance(norm, torch.nn.RMSNorm)
            assert norm.weight.shape == (128,) and norm.eps == 1e-6
    without = _meta_model(replace(qwen3_flavors["8B"], qk_norm=False))
    assert without.layers["0"].attention.q_norm is None
    dropped = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in without.parameters())
    assert dropped == 36 * 2 * 128


def test_qk_norm_normalizes_every_query_and_key_head_before_rope():
    model = tiny_qwen3()
    seen = {}
    attention = model.layers["0"].attention
    for name in ("q_norm", "k_norm"):
        getattr(attention, name).register_forward_hook(lambda m, i, o, name=name: seen.update({name: o}))
    attention.register_forward_pre_hook(lambda m, args: seen.update(rope=args[1]))
    attention.sdpa.register_forward_pre_hook(lambda m, args: seen.update(q=args[0], k=args[1]))
    model(torch.randint(0, 64, (2, 16)))
    assert seen["q_norm"].shape == (2, 16, 4, 16) and seen["k_norm"].shape == (2, 16, 2, 16)
    for name in ("q_norm", "k_norm"):  # unit weights: every head vector has RMS 1
        rms = seen[name].pow(2).mean(-1).sqrt()
        assert torch.allclose(rms, torch.ones_like(rms), atol=1e-3)
    # Attention sees the normalized heads rotated: the norm comes first, then RoPE.
    for name, normed in (("q", seen["q_norm"]), ("k", seen["k_norm"])):
        torch.testing.assert_close(seen[name], apply_rope(normed, seen["rope"]).transpose(1, 2))


def test_flops_per_token_use_qwen3_head_dim_and_count_tied_logits():
    model = tiny_qwen3()
    params, flops = model.args.num_flops_per_token(model, seq_len=16)
    assert params == sum(p.numel() for p in model.parameters()) - 64 * 32
    assert flops == 6 * params + 12 * 2 * 4 * 16 * 16  # head_dim 16, not dim / heads = 8
    tied = tiny_qwen3(tie_word_embeddings=True)
    tied_params, tied_flops = tied.args.num_flops_per_token(tied, seq_len=16)
    assert tied_params == params - 64 * 32  # no output projection
    assert tied_flops == flops  # but the logits matmul costs the same


def test_update_from_config_sizes_rope_to_seq_len():
    cfg = parse_args(["--config", "qwen3_debug_model.toml", "--training.seq_len", "64"], env={})
    assert cfg.model.name == "qwen3" and cfg.model.flavor == "debugmodel"
    assert qwen3_flavors["debugmodel"].update_from_config(cfg).max_seq_len == 64


def test_tensor_parallel_with_tied_embeddings_is_refused():
    cfg = parse_args(["--model.name", "qwen3", "--model.flavor", "0.6B"], env={})
    with pytest.raises(ConfigError, match="ties its embeddings"):
        parallelize_qwen3(
            _meta_model(qwen3_flavors["0.6B"]), ParallelDims(1, 1, 2, 2), cfg, torch.device("cpu")
        )


# ----- MoE flavors -------------------------------------------------------------------------


@pytest.mark.parametrize("flavor, published", [("30B-A3B", 30.5e9), ("235B-A22B", 235e9)])
def test_moe_parameter_count_matches_published_total(flavor, published):
    count = sum(p.numel() for p in _meta_model(qwen3_flavors[flavor]).parameters())
    assert abs(count - published) / published < 0.005, count


@pytest.mark.parametrize("flavor, activated", [("30B-A3B", 3.3e9), ("235B-A22B", 22e9)])
def test_moe_flops_count_only_the_activated_parameters(flavor, activated):
    """6 FLOPs per activated parameter: the published activated count (embeddings included)."""
    args = qwen3_flavors[flavor]
    model = _meta_model(args)
    params, flops = args.num_flops_per_token(model, seq_len=4096)
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 4096
    counted = (flops - attention) / 6 + model.tok_embeddings.weight.numel()
    assert abs(counted - activated) / activated < 0.02, counted
    assert params > 9 * counted  # the parameter count keeps every expert


def test_moe_flavor_blocks_hold_a_routed_moe_instead_of_a_feed_forward():
    block = _meta_model(qwen3_flavors["30B-A3B"]).layers["0"]
    assert "feed_forward" not in block._modules
    assert block.moe.router.gate.out_features == 128 and block.moe.router.args.top_k == 8


def _moe_debug_model(ac_mode: str, option: str = "op"):
    from torchtitan.config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.qwen3.parallelize import QWEN3_MOE_SAVE_LIST

    model = _meta_model(qwen3_flavors["debugmodel_moe"])
    apply_ac(
        model,
        ActivationCheckpoint(mode=ac_mode, selective_ac_option=option),
        op_sac_save_list=QWEN3_MOE_SAVE_LIST,
    )
    return init_on_cpu(model)


@pytest.mark.parametrize("ac_mode, option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_moe_debug_model_ac_keeps_loss_gradients_and_routing_counts(ac_mode, option):
    tokens = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(1))

    def step(model):
        loss, grads = next_token_loss_and_grads(model, tokens)
        # A checkpoint wrapper forwards attribute reads to the block it wraps.
        counts = [b.moe.tokens_per_expert.clone() for b in model.layers.values() if hasattr(b, "moe")]
        return loss, grads, counts

    ref_loss, ref_grads, ref_counts = step(_moe_debug_model("none"))
    loss, grads, counts = step(_moe_debug_model(ac_mode, option))
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[name], grad) for name, grad in ref_grads.items())
    # Recompute neither re-counts tokens nor routes differently.
    assert len(counts) == len(ref_counts) == qwen3_flavors["debugmodel_moe"].n_layers  # every block
    assert all(torch.equal(a, b) for a, b in zip(counts, ref_counts))
