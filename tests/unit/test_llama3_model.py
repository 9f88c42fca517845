"""Llama 3: published sizes, meta-device construction, layout-independent init, RoPE."""

import pytest
import torch

from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.rope import apply_rope, precompute_rope_cache


def _meta_model(flavor: str) -> Transformer:
    with torch.device("meta"):
        return Transformer(llama3_flavors[flavor])


@pytest.mark.parametrize("flavor, published", [("8B", 8.03e9), ("70B", 70.6e9), ("405B", 405.9e9)])
def test_parameter_count_matches_published_total(flavor, published):
    count = sum(p.numel() for p in _meta_model(flavor).parameters())
    assert abs(count - published) / published < 0.005, count


@pytest.mark.parametrize(
    "flavor, hidden", [("1B", 8192), ("3B", 8192), ("8B", 14336), ("70B", 28672), ("405B", 53248)]
)
def test_ffn_hidden_dim_matches_published_intermediate_size(flavor, hidden):
    assert llama3_flavors[flavor].ffn_hidden_dim == hidden


def test_tied_flavors_have_no_output_projection():
    model = _meta_model("1B")
    assert model.output is None
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(1.236e9, rel=0.005)


def _tiny(seed: int = 0, **overrides) -> Transformer:
    args = TransformerModelArgs(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16, **overrides
    )
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def test_meta_model_initializes_in_place_to_finite_weights():
    model = _tiny()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert torch.equal(model.layers["0"].attention_norm.weight, torch.ones(32))
    logits = model(torch.randint(0, 64, (2, 16)))
    assert logits.shape == (2, 16, 64) and torch.isfinite(logits).all()


def test_init_is_a_function_of_the_seed():
    a, b, other = _tiny(), _tiny(), _tiny(seed=1)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_embeddings.weight, other.tok_embeddings.weight)


def test_output_projection_init_shrinks_with_depth():
    model = _tiny()
    assert model.layers["1"].attention.wo.weight.std() < model.layers["0"].attention.wo.weight.std()


def test_model_is_causal():
    model = _tiny()
    tokens = torch.randint(0, 64, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 64
    assert torch.allclose(model(tokens)[0, :10], model(changed)[0, :10], atol=1e-6)
    assert not torch.allclose(model(tokens)[0, 10:], model(changed)[0, 10:], atol=1e-6)


def test_rope_preserves_norm_and_is_identity_at_position_zero():
    cache = precompute_rope_cache(head_dim=8, max_seq_len=4, theta=10000.0)
    x = torch.randn(1, 4, 2, 8)
    rotated = apply_rope(x, cache)
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(rotated[:, 0], x[:, 0])


def test_rope_scores_depend_only_on_relative_position():
    cache = precompute_rope_cache(head_dim=8, max_seq_len=8, theta=10000.0)
    q, k = torch.randn(8), torch.randn(8)
    seq = lambda v: v.expand(1, 8, 1, 8)  # noqa: E731
    rq, rk = apply_rope(seq(q), cache)[0, :, 0], apply_rope(seq(k), cache)[0, :, 0]
    assert torch.allclose(rq[3] @ rk[1], rq[6] @ rk[4], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rope_takes_its_real_form_and_gives_the_eager_complex_forms_bits(dtype):
    """Compiled blocks rotate with cos/sin products, eager ones with a complex multiply; only
    compiled runs (tp2_compiled) would otherwise notice the compiled form going wrong."""
    torch._dynamo.reset()
    cache = precompute_rope_cache(head_dim=16, max_seq_len=32, theta=10000.0)
    x = torch.randn(2, 32, 3, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    compiled = torch.compile(apply_rope, fullgraph=True)(x, cache)
    eager = apply_rope(x, cache)
    assert compiled.dtype == eager.dtype == dtype
    torch.testing.assert_close(compiled, eager)  # the same bits here; tolerance for other CPUs


def test_flops_per_token_counts_six_per_parameter_plus_attention():
    model = _tiny()
    params, flops = model.args.num_flops_per_token(model, seq_len=16)
    assert params == sum(p.numel() for p in model.parameters()) - 64 * 32
    assert flops == 6 * params + 12 * 2 * 4 * 8 * 16
