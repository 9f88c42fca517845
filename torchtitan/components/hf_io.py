"""Hugging Face checkpoint folders: sharded safetensors, their index, and config.json.

The files are the ones transformers' ``save_pretrained`` writes and ``from_pretrained`` reads:
``model-0000k-of-0000n.safetensors`` shards, ``model.safetensors.index.json`` mapping every key
to its shard, and ``config.json``.

Reading also understands the block-scaled float8 weights that DeepSeek-V3's published
checkpoints (and Qwen3's -FP8 releases) store: each such ``X.weight`` is float8 e4m3 beside an
``X.weight_scale_inv`` (float32, or bfloat16 in some releases) holding one multiplier per block
of the weight (128 x 128 unless config.json's ``quantization_config.weight_block_size`` says
otherwise); `dequantize_fp8` turns them back into float32 weights.
"""

import contextlib
import json
import math
import re
import shutil
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from torchtitan.protocols.state_dict_adapter import HF_CONFIG_FILE, read_hf_config

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = HF_CONFIG_FILE
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
FP8_SCALE_SUFFIX = "_scale_inv"
DEFAULT_FP8_BLOCK = (128, 128)
_FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# safetensors' header names of dtypes; a dtype missing here reads as float32 in `meta_tensors`.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


class HFQuantizationError(ValueError):
    """A quantized HF checkpoint this reader cannot turn back into full-precision weights."""


