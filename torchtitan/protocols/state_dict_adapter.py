"""StateDictAdapter: a model's state dict to and from its Hugging Face transformers checkpoint.

Our keys are the model's plain `state_dict()` FQNs (``layers.0.attention.wq.weight``); HF keys and
layouts are the ones transformers' ``save_pretrained`` writes for the architecture in
`StateDictAdapter.hf_config` (``model.layers.0.self_attn.q_proj.weight``), i.e. the layout
published checkpoints use, which transformers 4.x and 5.x both load.
"""

import json
import logging
import math
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path

import torch

from torchtitan.config.errors import ConfigError

logger = logging.getLogger(__name__)

# Token ids copied from the HF repo's config.json (see `StateDictAdapter.hf_config`).
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
HF_CONFIG_FILE = "config.json"
_HF_LM_HEAD, _HF_EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
# Derived buffers some older HF checkpoints still store; nothing of ours corresponds to them.
_DERIVED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_config(folder: str | Path) -> dict:
    """The config.json of the HF checkpoint or asset folder `folder`; {} when it has none.

    Raises:
        ConfigError: the file is not a readable JSON object (often truncated by an interrupted
            download, or a git-lfs pointer), naming it.
    """
    config_file = Path(folder) / HF_CONFIG_FILE
    if not config_file.is_file():
        return {}
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, OSError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"'{config_file}' cannot be read as JSON ({error}); fetch it again.") from None
    if not isinstance(config, dict):
        raise ConfigError(f"'{config_file}' holds no JSON object; fetch it again.")
    return config


class StateDictMismatchError(ValueError):
    """Keys (or shapes) that do not match between a checkpoint and the model it is meant for."""


class HFConfigError(ValueError):
    """Model args that the Hugging Face architecture cannot express (so cannot be exported)."""


