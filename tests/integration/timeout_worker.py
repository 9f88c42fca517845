"""Run under torchrun (4 processes, mesh dp_shard 2 x tp 2): after `set_collective_timeout`, as
the trainer calls it when step 1 ends, a collective on each group whose member arrives late
times out after the training timeout, not the (longer) startup one; a group it is told to
keep ("kept") waits. With "startup" as the second argument, no training timeout is set: the
mesh's groups time out after the startup timeout given to `build_mesh`, as the trainer gives it.

Rank 0 prints, per group, as JSON: whether its all-reduce raised. The late rank arrives
`LATE_BY` seconds after the others, far past the training timeout and far inside the startup
one, so the outcome alone tells which timeout applied, even on a loaded machine.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.process_group import init_distributed, set_collective_timeout

STARTUP_TIMEOUT, TRAIN_TIMEOUT, LATE_BY = 120, 1, 6


def main(group_name: str, phase: str) -> None:
    cfg = JobConfig()
    cfg.parallelism.tensor_parallel_degree = 2
    startup_timeout = TRAIN_TIMEOUT if phase == "startup" else STARTUP_TIMEOUT
    world = init_distributed(torch.device("cpu"), startup_timeout, 0)
    dims = ParallelDims.from_config(cfg.parallelism, world)
    dims.build_mesh("cpu", timeout_seconds=startup_timeout)
    if phase == "startup":
        group = dims.submesh(group_name).get_group()
    elif group_name == "kept":  # as the checkpointer's async-save group, which the trainer keeps
        group = dist.new_group(backend="gloo")
        set_collective_timeout(TRAIN_TIMEOUT, keep=(group,))
    else:
        group = dims.submesh(group_name).get_group()
        set_collective_timeout(TRAIN_TIMEOUT)
    ranks = dist.get_process_group_ranks(group)
    if dist.get_rank() == ranks[-1]:
        time.sleep(LATE_BY)
    try:
        dist.all_reduce(torch.ones(1), group=group)
        raised = False
    except RuntimeError:
        raised = True
    if dist.get_rank() == 0:
        print(json.dumps({"raised": raised}), flush=True)
    time.sleep(LATE_BY)  # let the late rank finish before any process exits
    os._exit(0)  # a timed-out gloo group cannot be torn down cleanly


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "train")
