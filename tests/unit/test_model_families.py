"""What every model family promises alike, checked on a tiny model of each (and of each variant a
family builds differently): in-place init from the meta device, seeded and depth-scaled init,
causality, and tied flavors without an output projection."""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import pytest
import torch

from tests.model_testing import SEQ_LEN, VOCAB, tiny_deepseek_v3, tiny_llama3, tiny_qwen3
from torchtitan.models import get_train_spec


@dataclass(frozen=True)
class Tiny:
    """One row of `TINY`: how to build a variant's tiny model, and the norms its init must set to
    ones (at least these: the init test checks every module named `*norm`)."""

    build: Callable[..., torch.nn.Module]  # (seed=0) -> a tiny model, initialized on the CPU
    norm_widths: dict[str, int]  # norms the family must build, by name, and their widths


QWEN3_NORMS = {
    "layers.0.attention_norm": 32,
    "layers.0.attention.q_norm": 16,
    "layers.0.attention.k_norm": 16,
}
# Each family, and each variant whose modules differ: tied logits, MLA's query bottleneck.
TINY = {
    "llama3": Tiny(tiny_llama3, {"layers.0.attention_norm": 32}),
    "qwen3": Tiny(tiny_qwen3, QWEN3_NORMS),
    "qwen3 tied": Tiny(partial(tiny_qwen3, tie_word_embeddings=True), QWEN3_NORMS),
    "deepseek_v3": Tiny(tiny_deepseek_v3, {"layers.0.attention.kv_norm": 16}),
    "deepseek_v3 q_lora": Tiny(
        partial(tiny_deepseek_v3, q_lora_rank=24),
        {"layers.0.attention.kv_norm": 16, "layers.0.attention.q_norm": 24},
    ),
}


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("variant", list(TINY))
def test_meta_model_initializes_in_place_to_finite_weights(variant):
    model = TINY[variant].build()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # Every norm starts as the identity scale; the named ones must exist at their widths.
    norms = {name: m for name, m in model.named_modules() if name.rsplit(".", 1)[-1].endswith("norm")}
    for name, width in TINY[variant].norm_widths.items():
        assert torch.equal(norms[name].weight, torch.ones(width)), name
    for name, norm in norms.items():
        assert torch.equal(norm.weight, torch.ones_like(norm.weight)), name
    logits = model(_tokens())
    assert logits.shape == (2, SEQ_LEN, VOCAB) and torch.isfinite(logits).all()


@pytest.mark.parametrize("variant", list(TINY))
def test_init_is_a_function_of_the_seed(variant):
    build = TINY[variant].build
    a, b, other = build(), build(), build(seed=1)
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_embeddings.weight, other.tok_embeddings.weight)


@pytest.mark.parametrize("variant", list(TINY))
def test_output_projection_init_shrinks_with_depth(variant):
    model = TINY[variant].build()
    first, *_, last = model.layers.values()
    assert last.attention.wo.weight.std() < first.attention.wo.weight.std()


@pytest.mark.parametrize("variant", list(TINY))
def test_model_is_causal(variant):
    model = TINY[variant].build()
    tokens = _tokens()
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % VOCAB
    out, out_changed = model(tokens), model(changed)
    assert torch.allclose(out[:, :10], out_changed[:, :10], atol=1e-6)
    assert not torch.allclose(out[:, 10:], out_changed[:, 10:], atol=1e-6)


# family: (a tied flavor, its published parameter total, an untied flavor, that one's output
# (vocab, dim)). Qwen3 0.6B's total is the exact count of its HF config (test_qwen3.PUBLISHED_TOTALS);
# the model card rounds it to 0.6B.
TIED_FLAVORS = {
    "llama3": ("1B", 1.236e9, "8B", (128256, 4096)),
    "qwen3": ("0.6B", 596_049_920, "8B", (151936, 4096)),
}


def _meta_flavor(family: str, flavor: str) -> torch.nn.Module:
    spec = get_train_spec(family)
    with torch.device("meta"):
        return spec.model_cls(spec.flavors[flavor])


@pytest.mark.parametrize("family", list(TIED_FLAVORS))
def test_tied_flavors_have_no_output_projection(family):
    tied_flavor, published_total, untied_flavor, output_shape = TIED_FLAVORS[family]
    tied = _meta_flavor(family, tied_flavor)
    assert tied.output is None
    assert sum(p.numel() for p in tied.parameters()) == pytest.approx(published_total, rel=0.005)
    assert _meta_flavor(family, untied_flavor).output.weight.shape == output_shape