class StateDictAdapter(ABC):
    """Converts one model flavor's state dict to and from the Hugging Face transformers layout.

    The conversion is driven by two class attributes that subclasses set:

    * ``key_map``: our key template -> HF key template, where ``{}`` stands for each integer
      path component (layer index). An HF template with one more ``{}`` than ours names one
      slice of a stacked tensor: our tensor is the stack, along dim 0, over that last index
      (MoE experts: [num_experts, ...] here, one ``mlp.experts.{e}.*`` tensor each in HF).
    * ``rope_permuted``: our templates whose dim 0 is made of rotary heads of width
      `rope_head_dim` in our interleaved-pair layout that HF keeps half-split; they are permuted
      per head (`interleaved_to_half_split`).

    Args:
        model_args: the flavor's args.
        hf_assets_path: the HF repo's asset folder; when it holds a config.json, `hf_config`
            copies its token ids (bos/eos/pad) so that generation stops where the tokenizer says
            (without one, see `use_tokenizer_ids`).

    Pitfalls: tensors must be full (unsharded: gather DTensors first), since the RoPE
    permutation and the expert split reshape whole tensors; dtypes and devices are kept as given;
    `to_hf` may return views of its input (one per stacked expert), which
    `torchtitan.components.hf_io.save_hf` copies before writing.
    """

    key_map: Mapping[str, str] = {}
    rope_permuted: frozenset[str] = frozenset()

    def __init__(self, model_args, hf_assets_path: str | Path | None = None):
        self.model_args = model_args
        self.hf_assets_path = hf_assets_path
        self._tokenizer_ids: dict[str, int] = {}
        self._from_hf_map = {hf: ours for ours, hf in self.key_map.items()}
        self._stacked = {ours for ours, hf in self.key_map.items() if hf.count("{}") == ours.count("{}") + 1}

    @property
    def rope_head_dim(self) -> int:
        """Width of one rotary head in the `rope_permuted` tensors."""
        raise NotImplementedError(f"{type(self).__name__} permutes no rotary weights")

    @abstractmethod
    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict:
        """The transformers ``config.json`` content of this flavor, its weights stored in `dtype`.

        Raises:
            HFConfigError: for args the HF architecture cannot express (the message says which).
        """

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our state dict -> HF keys and layouts.

        Raises:
            StateDictMismatchError: naming the first keys that have no HF counterpart.
        """
        hf, unknown = {}, []
        for key, tensor in state_dict.items():
            template, indices = split_indices(key)
            hf_template = self.key_map.get(template)
            if hf_template is None:
                unknown.append(key)
            elif template in self._stacked:
                for expert, piece in enumerate(tensor.unbind(0)):
                    hf[hf_template.format(*indices, expert)] = piece
            else:
                if template in self.rope_permuted:
                    tensor = interleaved_to_half_split(tensor, self.rope_head_dim)
                hf[hf_template.format(*indices)] = tensor
        if unknown:
            raise StateDictMismatchError(f"keys with no Hugging Face counterpart: {name_few(unknown)}")
        return hf

    def hf_layout_change(self, key: str) -> str:
        """How `to_hf` changes our tensor `key` beyond its name: "rope" (rows permuted per rotary
        head of `rope_head_dim`), "stacked" (one HF tensor per slice of dim 0), or "renamed"."""
        template, _ = split_indices(key)
        if template in self._stacked:
            return "stacked"
        return "rope" if template in self.rope_permuted else "renamed"

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF keys and layouts -> our state dict; the inverse of `to_hf`.

        Keys that `ignores_hf_key` accepts are skipped. Missing keys are not detected here:
        compare the result with the model's state dict (`describe_mismatch`).

        Raises:
            StateDictMismatchError: naming the first HF keys this adapter does not know, or a
                stacked tensor with a gap in its slices.
        """
        ours, stacks, unknown = {}, defaultdict(dict), []
        hf_state_dict = self._without_tied_lm_head(hf_state_dict)
        for hf_key, tensor in hf_state_dict.items():
            if self.ignores_hf_key(hf_key):
                continue
            hf_template, indices = split_indices(hf_key)
            template = self._from_hf_map.get(hf_template)
            if template is None:
                unknown.append(hf_key)
            elif template in self._stacked:
                *outer, expert = indices
                stacks[template.format(*outer)][expert] = tensor
            else:
                if template in self.rope_permuted:
                    tensor = half_split_to_interleaved(tensor, self.rope_head_dim)
                ours[template.format(*indices)] = tensor
        if unknown:
            raise StateDictMismatchError(f"Hugging Face keys this model does not have: {name_few(unknown)}")
        for key, pieces in stacks.items():
            ours[key] = _stack_in_order(key, pieces)
        return ours

    def _without_tied_lm_head(self, hf_state_dict: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """For a tied flavor, whose logits reuse the embedding: `hf_state_dict` without its
        ``lm_head.weight``, which some tied checkpoints store too.

        Raises:
            StateDictMismatchError: that lm_head differs from the embedding: the checkpoint is
                untied, and loading it into a tied flavor would drop its output projection.
        """
        head = hf_state_dict.get(_HF_LM_HEAD)
        if head is None or not self.model_args.tie_word_embeddings:
            return hf_state_dict
        embedding = hf_state_dict.get(_HF_EMBEDDING)
        real = head.device.type != "meta" and embedding is not None and embedding.device.type != "meta"
        if real and not torch.equal(head, embedding):
            raise StateDictMismatchError(
                f"{_HF_LM_HEAD} differs from {_HF_EMBEDDING}: the checkpoint has its own output "
                "projection (untied), which this flavor, tying it to the embedding, would drop"
            )
        return {key: tensor for key, tensor in hf_state_dict.items() if key != _HF_LM_HEAD}

    def experts_to_read(self, hf_keys: Iterable[str], experts: range) -> dict[str, str]:
        """For a rank that holds only `experts` of each MoE layer (expert parallelism): the keys
        of `hf_keys` it needs, each mapped to its key in a checkpoint of those experts alone,
        numbered from 0. Other experts' keys are left out, so they are never read; every other
        key maps to itself. `from_hf` of the renamed tensors then stacks just `experts`."""
        kept = {}
        for hf_key in hf_keys:
            template, indices = split_indices(hf_key)
            if self._from_hf_map.get(template) not in self._stacked:
                kept[hf_key] = hf_key
            elif indices[-1] in experts:
                kept[hf_key] = template.format(*indices[:-1], indices[-1] - experts.start)
        return kept

    def left_out_of_hf(self, keys: Iterable[str]) -> list[str]:
        """Those of our state-dict `keys` that `to_hf` leaves out, having no place in the HF
        architecture (none by default)."""
        return []

    def use_tokenizer_ids(self, bos_id: int | None, eos_id: int | None) -> None:
        """The token ids config.json gets when `hf_assets_path` has no config.json of its own
        (a folder with the tokenizer only, as fetched by `download_hf_assets.py --assets
        tokenizer`): the run's tokenizer's. Without them transformers falls back to its
        architecture's defaults (Llama's bos 1, eos 2), and generation never stops at EOS."""
        ids = (("bos_token_id", bos_id), ("eos_token_id", eos_id))
        self._tokenizer_ids = {key: value for key, value in ids if value is not None}

    def ignores_hf_key(self, hf_key: str) -> bool:
        """Whether `from_hf` skips `hf_key` (and loaders need not read it): derived buffers."""
        return hf_key.endswith(_DERIVED_HF_SUFFIXES)

    def base_hf_config(self, dtype: torch.dtype) -> dict:
        """The config fields every decoder here shares (same arg names in every model's args),
        plus the token ids of `hf_assets_path`'s config.json.

        Raises:
            HFConfigError: for a mask type inference cannot reproduce. ``block_causal`` exports as
                causal: it only keeps packed training documents apart.
        """
        a = self.model_args
        if a.attn_mask_type not in ("causal", "block_causal"):
            raise HFConfigError(
                f"attn_mask_type '{a.attn_mask_type}' has no Hugging Face config equivalent here; "
                "only causal (and block_causal, exported as causal) models can be exported."
            )
        return {
            "vocab_size": a.vocab_size,
            "hidden_size": a.dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "max_position_embeddings": a.max_seq_len,
            "tie_word_embeddings": a.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "initializer_range": 0.02,
            # "torch_dtype" rather than transformers 5's "dtype": what Hub configs carry and
            # every reader (transformers 4 and 5, vLLM) understands.
            "torch_dtype": str(dtype).removeprefix("torch."),
            **self._tokenizer_ids,
            **self._token_ids_from_assets(),
        }

    def _token_ids_from_assets(self) -> dict:
        if self.hf_assets_path is None:
            return {}
        hf_config = read_hf_config(self.hf_assets_path)
        return {key: hf_config[key] for key in _TOKEN_ID_KEYS if key in hf_config}


def split_indices(key: str) -> tuple[str, tuple[int, ...]]:
    """``"layers.3.moe.experts.w1"`` -> (``"layers.{}.moe.experts.w1"``, (3,)): every integer
    path component becomes ``{}``."""
    parts = key.split(".")
    indices = tuple(int(part) for part in parts if part.isdigit())
    return ".".join("{}" if part.isdigit() else part for part in parts), indices


def interleaved_to_half_split(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder dim 0 of `weight`, a stack of heads of `head_dim` rows, from our interleaved
    rotary pairs (2i, 2i+1) to HF's half-split pairs (i, i + head_dim/2).

    The rows of a q/k projection (or the entries of a per-head q/k norm) that make pair i move
    together, so attention scores, which are sums over all pairs, stay the same.
    """
    return weight.unflatten(0, (-1, head_dim // 2, 2)).transpose(1, 2).flatten(0, 2)


def half_split_to_interleaved(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of `interleaved_to_half_split`."""
    return weight.unflatten(0, (-1, 2, head_dim // 2)).transpose(1, 2).flatten(0, 2)


def _stack_in_order(key: str, pieces: dict[int, torch.Tensor]) -> torch.Tensor:
    missing = sorted(set(range(max(pieces) + 1)) - set(pieces))
    if missing:
        raise StateDictMismatchError(f"'{key}' lacks the slices (experts) {name_few(missing)}")
    return torch.stack([pieces[i] for i in range(len(pieces))])


def name_few(items, limit: int = 5) -> str:
    """The first `limit` of `items`, comma-separated, with a count of the rest."""
    items = list(items)
    shown = ", ".join(str(item) for item in items[:limit])
    return shown + (f" (and {len(items) - limit} more)" if len(items) > limit else "")


def describe_mismatch(expected: Mapping[str, torch.Size], actual: Mapping[str, torch.Size]) -> str | None:
    """What differs between two {key: shape} maps, in one sentence naming the first few keys;
    None when they match."""
    problems = []
    if missing := [key for key in expected if key not in actual]:
        problems.append(f"missing keys: {name_few(missing)}")
    if unexpected := [key for key in actual if key not in expected]:
        problems.append(f"unexpected keys: {name_few(unexpected)}")
    if wrong := [key for key in expected if key in actual and tuple(expected[key]) != tuple(actual[key])]:
        shapes = [f"{key} {tuple(actual[key])} (want {tuple(expected[key])})" for key in wrong]
        problems.append(f"wrong shapes: {name_few(shapes)}")
    return "; ".join(problems) or None


# config.json fields that change the numbers without changing any tensor's shape: the RoPE,
# norm, activation and routing constants.
NUMERIC_HF_CONFIG_KEYS = ("rope_theta", "rope_scaling", "rope_interleave", "rms_norm_eps", "hidden_act",
                          "num_experts_per_tok", "norm_topk_prob", "routed_scaling_factor", "n_group",
                          "topk_group", "scoring_func", "topk_method")  # fmt: skip
# What transformers assumes for a key that a checkpoint's config.json leaves out, where that
# matters: DeepSeek-V3's rotary pairs are interleaved unless the config says otherwise.
_HF_CONFIG_DEFAULTS = {"rope_interleave": True}


def hf_config_differences(ours: Mapping, theirs: Mapping) -> list[str]:
    """The `NUMERIC_HF_CONFIG_KEYS` on which a checkpoint's config.json (`theirs`) disagrees
    with this model's (`ours`), each as "key: checkpoint X, this run Y". Only keys this model
    writes are compared; a key the checkpoint leaves out is compared as transformers' default
    where that is known (`_HF_CONFIG_DEFAULTS`), and otherwise not at all."""

    def same(a, b) -> bool:
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            return all(same(a.get(k), b.get(k)) for k in a.keys() - {"type", "rope_type"})
        if isinstance(a, int | float) and isinstance(b, int | float):
            return math.isclose(a, b, rel_tol=1e-6)
        return a == b

    theirs = {**_HF_CONFIG_DEFAULTS, **_with_top_level_rope_keys(theirs)}
    ours = {"rope_scaling": None, **ours}  # a model that writes no scaling has none
    return [
        f"{key}: checkpoint {theirs[key]}, this run {ours[key]}"
        for key in NUMERIC_HF_CONFIG_KEYS
        if key in theirs and key in ours and not same(ours[key], theirs[key])
    ]


def _with_top_level_rope_keys(config: Mapping) -> Mapping:
    """`config` with transformers 5's ``rope_parameters`` (``rope_theta``, ``rope_type`` and the
    scaling's fields in one table) also spelled as the older top-level ``rope_theta`` and
    ``rope_scaling`` (None for ``rope_type`` "default": no scaling) that we write and compare."""
    params = config.get("rope_parameters")
    if not isinstance(params, Mapping):
        return config
    spelled = dict(config)
    if "rope_theta" in params:
        spelled.setdefault("rope_theta", params["rope_theta"])
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    spelled.setdefault("rope_scaling", None if params.get("rope_type", "default") == "default" else scaling)
    return spelled


def with_trained_seq_len(args, seq_len: int | None):
    """`args` (a flavor's, whose `max_seq_len` is its published context) for exporting weights
    trained at `seq_len`: the RoPE table is the longer of the two. config.json's
    `max_position_embeddings` then keeps the published context unless training went past it,
    and DeepSeek's YaRN, which the run applied past 4096 positions, is exported exactly when it
    applied (`rope_scaling`, with the context it extends to); None keeps the flavor's context."""
    if seq_len is None or seq_len <= args.max_seq_len:
        return args
    return replace(args, max_seq_len=seq_len)


def config_differences_from_folder(adapter: StateDictAdapter, folder: str | Path) -> list[str]:
    """`hf_config_differences` between `adapter`'s config.json and the one in the HF checkpoint
    `folder`; none when the folder has no config.json or the model has no HF config."""
    theirs = read_hf_config(folder)
    if not theirs:
        return []
    try:
        ours = adapter.hf_config()
    except HFConfigError:
        return []
    return hf_config_differences(ours, theirs)
