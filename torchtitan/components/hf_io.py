"""Hugging Face checkpoint folders: sharded safetensors, their index, and config.json.

The files are the ones transformers' ``save_pretrained`` writes and ``from_pretrained`` reads:
``model-0000k-of-0000n.safetensors`` shards, ``model.safetensors.index.json`` mapping every key
to its shard, and ``config.json``.
"""

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

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
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"Hugging Face checkpoint folder '{folder}' does not exist")
    if (folder / INDEX_FILE).is_file():
        return _load_sharded(folder)
    if (folder / SINGLE_FILE).is_file():
        return load_file(folder / SINGLE_FILE)
    raise FileNotFoundError(f"'{folder}' holds neither {INDEX_FILE} nor {SINGLE_FILE}")


def _load_sharded(folder: Path) -> dict[str, torch.Tensor]:
    weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    loaded = {}
    for shard in dict.fromkeys(weight_map.values()):
        if not (folder / shard).is_file():
            raise FileNotFoundError(f"shard '{shard}', listed in {folder / INDEX_FILE}, is missing")
        loaded.update(load_file(folder / shard))
    if missing := [key for key in weight_map if key not in loaded]:
        raise FileNotFoundError(f"keys of {folder / INDEX_FILE} missing from their shards: {missing[:5]}")
    return {key: loaded[key] for key in weight_map}


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