def save_hf(
    state_dict: Mapping[str, torch.Tensor],
    config: dict,
    folder: str | Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write `state_dict` as safetensors shards plus their index, and `config` as config.json.

    Args:
        state_dict: HF keys -> tensors (any device; written as they are, dtype included).
        config: the config.json content (e.g. `StateDictAdapter.hf_config()`).
        folder: created if missing; files of the same names are overwritten.
        max_shard_bytes: a shard ends before the tensor that would take it past this size; a
            tensor larger than that gets a shard of its own.

    Tensors are copied to the CPU, made contiguous, and cloned where they share storage
    (views such as one expert of a stacked tensor), which safetensors refuses; one shard's
    copies are held at a time.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    shards = _plan_shards(state_dict, max_shard_bytes)
    weight_map = {}
    for number, keys in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(_unshared({key: state_dict[key] for key in keys}), folder / name, metadata={"format": "pt"})
        # safetensors writes through a private temporary file, so a shard came out 0600 where
        # config.json gets the umask's permissions: others sharing the folder could not read it.
        shutil.copymode(folder / CONFIG_FILE, folder / name)
        weight_map.update(dict.fromkeys(keys, name))
    total_size = sum(_nbytes(tensor) for tensor in state_dict.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def load_hf(folder: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of an HF checkpoint folder, on the CPU: the shards its
    model.safetensors.index.json lists, else its single model.safetensors.

    Raises:
        FileNotFoundError: no such folder, neither file in it, an index that is not one, or a
            shard the index names is missing, unreadable (truncated), or lacks a key the index
            assigns to it.
    """
    layout = read_hf_layout(folder)
    return load_hf_tensors(layout, list(layout))


def read_hf_layout(folder: str | Path) -> dict[str, Path]:
    """Every tensor key of an HF checkpoint folder -> the safetensors file that holds it, read
    from the index and the files' headers only (no tensor data).

    Raises:
        FileNotFoundError: as `load_hf`.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"Hugging Face checkpoint folder '{folder}' does not exist")
    if (folder / INDEX_FILE).is_file():
        layout = {key: folder / shard for key, shard in _read_weight_map(folder / INDEX_FILE).items()}
    elif (folder / SINGLE_FILE).is_file():
        with _open_safetensors(folder / SINGLE_FILE) as f:
            return dict.fromkeys(f.keys(), folder / SINGLE_FILE)
    else:
        raise FileNotFoundError(f"'{folder}' holds neither {INDEX_FILE} nor {SINGLE_FILE}")
    for shard in dict.fromkeys(layout.values()):
        if not shard.is_file():
            raise FileNotFoundError(f"shard '{shard.name}', listed in {folder / INDEX_FILE}, is missing")
        with _open_safetensors(shard) as f:
            present = set(f.keys())
        if missing := [key for key, file in layout.items() if file == shard and key not in present]:
            raise FileNotFoundError(f"keys of {folder / INDEX_FILE} missing from their shards: {missing[:5]}")
    return layout


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        raise FileNotFoundError(f"'{index}' is not a safetensors index ({error}); re-download it") from None
    if not isinstance(weight_map, dict):
        raise FileNotFoundError(f"'{index}' has no 'weight_map' of tensor names to files; re-download it")
    return weight_map


@contextlib.contextmanager
def _open_safetensors(path: Path):
    """`safe_open(path)`, a truncated or corrupt file reported as such (also when a tensor is
    read), not as safetensors' bare error."""
    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except SafetensorError as error:
        raise FileNotFoundError(
            f"'{path}' is not a readable safetensors file ({error}); re-download or re-save it"
        ) from None


def meta_tensors(layout: Mapping[str, Path]) -> dict[str, torch.Tensor]:
    """Meta tensors with the shapes and dtypes of `layout`'s tensors, to check a conversion
    without data."""
    headers = {}
    for file, keys in _keys_by_file(layout, list(layout)).items():
        with _open_safetensors(file) as f:
            for key in keys:
                header = f.get_slice(key)
                headers[key] = header.get_shape(), header.get_dtype()
    return {
        key: torch.empty(shape, dtype=_SAFETENSORS_DTYPES.get(dtype, torch.float32), device="meta")
        for key, (shape, dtype) in headers.items()
    }


def load_hf_tensors(layout: Mapping[str, Path], keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors `keys` of `layout`, on the CPU, reading nothing else."""
    loaded = {}
    for file, file_keys in _keys_by_file(layout, keys).items():
        with _open_safetensors(file) as f:
            loaded.update({key: f.get_tensor(key) for key in file_keys})
    return {key: loaded[key] for key in keys}


def fp8_block_size(folder: str | Path) -> tuple[int, int]:
    """The block, (rows, columns), that one ``weight_scale_inv`` entry scales in the HF
    checkpoint `folder`: config.json's ``quantization_config.weight_block_size``, else
    `DEFAULT_FP8_BLOCK` (also for a checkpoint without config.json or without quantization).

    Raises:
        HFQuantizationError: config.json names another quantization method than block-scaled
            fp8 (``quant_method`` "fp8"), or a block that is not two positive integers.
        ConfigError: config.json is not a readable JSON object.
    """
    config_file = Path(folder) / CONFIG_FILE
    quantization = read_hf_config(folder).get("quantization_config")
    if quantization is None:
        return DEFAULT_FP8_BLOCK
    method = quantization.get("quant_method")
    if method != "fp8":
        raise HFQuantizationError(
            f"{config_file}: quantization_config.quant_method = {method!r} is not supported; only "
            "block-scaled fp8 weights (quant_method 'fp8', DeepSeek-V3's format) are dequantized on "
            "load. Convert the checkpoint to bf16 or fp32 safetensors first."
        )
    block = quantization.get("weight_block_size", list(DEFAULT_FP8_BLOCK))
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise HFQuantizationError(
            f"{config_file}: quantization_config.weight_block_size = {block!r} is not two positive "
            "integers (rows, columns per scale); DeepSeek-V3's is [128, 128]."
        )
    return block[0], block[1]


def dequantize_fp8(tensors: Mapping[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """`tensors` with each weight that has a ``<key>_scale_inv`` beside it replaced by its float32
    value (each `block` of the weight times its scale), and the scale keys dropped; every other
    tensor is passed through as it is. Works on meta tensors (shapes only).

    Pass whole groups of keys (one decoder layer, say): a weight and its scale must come together.

    Raises:
        HFQuantizationError: a scale without its weight, a float8 tensor without its scale, a
            scale beside a weight that is not float8, or a scale whose shape is not the weight's
            in blocks of `block` (naming the key).
    """
    plain = {}
    for key, tensor in tensors.items():
        if key.endswith(FP8_SCALE_SUFFIX):
            if (weight_key := key.removesuffix(FP8_SCALE_SUFFIX)) not in tensors:
                raise HFQuantizationError(f"'{key}' scales '{weight_key}', which is not there")
            continue
        scale = tensors.get(key + FP8_SCALE_SUFFIX)
        if scale is not None and tensor.dtype not in _FLOAT8_DTYPES:
            raise HFQuantizationError(
                f"'{key}' is {tensor.dtype}, not float8, yet has a '{key}{FP8_SCALE_SUFFIX}'"
            )
        if scale is not None:
            tensor = _dequantized(key, tensor, scale, block)
        elif tensor.dtype in _FLOAT8_DTYPES:
            raise HFQuantizationError(
                f"'{key}' is {tensor.dtype} without a '{key}{FP8_SCALE_SUFFIX}' to scale it; only "
                "block-scaled fp8 weights can be loaded"
            )
        plain[key] = tensor
    return plain


def _dequantized(key: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, columns = weight.shape if weight.dim() == 2 else (None, None)
    want = (math.ceil(rows / block[0]), math.ceil(columns / block[1])) if rows else None
    if want is None or tuple(scale.shape) != want:
        raise HFQuantizationError(
            f"'{key}{FP8_SCALE_SUFFIX}' has shape {tuple(scale.shape)}, but '{key}' {tuple(weight.shape)} "
            f"in blocks of {block[0]} x {block[1]} needs {want or 'a 2-D weight'}; is "
            "quantization_config.weight_block_size in config.json right?"
        )
    # Each block scaled in place through a (block row, row, block column, column) view: the
    # result is the only full-size float32 tensor, unless the shape needs padding to whole blocks.
    padded_rows, padded_columns = want[0] * block[0], want[1] * block[1]
    value = weight.float()
    if (padded_rows, padded_columns) != (rows, columns):
        value = F.pad(value, (0, padded_columns - columns, 0, padded_rows - rows))
    value.view(want[0], block[0], want[1], block[1]).mul_(scale.float()[:, None, :, None])
    return value if value.shape == weight.shape else value[:rows, :columns].contiguous()


def keys_by_layer(keys) -> list[list[str]]:
    """`keys` grouped by their `layers.N` index (first the keys outside any layer), so that a
    checkpoint can be loaded one decoder layer at a time."""
    groups: dict[int, list[str]] = defaultdict(list)
    for key in keys:
        layer = re.search(r"(?:^|\.)layers\.(\d+)\.", key)
        groups[int(layer.group(1)) if layer else -1].append(key)
    return [groups[layer] for layer in sorted(groups)]


def _keys_by_file(layout: Mapping[str, Path], keys: list[str]) -> dict[Path, list[str]]:
    by_file: dict[Path, list[str]] = defaultdict(list)
    for key in keys:
        by_file[layout[key]].append(key)
    return by_file


def _plan_shards(state_dict: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Keys grouped into shards in state-dict order, each at most `max_shard_bytes` unless
    a single tensor is larger."""
    shards, size = [[]], 0
    for key, tensor in state_dict.items():
        if shards[-1] and size + _nbytes(tensor) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += _nbytes(tensor)
    return shards


def _unshared(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors, each the sole owner of its storage."""
    owned, seen_storages = {}, set()
    for key, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen_storages or storage.nbytes() != _nbytes(tensor):
            tensor = tensor.clone()
        seen_storages.add(tensor.untyped_storage().data_ptr())
        owned[key] = tensor
    return owned


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
