"""Hugging Face checkpoint folders: sharded safetensors, their index, and config.json.

The files are the ones transformers' ``save_pretrained`` writes and ``from_pretrained`` reads:
``model-0000k-of-0000n.safetensors`` shards, ``model.safetensors.index.json`` mapping every key
to its shard, and ``config.json``.
"""

import json
import re
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


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
    shards = _plan_shards(state_dict, max_shard_bytes)
    weight_map = {}
    for number, keys in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(_unshared({key: state_dict[key] for key in keys}), folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    total_size = sum(_nbytes(tensor) for tensor in state_dict.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_hf(folder: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of an HF checkpoint folder, on the CPU: the shards its
    model.safetensors.index.json lists, else its single model.safetensors.

    Raises:
        FileNotFoundError: no such folder, neither file in it, or a shard the index names is
            missing or lacks a key the index assigns to it.
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
        weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        layout = {key: folder / shard for key, shard in weight_map.items()}
    elif (folder / SINGLE_FILE).is_file():
        with safe_open(folder / SINGLE_FILE, framework="pt") as f:
            return dict.fromkeys(f.keys(), folder / SINGLE_FILE)
    else:
        raise FileNotFoundError(f"'{folder}' holds neither {INDEX_FILE} nor {SINGLE_FILE}")
    for shard in dict.fromkeys(layout.values()):
        if not shard.is_file():
            raise FileNotFoundError(f"shard '{shard.name}', listed in {folder / INDEX_FILE}, is missing")
        with safe_open(shard, framework="pt") as f:
            present = set(f.keys())
        if missing := [key for key, file in layout.items() if file == shard and key not in present]:
            raise FileNotFoundError(f"keys of {folder / INDEX_FILE} missing from their shards: {missing[:5]}")
    return layout


def meta_tensors(layout: Mapping[str, Path]) -> dict[str, torch.Tensor]:
    """Meta tensors with the shapes of `layout`'s tensors, to check a conversion without data."""
    shapes = {}
    for file, keys in _keys_by_file(layout, list(layout)).items():
        with safe_open(file, framework="pt") as f:
            shapes.update({key: f.get_slice(key).get_shape() for key in keys})
    return {key: torch.empty(shapes[key], device="meta") for key in layout}


def load_hf_tensors(layout: Mapping[str, Path], keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors `keys` of `layout`, on the CPU, reading nothing else."""
    loaded = {}
    for file, file_keys in _keys_by_file(layout, keys).items():
        with safe_open(file, framework="pt") as f:
            loaded.update({key: f.get_tensor(key) for key in file_keys})
    return {key: loaded[key] for key in keys}


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
