"""Llama 3: published sizes, RoPE and FLOPs (init and causality: test_model_families.py)."""

import pytest
import torch

from tests.model_testing import tiny_llama3
from torchtitan.models.llama3 import llama3_flavors
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
    model = tiny_llama3()
    params, flops = model.args.num_flops_per_token(model, seq_len=16)
    assert params == sum(p.numel() for p in model.parameters()) - 64 * 32
    assert flops == 6 * params + 12 * 2 * 4 * 8 * 16
