"""`checkpoint.initial_load_in_hf`: a Hugging Face checkpoint into the (parallelized) model.

The files are read by `hf_io` and converted by the model's `StateDictAdapter`; this module checks
the whole conversion on the files' headers before any weight loads, then loads one decoder layer
at a time.
"""

import logging
import re
from pathlib import Path

import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from torchtitan.components.checkpoint_folders import is_dcp
from torchtitan.components.hf_io import (
    CONFIG_FILE,
    FP8_SCALE_SUFFIX,
    HFQuantizationError,
    dequantize_fp8,
    fp8_block_size,
    keys_by_layer,
    load_hf_tensors,
    meta_tensors,
    read_hf_layout,
)
from torchtitan.config.errors import ConfigError
from torchtitan.distributed.expert_parallel import expert_parallel_params
from torchtitan.protocols.state_dict_adapter import (
    StateDictMismatchError,
    config_differences_from_folder,
    describe_mismatch,
)

logger = logging.getLogger(__name__)

KEY = "checkpoint.initial_load_path"
_FIX = "Set model.name and model.flavor to the checkpoint's, or load another checkpoint."


def load_hf_checkpoint(
    model: nn.Module, adapter, path: Path, model_label: str, whole_model_shapes=None
) -> None:
    """Load the HF checkpoint in `path` into `model`, one decoder layer at a time.

    Each rank reads whole the tensors it needs (keeping its own shards of them); under expert
    parallelism that is only its own experts' tensors. A layer at a time bounds each rank's host
    memory by one layer rather than the whole model (140 GB for a 70B model in bf16, per rank).
    Block-scaled fp8 weights (the published DeepSeek-V3's) are dequantized to float32 as they
    are read.

    Args:
        model: the parallelized model (FSDP/TP DTensors and expert-parallel slices are filled).
        adapter: the model's `StateDictAdapter`.
        path: the folder of safetensors and config.json.
        model_label: "<model.name> <model.flavor>", for the errors.
        whole_model_shapes: {key: shape} of the whole model when `model` is a part of it (this
            rank's pipeline stages): the checkpoint is checked against the whole model, and
            only the layers this rank holds are read.

    Raises:
        ConfigError: see `check_hf_checkpoint`, or the checkpoint stores an output projection of
            its own (untied) for a flavor that ties it to the embedding; nothing has been
            loaded then.
    """
    ep_params = expert_parallel_params(model)
    layout, block = check_hf_checkpoint(model, adapter, path, model_label, whole_model_shapes)
    own = set(get_model_state_dict(model))
    if scaled := sum(key.endswith(FP8_SCALE_SUFFIX) for key in layout):
        logger.info(f"Dequantizing {scaled} fp8 weights ({block[0]} x {block[1]} blocks) to float32")
    experts = _owned_experts(ep_params)
    if experts is not None:
        total = next(iter(ep_params.values()))._ep_full_shape[0]
        logger.info(f"Reading only this rank's {len(experts)} of {total} experts per MoE layer")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    for keys in keys_by_layer(layout):
        if not _holds_layer(own, keys):
            continue
        try:
            state = _read_layer(adapter, layout, keys, block, experts)
        except StateDictMismatchError as error:
            # What only the values show: an untied lm_head for a tied flavor. It is read with
            # the embedding, in the first group, before any weight has loaded.
            raise ConfigError(f"{_not_this_model(path, model_label)}: {error}. {_FIX}") from None
        state = {k: v for k, v in state.items() if k in own}
        if state:
            set_model_state_dict(model, state, options=options)


def _holds_layer(own: set[str], hf_keys: list[str]) -> bool:
    """Whether this rank holds the decoder layer of `hf_keys` (one group of `keys_by_layer`);
    the group outside any layer (embedding, final norm, head) is always read."""
    layer = re.search(r"(?:^|\.)layers\.(\d+)\.", hf_keys[0])
    return layer is None or any(key.startswith(f"layers.{layer.group(1)}.") for key in own)


