"""Starting the process group, its timeouts, and the flight recorder that traces a hang."""

import datetime
import logging
import os

import torch
import torch.distributed as dist

from torchtitan.distributed.device import backend_for

logger = logging.getLogger(__name__)


def init_distributed(
    device: torch.device,
    timeout_seconds: int,
    trace_buf_size: int,
    cpu_collectives: bool = False,
    trace_dump_prefix: str = "",
) -> int:
    """Join the process group when launched by torchrun; returns the world size.

    A plain `python -m torchtitan.train` (no WORLD_SIZE) runs as one process with no group.
    `cpu_collectives`: see `backend_for`. Under nccl the flight recorder keeps each rank's
    last `trace_buf_size` collectives and, on a collective timeout, writes them to the file
    `trace_dump_prefix` + rank (its folder created here), so that on several nodes they land
    in the run's dump folder rather than in each node's /tmp. Variables the user set win.
    """
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return 1
    backend = backend_for(device.type, cpu_collectives)
    _configure_flight_recorder(trace_buf_size, trace_dump_prefix if "nccl" in backend else "")
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=timeout_seconds),
        device_id=device if device.type != "cpu" else None,
    )
    return dist.get_world_size()


def _configure_flight_recorder(trace_buf_size: int, trace_dump_prefix: str) -> None:
    # The TORCH_NCCL_* names are the deprecated spellings of the TORCH_FR_* ones.
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(trace_buf_size))
    user_chose_a_file = {"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"} & set(os.environ)
    if trace_buf_size == 0 or not trace_dump_prefix or user_chose_a_file:
        return
    # abspath drops a trailing separator, which an empty file prefix leaves.
    prefix = os.path.abspath(trace_dump_prefix) + (os.sep if trace_dump_prefix.endswith(os.sep) else "")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = prefix
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    logger.info(
        f"Flight recorder: each rank's last {trace_buf_size} NCCL collectives are written to "
        f"{prefix}<rank> if a collective times out"
    )


def set_collective_timeout(timeout_seconds: int, keep: tuple = ()) -> None:
    """Shorten every process group's timeout once the slow first step is over: the default
    group's, the device mesh's (FSDP, TP, EP, their flattened groups) and the trainer's own.

    A barrier first, so that no rank applies the shorter timeout to a collective that a rank
    still in its first step has yet to join.

    Args:
        keep: groups whose timeout stays, e.g. the checkpointer's, which wait for rank 0's file
            work or for the slowest rank's write, either of which may take longer.
    """
    if not dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _world

    dist.barrier()
    set_group_timeouts(timeout_seconds, [group for group in list(_world.pg_map) if group not in keep])


def set_group_timeouts(timeout_seconds: int, groups) -> None:
    """Give each of `groups` the collective timeout `timeout_seconds`, from the next collective
    on. No collective of theirs may be in flight (it could be timed against either value)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    timeout = datetime.timedelta(seconds=timeout_seconds)
    for group in groups:
        _set_pg_timeout(timeout, group)
