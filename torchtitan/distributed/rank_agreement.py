"""What the ranks agree on: means and maxima of a number, and a config error any rank raised."""

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from torchtitan.config.errors import ConfigError

T = TypeVar("T")


def all_reduce_mean(value: float, device: torch.device) -> float:
    """Mean of a Python float over all ranks (itself when not distributed)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def mean_and_max_over_ranks(value: float, device: torch.device) -> tuple[float, float]:
    """Mean and largest of a Python float over all ranks, from one all-gather."""
    if not dist.is_initialized():
        return value, value
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)  # the list form: torch 2.13 deprecates all_gather_into_tensor
    values = torch.cat(every)
    return values.mean().item(), values.max().item()


def agree_on_config_errors(work: Callable[[], T], group: dist.ProcessGroup | None = None) -> T:
    """Run `work` on every rank and return its result; a ConfigError it raised on any rank is
    raised on every rank (the lowest such rank's message), so that all exit 2 with it.

    For work that only some ranks do, or whose outcome can differ between ranks (rank 0 writes
    the resolved config, chooses the checkpoint to resume, starts wandb): raised on one rank
    alone, the error ended that rank while the others waited in their next collective until it
    failed or timed out, and the launcher reported exit 1 with a traceback. Collective: every
    rank calls it. Other exceptions are not shared (they are bugs, not the user's to fix).
    `group`: the group to agree in (default: the world's), whose timeout bounds how long the
    other ranks wait for the slowest one's `work`.
    """
    result, error = None, None
    try:
        result = work()
    except ConfigError as e:
        error = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error, group=group)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise ConfigError(error)
    return result
