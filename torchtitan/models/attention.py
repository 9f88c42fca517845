"""The one attention module every model uses; backends are chosen by name.

Backends:

* ``sdpa``: causal `F.scaled_dot_product_attention`; needs no masks.
* ``flex``: attention under one of `MASK_TYPES`. The mask is built once per batch by
  `build_attention_masks` (once per sequence length for the masks that do not depend on the
  tokens) and handed to every layer, so no layer rebuilds it. On CUDA it is a
  flex-attention `BlockMask`, built by a compiled `create_block_mask` and run by a compiled
  `flex_attention`; elsewhere (CPU) it is an exact dense boolean mask run by SDPA, because
  PyTorch's flex attention has no backward on CPU.

Models call `build_attention(backend)` once and then ``attn(q, k, v, masks)`` for either backend; they
never branch on the backend or the device themselves.

Under context parallelism a model passes its masks through `masks_under_context_parallel`: they
are then read at the positions of this rank's tokens, and carry the exchange that lets both
backends attend over the whole sequence (`context_parallel_attention`).

Every mask here allows the diagonal (a token always attends to itself), so no query row is ever fully
masked. Keep it that way when adding a mask type: SDPA with a boolean mask returns NaN for a fully
masked row, while flex attention returns zeros, so the two paths would silently disagree.
"""

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import (
    BlockMask,
    and_masks,
    create_block_mask,
    create_mask,
    flex_attention,
)

from torchtitan.distributed.context_parallel import ContextParallelStep, active_step

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("sdpa", "flex")
MASK_TYPES = ("causal", "block_causal", "sliding_window", "chunked")

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_compiled_flex_attention = None
_compiled_create_block_mask = None
_logged_dense_path = False


