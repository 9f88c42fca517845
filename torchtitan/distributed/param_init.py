"""Parameter initialization that gives the same weights in every parallel layout."""

import contextlib

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


@torch.no_grad()
def init_param_(param: torch.Tensor, fill_) -> None:
    """Initialize `param` in place with `fill_`, identically for every parallel layout.

    `fill_(tensor)` draws from the global RNG. For a DTensor the full parameter is drawn on
    every rank and each keeps its own shard, so a seeded 1-process run and an N-process run
    start from the same weights. Likewise for an expert-parallel slice (`_ep_local`, see
    `expert_parallel.shard_experts_`): the full tensor is drawn and its `_ep_slice` kept.
    Pitfall: this briefly holds one full parameter per rank.
    """
    ep_local = getattr(param, "_ep_local", False)
    if not ep_local and not isinstance(param, DTensor):
        fill_(param)
        return
    local = param.to_local() if isinstance(param, DTensor) else param
    shape = param._ep_full_shape if ep_local else param.shape
    full = torch.empty(shape, dtype=param.dtype, device=local.device)
    fill_(full)
    if ep_local:
        full = full[param._ep_slice]
    if isinstance(param, DTensor):
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    local.copy_(full)


@contextlib.contextmanager
def part_rng(index: int, device: torch.device):
    """Draw from a stream of its own: the global RNG reseeded with the run's seed + `index`,
    then restored on exit.

    Models initialize each part (embedding, block, head) under its own index, so that a part's
    weights do not depend on which other parts a process holds: a pipeline stage, holding a
    few blocks, draws what the whole model draws for them.

    Args:
        index: the part's number, fixed by the model (e.g. 1 + block index).
        device: where the parameters are drawn (its generator is forked with the CPU's).
    """
    if device.type == "cpu":
        devices = []  # the CPU generator is always forked
    else:
        devices = [torch.get_device_module(device).current_device() if device.index is None else device.index]
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.manual_seed(torch.initial_seed() + index)
        yield
