"""The final save as Hugging Face safetensors (`checkpoint.last_save_in_hf`): checked at
startup (`check_exportable`), in the export dtype (`in_export_dtype`). Every rank writes its
part (`hf_distributed_export`). `whole_model_state` and `write_hf_export`, which gather the
model on rank 0 and write it there, are the earlier path: the tests and
`benchmarks/hf_export.py` compare the export with theirs."""

import logging
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from torchtitan.components.checkpoint_folders import PARTIAL_SUFFIX, replace_folder
from torchtitan.components.hf_io import save_hf
from torchtitan.config.errors import ConfigError
from torchtitan.distributed.expert_parallel import expert_parallel_params, full_expert_tensor
from torchtitan.protocols.state_dict_adapter import HFConfigError
from torchtitan.tools.dtypes import TORCH_DTYPES
from torchtitan.tools.fqn import clean_fqn

logger = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def check_exportable(hf_adapter, model: nn.Module) -> None:
    """Refuse at startup, not after the last step, a run whose final export would fail, and warn
    about state the export would leave out (an expert bias HF has no place for).

    Raises:
        ConfigError: when `hf_adapter` cannot write a config for this model.
    """
    try:
        hf_adapter.hf_config()
    except HFConfigError as error:
        raise ConfigError(
            f"'checkpoint.last_save_in_hf' = true, but this model cannot be exported: {error} "
            "Set it to false (the final checkpoint is then DCP)."
        ) from None
    if dropped := hf_adapter.left_out_of_hf([clean_fqn(k) for k in model.state_dict()]):
        logger.warning(
            f"'checkpoint.last_save_in_hf' = true: the Hugging Face export leaves out {dropped[0]} "
            f"and {len(dropped) - 1} more like it, which that architecture has no place for. Once "
            "training changes them (the expert bias of load balancing does), the export computes "
            "differently from this run's model; its DCP checkpoints keep them."
        )


def in_export_dtype(state: dict, model: nn.Module, export_dtype: str) -> dict:
    """`state` with floating parameters in `export_dtype`; buffers (e.g. the fp32 expert bias,
    whose rounding would move routing) keep theirs."""
    dtype = TORCH_DTYPES[export_dtype]
    buffers = {clean_fqn(name) for name, _ in model.named_buffers()}
    return {k: v.to(dtype) if v.is_floating_point() and k not in buffers else v for k, v in state.items()}


def whole_model_state(model: nn.Module, export_dtype: str, pp_group=None) -> dict:
    """The model's state as whole tensors in `export_dtype` (`in_export_dtype`) on the CPU of
    rank 0; other ranks get an empty dict. Collective: every rank calls it.

    Gathered one tensor at a time (FSDP and TP shards, expert-parallel slices), so a rank holds
    at most one whole tensor on the device. Under pipeline parallelism (`pp_group`) each stage's
    first rank gathers its stage, and rank 0 collects the stages over the pipeline.
    """
    leads = pp_group is not None and dist.get_global_rank(pp_group, 0) == 0
    keep = leads or (pp_group is None and _rank() == 0)
    ep_params = expert_parallel_params(model)
    state = {}
    for fqn, value in get_model_state_dict(model).items():
        if fqn in ep_params:
            whole = full_expert_tensor(value, ep_params[fqn])
        else:
            whole = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            state[fqn] = whole.detach().cpu()
        del whole
    # Here, where this stage's buffers are known (they keep their dtype).
    state = in_export_dtype(state, model, export_dtype)
    if pp_group is None:
        return state
    # Every pipeline group gathers (to its first rank), so that the collective matches; only
    # rank 0's gathered anything.
    first = dist.get_rank(pp_group) == 0
    stages = [{} for _ in range(dist.get_world_size(pp_group))] if first else None
    dist.gather_object(state, stages, dst=dist.get_global_rank(pp_group, 0), group=pp_group)
    return {k: v for stage in stages for k, v in stage.items()} if _rank() == 0 else {}


def write_hf_export(folder: Path, whole: dict, hf_adapter, export_dtype: str) -> list[Path]:
    """Rank 0: write `whole` (see `whole_model_state`) as safetensors plus config.json into
    `folder`. Written aside and renamed, like the DCP saves: a crash leaves no half export, and
    an older export of another shard count no stale shards. Returns the replaced folders, for
    the caller to delete."""
    partial = folder.with_name(folder.name + PARTIAL_SUFFIX)
    shutil.rmtree(partial, ignore_errors=True)
    config = hf_adapter.hf_config(TORCH_DTYPES[export_dtype])
    save_hf(hf_adapter.to_hf(whole), config, partial)
    return replace_folder(folder, partial)