def check_hf_checkpoint(
    model: nn.Module, adapter, path: Path, model_label: str, whole_model_shapes=None
) -> tuple[dict[str, Path], tuple[int, int]]:
    """The layout of the HF checkpoint in `path` (without the tensors the adapter ignores, such
    as DeepSeek-V3's multi-token-prediction layer, which are then never read) and its fp8 block
    size, once the conversion has been checked on the files' headers.

    Raises:
        ConfigError: the checkpoint lacks a tensor of this model or holds one of another shape
            (loading it would silently keep those tensors' random initialization), or holds
            quantized weights that cannot be dequantized.
    """
    not_this_model = _not_this_model(path, model_label)
    try:
        layout = read_hf_layout(path)
        layout = {key: file for key, file in layout.items() if not adapter.ignores_hf_key(key)}
        block = fp8_block_size(path)
        converted = adapter.from_hf(dequantize_fp8(meta_tensors(layout), block))
    except (StateDictMismatchError, FileNotFoundError) as error:
        if is_dcp(path):
            raise ConfigError(
                f"'{KEY}' = '{path}' is a DCP checkpoint, not Hugging Face safetensors; set "
                "checkpoint.initial_load_in_hf = false."
            ) from None
        raise ConfigError(f"{not_this_model}: {error}. {_FIX}") from None
    except HFQuantizationError as error:
        raise ConfigError(f"'{KEY}' = '{path}': {error}") from None
    converted = _own_experts(converted, expert_parallel_params(model))
    # A pipeline stage's own keys with its own (expert-parallel) shapes, the others' whole.
    expected = {**(whole_model_shapes or {}), **{k: v.shape for k, v in get_model_state_dict(model).items()}}
    if mismatch := describe_mismatch(expected, {k: v.shape for k, v in converted.items()}):
        raise ConfigError(f"{not_this_model}: {mismatch}. {_FIX}")
    _warn_on_config_differences(adapter, path)
    return layout, block


def _not_this_model(path: Path, model_label: str) -> str:
    return f"'{KEY}' = '{path}' is not a {model_label} checkpoint"


def _read_layer(adapter, layout: dict, keys: list[str], fp8_block: tuple, experts: range | None) -> dict:
    """Our state dict from the HF `keys` of one layer; with `experts`, of those experts only
    (an fp8 weight's scale is read where its weight is)."""
    renamed = dict(zip(keys, keys))
    if experts is not None:
        weights = adapter.experts_to_read([k for k in keys if not k.endswith(FP8_SCALE_SUFFIX)], experts)
        scales = {k + FP8_SCALE_SUFFIX: v + FP8_SCALE_SUFFIX for k, v in weights.items()}
        renamed = {**weights, **{k: v for k, v in scales.items() if k in renamed}}
    tensors = load_hf_tensors(layout, list(renamed))
    return adapter.from_hf(dequantize_fp8({renamed[k]: t for k, t in tensors.items()}, fp8_block))


def _warn_on_config_differences(adapter, path: Path) -> None:
    """Warn when the checkpoint's config.json sets RoPE, norm, activation or routing constants
    other than this run's: no shape shows it, and the weights then compute something else (e.g.
    the published DeepSeek-V3's YaRN scaling, which a run of training.seq_len <= 4096 does not
    apply)."""
    if differences := config_differences_from_folder(adapter, path):
        logger.warning(
            f"{path / CONFIG_FILE} differs from this run's model in what no tensor shape shows: "
            f"{'; '.join(differences)}. The weights load, but compute differently than in "
            "Hugging Face; choose the matching model.flavor if one exists."
        )


def _owned_experts(ep_params: dict) -> range | None:
    """The experts this rank holds of each MoE layer under expert parallelism, else None."""
    slices = {(p._ep_slice.start, p._ep_slice.stop) for p in ep_params.values()}
    return range(*slices.pop()) if len(slices) == 1 else None


def _own_experts(state: dict, ep_params: dict) -> dict:
    """`state` with each expert-parallel weight cut to this rank's experts."""
    for fqn, param in ep_params.items():
        if fqn in state:
            state[fqn] = state[fqn][param._ep_slice]
    return state