def causal_mask(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """Mask mod allowing each query to see itself and every earlier key."""
    return q_idx >= kv_idx


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per-token document index for sequences that pack several documents.

    A document ends *at* its EOS token, so the EOS belongs to the document it closes and the next
    token starts a new one (an exclusive cumulative sum of EOS positions).

    Args:
        tokens: int tensor of shape ``[batch, seq]`` with the input ids.
        eos_id: the id that ends a document.

    Returns:
        int tensor of shape ``[batch, seq]``; documents are numbered from 0 in each row.
    """
    is_eos = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(is_eos, dim=1) - is_eos


def same_document_mask(doc_ids: torch.Tensor) -> MaskMod:
    """Mask mod letting a query see only keys of its own document (in either direction).

    Args:
        doc_ids: ``[batch, seq]`` document index per token, from `document_ids`. The returned mask
            mod indexes it by ``b``, so the mask must be built with ``B = batch``.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        return doc_ids[b, q_idx] == doc_ids[b, kv_idx]

    return mask_mod


def block_causal_mask(doc_ids: torch.Tensor) -> MaskMod:
    """Mask mod for packed documents: causal, and only within a query's own document.

    Args:
        doc_ids: as for `same_document_mask`.
    """
    return and_masks(causal_mask, same_document_mask(doc_ids))


def sliding_window_mask(window: int) -> MaskMod:
    """Mask mod letting a query see itself and the ``window - 1`` keys before it."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return mask_mod


def chunked_mask(chunk_size: int) -> MaskMod:
    """Mask mod for Llama-4 style chunked attention: causal within fixed chunks of ``chunk_size``."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx // chunk_size == kv_idx // chunk_size)

    return mask_mod


@dataclass(frozen=True)
class AttentionMasks:
    """The attention mask for one batch, built once by `build_attention_masks` and shared by all layers.

    Exactly one of ``block_mask`` (CUDA, flex path) and ``dense_mask`` (other devices, SDPA path) is set.

    Attributes:
        mask_type: one of `MASK_TYPES`.
        mask_mod: the mask function both representations were built from.
        seq_len: the sequence length the mask covers; q, k and v must match it.
        block_mask: flex-attention `BlockMask`, or None.
        dense_mask: bool tensor ``[batch or 1, 1, seq, seq]`` where True means "may attend", or None.
            It costs ``batch * seq**2`` bytes for masks that read the tokens (and its additive form, see
            `additive_mask`, 2 or 4 times that), so it suits tests and small runs.
        context_parallel: set on the masks of a micro-batch under context parallelism
            (`masks_under_context_parallel`): its queries are this rank's tokens, its keys the
            whole sequence's, and attention exchanges them (`context_parallel_attention`). The
            mask then covers ``seq_len`` queries and the keys the exchange gives.
    """

    mask_type: str
    mask_mod: MaskMod
    seq_len: int
    block_mask: BlockMask | None = None
    dense_mask: torch.Tensor | None = None
    context_parallel: ContextParallelStep | None = field(default=None, compare=False, repr=False)
    _additive: dict = field(default_factory=dict, compare=False, repr=False)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense mask as SDPA applies it, 0 where allowed and -inf elsewhere, in ``dtype``;
        made once per dtype and shared. Given the boolean mask, SDPA makes this copy itself in
        every layer, and each layer keeps its own for backward."""
        if dtype not in self._additive:
            additive = torch.zeros(self.dense_mask.shape, dtype=dtype, device=self.dense_mask.device)
            self._additive[dtype] = additive.masked_fill_(~self.dense_mask, float("-inf"))
        return self._additive[dtype]


def reads_tokens(mask_type: str, split_documents: bool = False) -> bool:
    """Whether the mask depends on the batch's tokens (document boundaries), not only on positions."""
    return mask_type == "block_causal" or split_documents


def _positive(value: int | None, name: str, mask_type: str) -> int:
    if value is None or value <= 0:
        raise ValueError(f"mask_type '{mask_type}' needs a positive {name}, got {value!r}")
    return value


def build_mask_mod(
    tokens: torch.Tensor,
    mask_type: str,
    *,
    eos_id: int | None = None,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    split_documents: bool = False,
) -> MaskMod:
    """The mask mod for ``mask_type``, validating the argument that type needs.

    Arguments a mask type does not use are ignored, so a config may always pass all of them.
    ``split_documents`` keeps ``sliding_window`` and ``chunked`` within each packed document as
    well (``block_causal`` always does); it needs ``eos_id`` then.

    Raises:
        ValueError: for an unknown ``mask_type``, or when ``block_causal`` (or ``split_documents``)
            lacks ``eos_id``, ``sliding_window`` lacks a positive ``sliding_window`` or ``chunked`` a
            positive ``chunk_size``, or for ``split_documents`` with ``causal`` (that is
            ``block_causal``).
    """
    if mask_type == "causal":
        if split_documents:
            raise ValueError("split_documents with mask_type 'causal' is mask_type 'block_causal'; use that")
        return causal_mask
    if mask_type == "block_causal":
        return block_causal_mask(document_ids(tokens, _eos(eos_id, mask_type)))
    if mask_type == "sliding_window":
        positional = sliding_window_mask(_positive(sliding_window, "sliding_window", mask_type))
    elif mask_type == "chunked":
        positional = chunked_mask(_positive(chunk_size, "chunk_size", mask_type))
    else:
        raise ValueError(f"unknown mask_type '{mask_type}'; valid: {', '.join(MASK_TYPES)}")
    if not split_documents:
        return positional
    return and_masks(positional, same_document_mask(document_ids(tokens, _eos(eos_id, mask_type))))


def _eos(eos_id: int | None, mask_type: str) -> int:
    if eos_id is None:
        raise ValueError(f"mask_type '{mask_type}' splits documents at EOS, so it needs eos_id")
    return eos_id


def _log_dense_path_once(device: torch.device) -> None:
    global _logged_dense_path
    if not _logged_dense_path:
        _logged_dense_path = True
        logger.info(
            "flex attention on %s: using an exact dense boolean mask with SDPA (flex has no CPU backward)",
            device.type,
        )


def build_attention_masks(
    tokens: torch.Tensor,
    mask_type: str,
    *,
    eos_id: int | None = None,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    split_documents: bool = False,
) -> AttentionMasks:
    """Build the attention mask for one batch; call once per batch and pass the result to every layer.

    The representation follows ``tokens.device``: a flex `BlockMask` on CUDA, a dense boolean mask
    elsewhere (the choice is logged once per process). Both come from the same mask mod, so they
    allow exactly the same positions. The masks that do not read the tokens (all but ``block_causal``
    and those that ``split_documents``) are built once per mask type, size, sequence length and
    device, and the same object is returned afterwards (the last 8 such are kept). Pitfall: code
    that replaces how masks are made (`create_mask`, as the memory estimator does) must
    `clear_mask_cache()` before and after.

    Args:
        tokens: int tensor ``[batch, seq]`` of input ids (read only by masks that split documents).
        mask_type: one of `MASK_TYPES`.
        eos_id: end-of-document id; required for ``block_causal`` and ``split_documents``.
        sliding_window: window length including the query itself; required for ``sliding_window``.
        chunk_size: chunk length; required for ``chunked``.
        split_documents: keep ``sliding_window`` or ``chunked`` within the documents ``eos_id``
            ends, for packed sequences (see `build_mask_mod`).

    Raises:
        ValueError: see `build_mask_mod`; also when ``tokens`` is not 2-D.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    mask_mod = build_mask_mod(
        tokens,
        mask_type,
        eos_id=eos_id,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        split_documents=split_documents,
    )
    token_dependent = reads_tokens(mask_type, split_documents)
    # Masks of positions only are built once per shape and reused. Not for fake tensors (the
    # memory estimator's), which must not meet real ones or outlive their mode.
    if not token_dependent and type(tokens) is torch.Tensor:
        window = sliding_window if mask_type == "sliding_window" else None
        chunk = chunk_size if mask_type == "chunked" else None
        return _token_independent_masks(mask_type, window, chunk, tokens.shape[1], tokens.device)
    batch = tokens.shape[0] if token_dependent else None
    return _masks_from_mod(mask_type, mask_mod, batch, tokens.shape[1], tokens.device)


def clear_mask_cache() -> None:
    """Forget the masks kept for reuse by `build_attention_masks`."""
    _token_independent_masks.cache_clear()


@functools.lru_cache(maxsize=8)
def _token_independent_masks(
    mask_type: str, window: int | None, chunk: int | None, seq_len: int, device: torch.device
) -> AttentionMasks:
    mask_mod = build_mask_mod(
        torch.empty(0, 0, dtype=torch.long), mask_type, sliding_window=window, chunk_size=chunk
    )
    return _masks_from_mod(mask_type, mask_mod, None, seq_len, device)


def _masks_from_mod(
    mask_type: str, mask_mod: MaskMod, mask_batch: int | None, seq_len: int, device: torch.device
) -> AttentionMasks:
    """`mask_mod` as a block mask on CUDA, else as a dense one; ``mask_batch`` None broadcasts."""
    if device.type == "cuda":
        block_mask = build_block_mask(mask_mod, mask_batch, seq_len, device)
        return AttentionMasks(mask_type, mask_mod, seq_len, block_mask=block_mask)
    _log_dense_path_once(device)
    dense_mask = create_mask(mask_mod, mask_batch, None, seq_len, seq_len, device=device)
    return AttentionMasks(mask_type, mask_mod, seq_len, dense_mask=dense_mask)


def _create_block_mask_compiled():
    global _compiled_create_block_mask
    if _compiled_create_block_mask is None:
        _compiled_create_block_mask = torch.compile(create_block_mask)
    return _compiled_create_block_mask


def build_block_mask(
    mask_mod: MaskMod, batch: int | None, seq_len: int, device: torch.device | str, kv_len: int | None = None
) -> BlockMask:
    """The flex-attention `BlockMask` of ``mask_mod`` for square ``seq_len`` attention, built compiled.

    Eager `create_block_mask` first materializes the whole ``[batch, seq, seq]`` boolean mask, and
    the mask mod's intermediates with it (``block_causal`` gathers int64 document ids per pair), only
    to reduce it to one entry per 128x128 block: gigabytes at seq_len 8192. Compiled, the mask mod is
    fused into that reduction and nothing of size ``seq**2`` is allocated. It compiles once per mask
    type on first use; a new batch's mask mod (a fresh closure over new document ids of the same
    shape) reuses the compiled code.

    Args:
        mask_mod: a mask mod from `build_mask_mod`.
        batch: the batch size for masks that read the tokens (`reads_tokens`), or None to broadcast.
        seq_len: query and key length.
        device: where the mask (and the document ids of masks that split documents) live. Any device
            inductor compiles for works; the model uses this on CUDA only.
        kv_len: the key length when it differs from the query length (context parallelism).
    """
    kv_len = seq_len if kv_len is None else kv_len
    return _create_block_mask_compiled()(mask_mod, batch, None, seq_len, kv_len, device=device)


def _repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Repeating (rather than SDPA's enable_gqa) keeps every SDPA kernel, CPU flash included, eligible.
    repeats = q.shape[1] // k.shape[1]
    if repeats > 1:
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
    return k, v


def _flex_attention_compiled():
    # Compiled lazily so importing this module (or running on CPU) never triggers torch.compile.
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention


class ScaledDotProductAttention(nn.Module):
    """Causal attention over (batch, heads, seq, head_dim) tensors via `F.scaled_dot_product_attention`.

    Keys and values with fewer heads than the queries (GQA) are repeated to the query head
    count first, so every SDPA kernel (including CPU flash) applies.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        masks: AttentionMasks | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Causal attention.

        Args:
            q, k, v: ``[batch, heads, seq, head_dim]``; k and v may have fewer heads (GQA).
            masks: ignored (this backend is always causal); accepted so models call both backends
                alike. Under context parallelism, the causal mask the exchange needs
                (`masks_under_context_parallel`).
            scale: softmax scale; None means ``1 / sqrt(head_dim)``.
        """
        if masks is not None and masks.context_parallel is not None:
            return context_parallel_attention(q, k, v, masks, scale)
        k, v = _repeat_kv(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


class FlexAttention(nn.Module):
    """Attention under a prebuilt `AttentionMasks` (any of `MASK_TYPES`).

    With a block mask (CUDA) it runs a compiled `flex_attention`, using its native GQA. With a dense
    mask it runs SDPA with that boolean mask, repeating k and v heads for GQA; this path supports
    backward on CPU, unlike flex attention itself.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        masks: AttentionMasks | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Masked attention.

        Args:
            q, k, v: ``[batch, heads, seq, head_dim]``; k and v may have fewer heads (GQA).
            masks: from `build_attention_masks` on this batch's tokens; required.
            scale: softmax scale; None means ``1 / sqrt(head_dim)``.

        Raises:
            ValueError: when ``masks`` is None or covers a different sequence length than q.
        """
        if masks is None:
            raise ValueError("the flex backend needs masks: pass build_attention_masks(tokens, mask_type)")
        if masks.context_parallel is not None:
            return context_parallel_attention(q, k, v, masks, scale)
        if masks.seq_len != q.shape[2]:
            raise ValueError(f"masks cover seq_len {masks.seq_len} but q has seq_len {q.shape[2]}")
        return _masked_attention(q, k, v, masks, scale)


def _masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: AttentionMasks, scale: float | None
) -> torch.Tensor:
    """Attention under `masks`: compiled flex with a block mask, SDPA with a dense one."""
    if masks.block_mask is not None:
        gqa = k.shape[1] < q.shape[1]
        return _flex_attention_compiled()(q, k, v, block_mask=masks.block_mask, scale=scale, enable_gqa=gqa)
    k, v = _repeat_kv(q, k, v)
    # Compiled blocks take the boolean mask, as before: filling the shared additive one from
    # inside a compiled block would make it recompile once the mask exists.
    mask = masks.dense_mask if torch.compiler.is_compiling() else masks.additive_mask(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: AttentionMasks, scale: float | None
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, under context parallelism.

    Args:
        q, k, v: ``[batch, heads, tokens / cp, head_dim]`` of this rank's tokens; k and v may
            have fewer heads (GQA).
        masks: from `masks_under_context_parallel`, which says how to exchange.
        scale: softmax scale; None means ``1 / sqrt(head_dim)``.

    Returns:
        ``[batch, heads, tokens / cp, head_dim]``: this rank's rows of one process's output.
    """
    step = masks.context_parallel
    if step.plan.method == "ulysses":
        if k.shape[1] % step.plan.cp:
            k, v = _repeat_kv(q, k, v)
        q, k, v = (step.heads_for_sequence(t) for t in (q, k, v))
        return step.sequence_for_heads(_masked_attention(q, k, v, masks, scale))
    return _masked_attention(q, step.gather_sequence(k), step.gather_sequence(v), masks, scale)


