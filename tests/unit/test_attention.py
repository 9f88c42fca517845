"""Tests for the shared attention module: the sdpa and flex backends and the flex mask types (CPU path)."""

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from torchtitan.models import attention
from torchtitan.models.attention import (
    FlexAttention,
    ScaledDotProductAttention,
    build_attention,
    build_attention_masks,
    build_block_mask,
    build_mask_mod,
)

EOS = 0
BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16

# Eager flex_attention on CPU warns that it is unfused; that is expected for a reference.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

SPLIT = {"split_documents": True, "eos_id": EOS}
MASKS = {  # test id: (mask type, build_attention_masks keywords)
    "causal": ("causal", {}),
    "block_causal": ("block_causal", {"eos_id": EOS}),
    "sliding_window": ("sliding_window", {"sliding_window": 8}),
    "chunked": ("chunked", {"chunk_size": 16}),
    "sliding_window_split": ("sliding_window", {"sliding_window": 8, **SPLIT}),
    "chunked_split": ("chunked", {"chunk_size": 16, **SPLIT}),
}


def _tokens(seq: int, eos_positions: list[list[int]], seed: int = 0) -> torch.Tensor:
    """Random non-EOS ids with EOS placed at the given positions of each row."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 100, (len(eos_positions), seq), generator=gen)
    for row, positions in enumerate(eos_positions):
        tokens[row, positions] = EOS
    return tokens


def _qkv(seq: int, kv_heads: int = KV_HEADS, batch: int = BATCH, seed: int = 0, dtype=torch.float32):
    """Random q, k, v; the values depend only on the seed, never on ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HEADS, seq, HEAD_DIM, generator=gen)
    k = torch.randn(batch, kv_heads, seq, HEAD_DIM, generator=gen)
    v = torch.randn(batch, kv_heads, seq, HEAD_DIM, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _reference_attention(q, k, v, allowed: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Explicit masked softmax attention; ``allowed`` broadcasts to [batch, heads, seq, seq]."""
    repeats = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("kv_heads", [HEADS, KV_HEADS])
@pytest.mark.parametrize("mask", list(MASKS))
def test_cpu_dense_path_matches_eager_flex_attention(mask, kv_heads):
    seq = 128
    tokens = _tokens(seq, [[20, 50, 51], [5, 90]])
    mask_type, kwargs = MASKS[mask]
    masks = build_attention_masks(tokens, mask_type, **kwargs)
    q, k, v = _qkv(seq, kv_heads=kv_heads)
    batch = BATCH if attention.reads_tokens(mask_type, kwargs.get("split_documents", False)) else None
    block_mask = create_block_mask(masks.mask_mod, batch, None, seq, seq, device="cpu")

    with torch.no_grad():
        out = FlexAttention()(q, k, v, masks)
        expected = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=kv_heads < HEADS)

    assert masks.block_mask is None and masks.dense_mask is not None
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_block_causal_documents_do_not_see_each_other():
    # A later document cannot see an earlier one; a causal mask alone would let it.
    seq, eos = 64, 29  # document 0 is positions 0..29 (its EOS included), document 1 is 30..63
    tokens = _tokens(seq, [[eos]])
    q, k, v = _qkv(seq, batch=1)
    first, second = slice(0, eos + 1), slice(eos + 1, seq)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[:, :, first] += 1.0

    def outputs(mask_type):
        masks = build_attention_masks(tokens, mask_type, eos_id=EOS)
        return FlexAttention()(q, k, v, masks), FlexAttention()(q2, k2, v2, masks)

    out, out2 = outputs("block_causal")
    torch.testing.assert_close(out2[:, :, second], out[:, :, second], atol=0, rtol=0)
    assert not torch.allclose(out2[:, :, first], out[:, :, first])
    causal, causal2 = outputs("causal")
    assert not torch.allclose(causal2[:, :, second], causal[:, :, second])


def test_block_causal_eos_belongs_to_the_document_it_ends():
    masks = build_attention_masks(torch.tensor([[5, EOS, 7, 8, EOS, 9]]), "block_causal", eos_id=EOS)
    allowed = masks.dense_mask[0, 0]

    assert allowed[1, :2].all()  # the EOS sees its own document
    assert not allowed[2, :2].any()  # the token after an EOS starts a new document
    assert allowed[4, 2:5].all() and not allowed[5, :5].any()


def test_sdpa_and_flex_causal_agree_including_gradients():
    seq = 64
    q, k, v = _qkv(seq)
    masks = build_attention_masks(_tokens(seq, [[], []]), "causal")
    grads = []
    for module, extra in ((ScaledDotProductAttention(), ()), (FlexAttention(), (masks,))):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = module(*leaves, *extra)  # sdpa is called without masks: the pre-flex call still works
        out.sum().backward()
        grads.append((out.detach(), *(t.grad for t in leaves)))

    for sdpa_tensor, flex_tensor in zip(*grads):
        torch.testing.assert_close(flex_tensor, sdpa_tensor, atol=1e-6, rtol=0)


@pytest.mark.parametrize("scale", [None, 0.5])
def test_dense_path_backward_matches_float64_masked_softmax(scale):
    seq = 64
    masks = build_attention_masks(_tokens(seq, [[10, 40], [33]]), "block_causal", eos_id=EOS)
    weights = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    results = {}
    for dtype in (torch.float32, torch.float64):
        leaves = [t.requires_grad_() for t in _qkv(seq, dtype=dtype)]
        if dtype == torch.float32:
            out = FlexAttention()(*leaves, masks, scale=scale)
        else:
            out = _reference_attention(*leaves, masks.dense_mask, scale=scale)
        (out * weights.to(dtype)).sum().backward()
        results[dtype] = [out.detach()] + [t.grad for t in leaves]

    for got, expected in zip(results[torch.float32], results[torch.float64]):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=0)


def test_sliding_window_mask_entries():
    allowed = build_attention_masks(_tokens(16, [[]]), "sliding_window", sliding_window=4).dense_mask[0, 0]

    assert allowed[10].nonzero().flatten().tolist() == [7, 8, 9, 10]
    assert allowed[0].nonzero().flatten().tolist() == [0]


def test_chunked_mask_entries():
    allowed = build_attention_masks(_tokens(24, [[]]), "chunked", chunk_size=8).dense_mask[0, 0]

    assert allowed[9].nonzero().flatten().tolist() == [8, 9]
    assert allowed[7].nonzero().flatten().tolist() == list(range(8))
    assert allowed[16].nonzero().flatten().tolist() == [16]


@pytest.mark.parametrize("mask", list(MASKS))
def test_every_token_attends_to_itself(mask):
    mask_type, kwargs = MASKS[mask]
    masks = build_attention_masks(_tokens(64, [[3, 4, 20], [63]]), mask_type, **kwargs)

    assert masks.dense_mask.diagonal(dim1=-2, dim2=-1).all()


@pytest.mark.parametrize("mask_type", ["sliding_window", "chunked"])
def test_split_documents_keeps_a_window_or_chunk_within_each_document(mask_type):
    # Row 0 packs documents 0..9 (EOS at 9) and 10..47; row 1 is one document.
    tokens = _tokens(48, [[9], []])
    mask_type, kwargs = MASKS[f"{mask_type}_split"]
    split = build_attention_masks(tokens, mask_type, **kwargs).dense_mask
    positional = build_attention_masks(tokens, mask_type, **MASKS[mask_type][1]).dense_mask
    same_document = torch.zeros(2, 1, 48, 48, dtype=torch.bool)
    same_document[0, 0, :10, :10] = same_document[0, 0, 10:, 10:] = same_document[1] = True

    assert torch.equal(split, positional & same_document)
    assert positional[0, 0, 10:16, :10].any()  # unsplit, the window or chunk crosses the EOS
    assert torch.equal(split[1], positional[0])  # a row without EOS is the positional mask


@pytest.mark.parametrize(
    ("mask_type", "kwargs", "named"),
    [
        ("block_causal", {}, "eos_id"),
        ("chunked", {"chunk_size": 4, "split_documents": True}, "eos_id"),
        ("causal", {"split_documents": True, "eos_id": EOS}, "block_causal"),
        ("sliding_window", {"sliding_window": 0}, "sliding_window"),
        ("sliding_window", {}, "sliding_window"),
        ("chunked", {"chunk_size": -1}, "chunk_size"),
        ("diagonal", {}, "mask_type"),
    ],
)
def test_build_attention_masks_rejects_bad_arguments(mask_type, kwargs, named):
    with pytest.raises(ValueError, match=named):
        build_attention_masks(_tokens(8, [[]]), mask_type, **kwargs)


def test_flex_without_masks_raises():
    with pytest.raises(ValueError, match="masks"):
        FlexAttention()(*_qkv(8))


def test_build_attention_rejects_unknown_backend_listing_valid_ones():
    assert isinstance(build_attention("flex"), FlexAttention)
    with pytest.raises(ValueError, match="sdpa, flex"):
        build_attention("flash")


@pytest.fixture
def mask_builds(monkeypatch):
    """The mask mods `create_mask` is called with, from an empty mask cache (emptied after too)."""
    real_create_mask, built = attention.create_mask, []

    def counting_create_mask(*args, **kwargs):
        built.append(args[0])
        return real_create_mask(*args, **kwargs)

    monkeypatch.setattr(attention, "create_mask", counting_create_mask)
    attention.clear_mask_cache()
    yield built
    attention.clear_mask_cache()


def test_a_token_independent_mask_is_built_once_for_every_batch(mask_builds):
    built = mask_builds
    first = build_attention_masks(_tokens(32, [[3], []], seed=1), "sliding_window", sliding_window=8)
    second = build_attention_masks(_tokens(32, [[], [9]], seed=2), "sliding_window", sliding_window=8)
    assert second is first and len(built) == 1
    assert build_attention_masks(_tokens(32, [[]]), "sliding_window", sliding_window=4) is not first
    assert build_attention_masks(_tokens(48, [[]]), "sliding_window", sliding_window=8) is not first


def test_a_block_causal_mask_is_built_for_each_batch(mask_builds):
    built = mask_builds
    first = build_attention_masks(_tokens(32, [[3], []], seed=1), "block_causal", eos_id=EOS)
    second = build_attention_masks(_tokens(32, [[], [9]], seed=2), "block_causal", eos_id=EOS)
    assert len(built) == 2 and not torch.equal(first.dense_mask, second.dense_mask)


def test_split_documents_masks_are_built_for_each_batch(mask_builds):
    built = mask_builds
    mask_type, kwargs = MASKS["sliding_window_split"]
    first = build_attention_masks(_tokens(32, [[3], []], seed=1), mask_type, **kwargs)
    second = build_attention_masks(_tokens(32, [[], [9]], seed=2), mask_type, **kwargs)
    assert len(built) == 2 and not torch.equal(first.dense_mask, second.dense_mask)


def test_every_layer_keeps_one_shared_additive_mask_for_backward():
    """SDPA turned the boolean mask into a float one in every layer, and each layer kept its own."""
    masks = build_attention_masks(_tokens(32, [[10], [5, 20]]), "block_causal", eos_id=EOS)
    mask_shaped = []

    def keep(t):
        if t.shape[-2:] == (32, 32) and t.dtype.is_floating_point:
            mask_shaped.append(t)
        return t

    q, k, v = (t.requires_grad_() for t in _qkv(32))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = FlexAttention()(q, k, v, masks)
        out = FlexAttention()(out, k, v, masks)
    assert len(mask_shaped) == 2 and mask_shaped[0] is mask_shaped[1] is masks.additive_mask(torch.float32)
    want = _reference_attention(q, k, v, masks.dense_mask)
    torch.testing.assert_close(FlexAttention()(q, k, v, masks), want)


@pytest.mark.parametrize("mask", ["block_causal", "sliding_window_split"])
def test_compiled_block_mask_equals_eager_and_compiles_once_for_every_batch(mask):
    seq = 384  # three 128-blocks: full, partial and skipped blocks all occur
    batches = [_tokens(seq, [[40, 200], []], seed=1), _tokens(seq, [[130], [10, 20, 250]], seed=2)]
    mask_type, kwargs = MASKS[mask]
    kwargs = {**kwargs, "sliding_window": 150}  # a window across block edges, when it applies
    for index, tokens in enumerate(batches):
        mask_mod = build_mask_mod(tokens, mask_type, **kwargs)
        # The second batch's mask mod is a new closure over new document ids: it must reuse the code.
        with torch._dynamo.config.patch(error_on_recompile=index > 0):
            compiled = build_block_mask(mask_mod, BATCH, seq, "cpu")
        eager = create_block_mask(mask_mod, BATCH, None, seq, seq, device="cpu")

        assert torch.equal(compiled.to_dense(), eager.to_dense())
        assert torch.equal(compiled.kv_num_blocks, eager.kv_num_blocks)
        assert torch.equal(compiled.full_kv_num_blocks, eager.full_kv_num_blocks)
