"""The Hugging Face export written by every rank (`checkpoint.last_save_in_hf`).

Each rank hands its own shards of the model, in Hugging Face keys and layouts, to
`torch.distributed.checkpoint`'s `HuggingFaceStorageWriter`, which writes them as safetensors
into `<export>.partial/sharded`; then every rank consolidates some of the output files
(`consolidate_safetensors_files_on_every_rank`) into Hugging Face's layout and index. Rank 0
writes config.json, removes the shards and renames the folder into place, as every save here
is published. No rank holds more than its own shards, plus the whole tensors it was given to
write where a layout cannot be converted shard by shard.

Per tensor (`StateDictAdapter.hf_layout_change`):
- renamed only: the shards are written as they are.
- RoPE rows permuted per head: each rank permutes its own rows, when its rows are whole heads
  (a plain `Shard(0)` whose boundaries fall between heads); else the tensor is gathered, and
  one rank of its mesh writes it.
- stacked experts, one HF tensor each: a rank whose rows are whole experts (sharded along the
  experts only) writes those experts; else gathered, one rank writes.
"""

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files,
    consolidate_safetensors_files_on_every_rank,
)
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchtitan.components.checkpoint_folders import PARTIAL_SUFFIX, replace_folder
from torchtitan.components.hf_io import CONFIG_FILE
from torchtitan.distributed.expert_parallel import expert_parallel_params, global_expert_view
from torchtitan.protocols.state_dict_adapter import split_indices
from torchtitan.tools.dtypes import TORCH_DTYPES
from torchtitan.tools.fqn import clean_fqn

SHARDED = "sharded"


def write_hf_export_from_all_ranks(
    folder: Path, model: nn.Module, adapter, export_dtype: str, whole_model_shapes=None, process_group=None
) -> list[Path]:
    """Write `model` as a Hugging Face checkpoint in `folder`, from every rank. Collective.

    Args:
        folder: the export's final path; written as `folder.partial` and renamed.
        model: the parallelized model (FSDP/TP DTensors, expert-parallel slices), or this rank's
            pipeline stages.
        adapter: the model's `StateDictAdapter`.
        export_dtype: floating parameters are written in it; buffers keep their dtype.
        whole_model_shapes: {key: shape} of the whole model when `model` is a part of it.
        process_group: the group of the writes' coordination and barriers (every rank's), whose
            timeout allows for the slowest rank's file work; None for the default group.

    Returns:
        On rank 0, the replaced folders for the caller to delete; elsewhere, [].
    """
    partial = folder.with_name(folder.name + PARTIAL_SUFFIX)
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    _barrier(distributed, process_group)
    state = hf_shards(model, adapter, export_dtype)
    shapes = whole_model_shapes or {key: value.shape for key, value in _whole_views(model).items()}
    files = file_of_each_key(adapter, shapes)
    write_hf_tensors_from_all_ranks(partial, state, files, process_group)
    del state
    replaced = []
    if rank == 0:
        config = adapter.hf_config(TORCH_DTYPES[export_dtype])
        (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        replaced = replace_folder(folder, partial)
    _barrier(distributed, process_group)
    return replaced


def write_hf_tensors_from_all_ranks(folder: Path, state: dict, files: dict[str, int], process_group=None):
    """Write HF-keyed `state` (this rank's part: DTensors of its shards, plain tensors it writes)
    into `folder` as consolidated safetensors and their index. Collective.

    `files`: the output file of every key of the whole state (`file_of_each_key`). The shards
    go to `folder/sharded` first, through DCP's `HuggingFaceStorageWriter`; each rank then
    consolidates its turn of the output files, and `sharded` is removed.
    """
    distributed = dist.is_initialized()
    sharded = str(folder / SHARDED)
    writer = HuggingFaceStorageWriter(sharded, fqn_to_index_mapping=files, save_distributed=True)
    dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=not distributed)
    # Each rank writes the output files of its indices; one process writes the index too.
    if distributed:
        consolidate_safetensors_files_on_every_rank(sharded, str(folder), files, process_group=process_group)
    else:
        consolidate_safetensors_files(sharded, str(folder), files)
    if not distributed or dist.get_rank() == 0:
        shutil.rmtree(sharded)
    _barrier(distributed, process_group)


def _barrier(distributed: bool, group) -> None:
    if distributed:
        dist.barrier(group=group)


