"""Small building blocks shared by several models."""

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.job_config import Model as ModelConfig
from torchtitan.config.validation import (
    attention_backend_conflict,
    global_layers_conflict,
    split_documents_conflict,
)
from torchtitan.distributed.param_init import init_param_
from torchtitan.models.attention import (
    ATTENTION_BACKENDS,
    MASK_TYPES,
    AttentionMasks,
    build_attention_masks,
    reads_tokens,
)
from torchtitan.models.rope import Rotary, YaRNScaling


@dataclass
class AttentionArgs:
    """Attention settings that every model's args dataclass inherits, with `update_from_config`.

    Attributes:
        attn_backend: one of `ATTENTION_BACKENDS`.
        attn_mask_type: one of `MASK_TYPES`; every type but ``causal`` needs the ``flex`` backend.
        eos_id: the id that ends a document, read by ``block_causal`` and ``split_documents``;
            `with_attention_config` takes it from the run's tokenizer.
        sliding_window: keys a query sees, itself included, under ``sliding_window``.
        attn_chunk_size: chunk length under ``chunked``.
        split_documents: also split ``sliding_window`` or ``chunked`` at document ends.
        attn_global_every_n_layers: n > 1 makes layers n-1, 2n-1, ... global (`is_global_layer`):
            they attend to every earlier token, of their document under ``split_documents``,
            while the others keep ``sliding_window`` or ``chunked``; 0: no global layer.

    Raises:
        ConfigError: (at construction) for an unknown backend or mask type, a mask type other
            than ``causal`` with the ``sdpa`` backend, ``split_documents`` or global layers with
            a mask type other than ``sliding_window`` and ``chunked``, or a global-layer
            interval of 1 or above ``n_layers`` (models whose args have it).
    """

    attn_backend: str = "sdpa"
    attn_mask_type: str = "causal"
    eos_id: int | None = None
    # [model]'s defaults, so that args built without a config match a run that leaves them unset.
    sliding_window: int = ModelConfig.sliding_window
    attn_chunk_size: int = ModelConfig.attn_chunk_size
    split_documents: bool = ModelConfig.attn_split_documents
    attn_global_every_n_layers: int = ModelConfig.attn_global_every_n_layers

    def __post_init__(self):
        if self.attn_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"'model.attn_backend' = '{self.attn_backend}' is unknown; use one of "
                f"{', '.join(ATTENTION_BACKENDS)}."
            )
        if self.attn_mask_type not in MASK_TYPES:
            raise ConfigError(
                f"'model.attn_mask_type' = '{self.attn_mask_type}' is unknown; use one of "
                f"{', '.join(MASK_TYPES)}."
            )
        if self.attn_backend == "sdpa" and self.attn_mask_type != "causal":
            # Both set in the config is refused before the ranks start; here the flavor chose sdpa.
            raise attention_backend_conflict(self.attn_mask_type, whose=" (the flavor's when unset)")
        if self.split_documents and self.attn_mask_type not in ("sliding_window", "chunked"):
            raise split_documents_conflict(
                self.attn_mask_type, self.attn_backend, whose=" (the flavor's when unset)"
            )
        every = self.attn_global_every_n_layers
        if error := global_layers_conflict(every, self.attn_mask_type, whose=" (the flavor's when unset)"):
            raise error
        n_layers = getattr(self, "n_layers", every)
        if every > n_layers:
            raise ConfigError(
                f"'model.attn_global_every_n_layers' = {every} leaves all {n_layers} layers of this "
                f"flavor local (the first global layer would be layer {every - 1}); choose at most "
                f"{n_layers}, or 0 for none."
            )

    def update_from_config(self, job_config: JobConfig):
        """A copy for the run: its RoPE table covers `training.seq_len`, with `[model]`'s attention
        keys (`with_attention_config`), `model.always_apply_yarn` and `model.moe_force_load_balance`
        applied. Every model's args inherit it; they have a `max_seq_len`, those with YaRN an
        `always_apply_yarn` field, and those with MoE layers a `moe_args` field.

        Raises:
            ConfigError: also for `model.always_apply_yarn` on a flavor without YaRN, or
                `model.moe_force_load_balance` on one without MoE layers.
        """
        m = job_config.model
        overrides = {"max_seq_len": job_config.training.seq_len}
        if m.always_apply_yarn:
            if not isinstance(getattr(self, "rope_scaling", None), YaRNScaling):
                raise ConfigError(
                    f"'model.always_apply_yarn' = true, but {m.name} flavor '{m.flavor}' has no YaRN "
                    "scaling to apply; remove the key (it is for DeepSeek flavors with YaRN)."
                )
            overrides["always_apply_yarn"] = True
        if m.moe_force_load_balance:
            overrides["moe_args"] = self._forced_balance_moe_args(job_config)
        return replace(self, **overrides).with_attention_config(job_config)

    def _forced_balance_moe_args(self, job_config: JobConfig):
        moe_args = getattr(self, "moe_args", None)
        if moe_args is None:
            m = job_config.model
            raise ConfigError(
                f"'model.moe_force_load_balance' = true, but {m.name} flavor '{m.flavor}' has no MoE "
                "layers to balance; remove the key (it is for MoE flavors)."
            )
        return replace(moe_args, force_load_balance=True)

    def with_attention_config(self, job_config: JobConfig):
        """A copy with ``[model]``'s attention keys applied.

        The backend and mask type are overridden only when set (unset keeps the flavor's);
        the window, chunk size, document split and global-layer interval always come from the
        config. For a mask that splits documents the EOS id is read from the tokenizer in
        ``model.hf_assets_path``, the one the run trains with.

        Raises:
            ConfigError: for a mask type the backend cannot run or ``attn_split_documents`` or
                ``attn_global_every_n_layers`` does not apply to, or an interval the flavor's
                layers cannot hold (checked before the tokenizer is read), or a mask that splits
                documents with a tokenizer that has no EOS token.
        """
        m = job_config.model
        args = replace(
            self,
            attn_backend=m.attn_backend or self.attn_backend,
            attn_mask_type=m.attn_mask_type or self.attn_mask_type,
            sliding_window=m.sliding_window,
            attn_chunk_size=m.attn_chunk_size,
            split_documents=m.attn_split_documents,
            attn_global_every_n_layers=m.attn_global_every_n_layers,
        )
        if not reads_tokens(args.attn_mask_type, args.split_documents):
            return args
        eos_id = build_hf_tokenizer(job_config).eos_id
        if eos_id is None:
            split = " with 'model.attn_split_documents' = true" if args.split_documents else ""
            raise ConfigError(
                f"'model.attn_mask_type' = '{args.attn_mask_type}'{split} splits documents at "
                f"EOS, but the tokenizer in 'model.hf_assets_path' = '{m.hf_assets_path}' has no EOS "
                "token; use a tokenizer with one, or a mask that does not split documents."
            )
        return replace(args, eos_id=eos_id)

    def describe_attention(self) -> str:
        """The attention the layers run, for the startup log: backend, mask type and its size,
        where documents split, and which layers are global (e.g. ``flex, sliding_window of
        4096, split at EOS id 2; block_causal on every 4th layer``)."""
        if self.attn_backend == "sdpa":
            return "sdpa, causal"
        sizes = {"sliding_window": self.sliding_window, "chunked": self.attn_chunk_size}
        size = f" of {sizes[self.attn_mask_type]}" if self.attn_mask_type in sizes else ""
        splits = reads_tokens(self.attn_mask_type, self.split_documents)
        split = f", split at EOS id {self.eos_id}" if splits else ""
        described = f"flex, {self.attn_mask_type}{size}{split}"
        every = self.attn_global_every_n_layers
        if not every:
            return described
        return f"{described}; {self.global_mask_type} on every {_ordinal(every)} layer"

    @property
    def global_mask_type(self) -> str:
        """The mask of global layers: every earlier token, of the same document when local
        layers split documents."""
        return "block_causal" if self.split_documents else "causal"

    def is_global_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` (0-based) attends globally: the last of every
        ``attn_global_every_n_layers`` layers, as Llama 4's NoPE layers and gpt-oss' full
        attention layers are placed."""
        every = self.attn_global_every_n_layers
        return every > 0 and (layer_id + 1) % every == 0

    def attention_span(self, seq_len: int) -> float:
        """Keys each query is counted against in the FLOP count: ``2 x pairs / (seq_len + 1)``,
        where ``pairs`` is the (query, key) pairs the mask allows. That is ``seq_len`` for causal
        (torchtitan's MFU counts the full square, causality not discounted, and so does
        ``block_causal``, whose documents vary by batch), and the same share of the pairs for
        ``sliding_window`` and ``chunked`` (split at documents or not, as ``block_causal``), so
        that MFU compares across mask types. With global layers it is the mean over the layers
        (``n_layers``, or 1 for args without it)."""
        n_layers = getattr(self, "n_layers", 1)
        n_global = sum(self.is_global_layer(layer_id) for layer_id in range(n_layers))
        local, whole = (self._allowed_pairs(seq_len, mask) for mask in (self.attn_mask_type, "causal"))
        mean_pairs = ((n_layers - n_global) * local + n_global * whole) / n_layers
        return 2 * mean_pairs / (seq_len + 1)

    def _allowed_pairs(self, seq_len: int, mask_type: str) -> int:
        if mask_type == "sliding_window":
            window = min(seq_len, self.sliding_window)
            return window * (window + 1) // 2 + (seq_len - window) * window
        if mask_type == "chunked":
            chunk = min(seq_len, self.attn_chunk_size)
            chunks, rest = divmod(seq_len, chunk)
            return chunks * chunk * (chunk + 1) // 2 + rest * (rest + 1) // 2
        return seq_len * (seq_len + 1) // 2

    def build_masks(self, tokens: torch.Tensor) -> AttentionMasks | None:
        """The attention masks of one batch, to be built once per forward and shared by every layer.

        Args:
            tokens: ``[batch, seq]`` input ids.

        Returns:
            None for ``sdpa`` (causal, needs no mask), else `build_attention_masks` of these args.
        """
        if self.attn_backend == "sdpa":
            return None
        return build_attention_masks(
            tokens,
            self.attn_mask_type,
            eos_id=self.eos_id,
            sliding_window=self.sliding_window,
            chunk_size=self.attn_chunk_size,
            split_documents=self.split_documents,
        )

    def build_layer_masks(self, tokens: torch.Tensor) -> list[AttentionMasks | None]:
        """Every layer's attention masks for one batch, indexed by layer id (``n_layers`` of
        them): `build_masks` for the local layers and one global mask for the global layers
        (`is_global_layer`), each built once and shared. All None for ``sdpa``."""
        local = self.build_masks(tokens)
        if not self.attn_global_every_n_layers:
            return [local] * self.n_layers
        whole = build_attention_masks(tokens, self.global_mask_type, eos_id=self.eos_id)
        return [whole if self.is_global_layer(i) else local for i in range(self.n_layers)]


def _ordinal(n: int) -> str:
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def trunc_normal(std: float):
    """An in-place init: normal(0, std) truncated at 3 std."""
    return lambda t: nn.init.trunc_normal_(t, mean=0.0, std=std, a=-3 * std, b=3 * std)


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` that computes in its input's dtype, with its weight cast to it when they
    differ, as FSDP's bf16 mixed precision casts it.

    Why: under bf16 autocast (one device, or data parallelism by replication), the weights stay
    fp32 while a norm fed by a matmul gets bf16 (Qwen3's q/k norms, DeepSeek-V3's q/kv norms;
    the block norms read the fp32 residual). `F.rms_norm` cannot send mixed dtypes to the GPU's
    fused kernel: it warns "Mismatch dtype between input and weight" and runs the decomposed
    form, several kernels that also hold the input upcast to fp32 for backward. The cast rounds
    the weight to bf16 for the product only; its gradient and the optimizer stay fp32.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is not None and weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class SwiGLU(nn.Module):
    """`silu(a) * b` as a module without parameters: a cheap region of the block (see
    `DecoderBlock.cheap_regions`) that AC can recompute alone. Its backward otherwise holds
    `silu(a)`, one more tensor of the hidden width."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.silu(a) * b


class FeedForward(nn.Module):
    """SwiGLU MLP `w2(silu(w1(x)) * w3(x))` of nn.Linear layers (named so that a TP plan shards
    w1/w3 column-wise and w2 row-wise): dense feed-forwards and MoE shared experts."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.swiglu = SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.swiglu(self.w1(x), self.w3(x)))

    def init_weights(self, out_std: float) -> None:
        init_param_(self.w1.weight, trunc_normal(0.02))
        for linear in (self.w2, self.w3):
            init_param_(linear.weight, trunc_normal(out_std))