def masks_under_context_parallel(layer_masks: list[AttentionMasks | None]) -> list[AttentionMasks | None]:
    """Each layer's masks as attention under context parallelism needs them, or `layer_masks`
    unchanged without it.

    Under context parallelism the masks (built from the whole sequence, `tokens_for_masks`) are
    read at the positions the exchange puts the queries and keys at: this rank's tokens against
    every rank's in rank order (all-gather of keys and values), or every rank's against every
    rank's (Ulysses). The sdpa backend's None becomes the causal mask. Each distinct mask is
    read once and shared by its layers.
    """
    step = active_step()
    if step is None:
        return layer_masks
    every = step.gathered_positions
    rows = every if step.plan.method == "ulysses" else step.positions
    read: dict[int, AttentionMasks] = {}
    for masks in layer_masks:
        if id(masks) not in read:
            whole = masks if masks is not None else build_attention_masks(step.full_tokens, "causal")
            read[id(masks)] = _read_at(whole, rows, every, step)
    return [read[id(masks)] for masks in layer_masks]


def _read_at(masks: AttentionMasks, rows: torch.Tensor, cols: torch.Tensor, step: ContextParallelStep):
    """`masks` read at query positions `rows` and key positions `cols`."""
    mod = masks.mask_mod

    def mask_mod(b, h, q_idx, kv_idx):
        return mod(b, h, rows[q_idx], cols[kv_idx])

    if masks.block_mask is not None:
        batch = masks.block_mask.kv_num_blocks.shape[0]
        block = build_block_mask(mask_mod, batch if batch > 1 else None, len(rows), rows.device, len(cols))
        return AttentionMasks(masks.mask_type, mask_mod, len(rows), block_mask=block, context_parallel=step)
    dense = masks.dense_mask.index_select(2, rows).index_select(3, cols)
    return AttentionMasks(masks.mask_type, mask_mod, len(rows), dense_mask=dense, context_parallel=step)


def build_attention(backend: str) -> nn.Module:
    """The attention module for ``backend`` (one of `ATTENTION_BACKENDS`).

    Raises:
        ValueError: for an unknown backend name.
    """
    if backend == "sdpa":
        return ScaledDotProductAttention()
    if backend == "flex":
        return FlexAttention()
    raise ValueError(f"unknown attention backend '{backend}'; valid: {', '.join(ATTENTION_BACKENDS)}")