def hf_shards(model: nn.Module, adapter, export_dtype: str) -> dict[str, torch.Tensor]:
    """This rank's part of the Hugging Face state dict: DTensors of this rank's shards, plain
    tensors this rank alone (or every replica of it) writes. Collective where a tensor must be
    gathered: every rank of its mesh calls it, for the same keys in the same order."""
    dtype = TORCH_DTYPES[export_dtype]
    buffers = {clean_fqn(name) for name, _ in model.named_buffers()}
    state, gathered = {}, 0
    for key, value in _whole_views(model).items():
        if value.is_floating_point() and key not in buffers:
            value = value.to(dtype)
        change = adapter.hf_layout_change(key)
        if not isinstance(value, DTensor):
            state.update(adapter.to_hf({key: value}))
        elif change == "renamed":
            state.update({hf_key: value for hf_key in adapter.to_hf({key: _meta_like(value)})})
        elif (rows := _whole_rows(value, adapter, change)) is not None:
            state.update(_converted_rows(key, value, rows, adapter, change))
        else:
            whole = value.full_tensor()
            ranks = value.device_mesh.mesh.flatten().tolist()
            if ranks[gathered % len(ranks)] == (dist.get_rank() if dist.is_initialized() else 0):
                state.update(adapter.to_hf({key: whole}))
            gathered += 1
    return state


def _meta_like(value: torch.Tensor) -> torch.Tensor:
    return torch.empty(value.shape, dtype=value.dtype, device="meta")


def _whole_rows(value: DTensor, adapter, change: str) -> tuple[int, int] | None:
    """(first row, row count) of this rank's shard when it holds whole rows (only dim 0 is
    sharded, by plain `Shard(0)`) and those rows are whole units of the layout change (heads for
    RoPE, experts for stacked experts); else None."""
    if not all(type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in value.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    unit = adapter.rope_head_dim if change == "rope" else 1
    if offset[0] % unit or shape[0] % unit:
        return None
    return offset[0], shape[0]


def _converted_rows(key: str, value: DTensor, rows: tuple[int, int], adapter, change: str) -> dict:
    """This rank's rows of `key` in HF layout: a DTensor of the permuted rows (RoPE), or one
    plain tensor per whole expert (stacked), numbered globally."""
    local = value.to_local()
    if change == "rope":
        ((hf_key, permuted),) = adapter.to_hf({key: local}).items()
        return {hf_key: DTensor.from_local(permuted, value.device_mesh, value.placements, run_check=False,
                                           shape=value.shape, stride=value.stride())}  # fmt: skip
    first, _ = rows
    pieces = {}
    for hf_key, piece in adapter.to_hf({key: local}).items():
        template, indices = split_indices(hf_key)
        pieces[template.format(*indices[:-1], indices[-1] + first)] = piece
    return pieces


def file_of_each_key(adapter, shapes: dict[str, torch.Size]) -> dict[str, int]:
    """The output file (numbered from 1) of every HF key: one per group of `layer_groups`. The
    same on every rank: it is computed from the whole model's shapes.

    Why so many files: torch's writer and consolidation hold one file's bytes in memory at a
    time, and the ranks consolidate the files in turns (file i on rank i mod world)."""
    hf = adapter.to_hf({key: torch.empty(shape, device="meta") for key, shape in shapes.items()})
    return {key: group + 1 for key, group in layer_groups(hf).items()}


def layer_groups(keys) -> dict[str, int]:
    """A group number for each state-dict key (ours or HF's): one group per key outside the
    layers (the embedding and the output projection are the largest tensors), then one per
    layer, numbered from 0 in that order."""
    outside = sorted(key for key in keys if not split_indices(key)[1])
    layers = sorted({indices[0] for key in keys if (indices := split_indices(key)[1])})
    group = {key: i for i, key in enumerate(outside)}
    group |= {layer: len(outside) + i for i, layer in enumerate(layers)}
    return {key: group[indices[0]] if (indices := split_indices(key)[1]) else group[key] for key in keys}


def _whole_views(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict with each expert-parallel slice as a view of the whole experts
    (`global_expert_view`), so that every value has the whole tensor's shape."""
    ep_params = expert_parallel_params(model)
    return {
        key: global_expert_view(value, ep_params[key]) if key in ep_params else value
        for key, value in get_model_state_dict(model).items()
    }