def depth_scaled_std(layer_id: int, n_layers: int, depth_init: bool) -> float:
    """Init std of a block's output projections: 0.02 / sqrt(2 * depth), where depth is the
    block's 1-based index (depth_init) or the layer count, so deep residual sums stay bounded."""
    depth = layer_id + 1 if depth_init else n_layers
    return 0.02 / math.sqrt(2 * depth)


# The module types `DecoderBlock.cheap_regions` returns.
CHEAP_REGIONS = (nn.RMSNorm, Rotary, SwiGLU)


class DecoderBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then h + mlp(norm(h)).

    `mlp` is registered as `feed_forward` (dense) or `moe` (routed experts), the names of the
    FQNs that state dicts, TP plans and save lists use. The parallelizers (AC, TP, EP, compile)
    ask the block for its parts: `attention`, `mlp` and `mlp_name`, `is_moe`, `routed_experts`
    and `end_linears`. Subclasses build the model's own attention and mlp and pass them in.
    """

    def __init__(self, dim: int, norm_eps: float, attention: nn.Module, mlp: nn.Module, mlp_name: str,
                 out_std: float):  # fmt: skip
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)
        self.register_module(mlp_name, mlp)
        self.mlp_name, self.out_std = mlp_name, out_std

    @property
    def mlp(self) -> nn.Module:
        return getattr(self, self.mlp_name)

    @property
    def is_moe(self) -> bool:
        """Whether the MLP is a Mixture of Experts (`moe`) rather than a dense feed-forward."""
        return self.mlp_name == "moe"

    @property
    def routed_experts(self) -> nn.Module | None:
        """The MoE's routed experts (whose output the expert-parallel combine all-to-all sends
        back), or None for a dense block."""
        return self.mlp.experts if self.is_moe else None

    def cheap_regions(self) -> list[nn.Module]:
        """The block's modules of element-wise work only (its norms, RoPE, SwiGLU gates): what
        AC can recompute region by region, each a plain checkpoint, without per-op dispatch."""
        return [m for m in self.modules() if isinstance(m, CHEAP_REGIONS)]

    def end_linears(self) -> list[nn.Linear]:
        """The Linears of the block's last part, its MLP (a dense feed-forward's, or an MoE's
        router gate and shared experts): under sequence parallelism the block's last
        reduce-scatter follows one of their matmuls, with no other matmul between."""
        return [m for m in self.mlp.modules() if isinstance(m, nn.Linear)]

    def forward(
        self, x: torch.Tensor, rope_cache: torch.Tensor, masks: AttentionMasks | None = None
    ) -> torch.Tensor:
        """``masks``: this batch's, from `AttentionArgs.build_masks`; None for the sdpa backend."""
        h = x + self.attention_branch(x, rope_cache, masks)
        return h + self.mlp_branch(h)

    # The two residual branches, each with its norm: the regions the AC module checkpoints when
    # the whole block cannot be one (flex attention with op-SAC and compile off).

    def attention_branch(
        self, x: torch.Tensor, rope_cache: torch.Tensor, masks: AttentionMasks | None = None
    ) -> torch.Tensor:
        # By keyword: TP's PrepareModuleInput on `attention` lays out the positional inputs only.
        return self.attention(self.attention_norm(x), rope_cache, masks=masks)

    def mlp_branch(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ffn_norm(h))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            init_param_(norm.weight, nn.init.ones_)
        self.attention.init_weights(self.out_std)
        self.mlp.init_weights(self.out_std)
