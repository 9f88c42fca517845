"""Run under torchrun (2 processes, CP 2): count context parallelism's exchanges per AC mode and
method. Rank 0 prints {method: {mode: {"forward": n, "backward": n}}} as JSON: the functional
collectives on the CP group in forward and in backward (the gradients' own, plus any that a
recompute re-issues)."""

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.integration.workers import build_debug_model, shut_down
from torchtitan.distributed.context_parallel import ContextParallel
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.tools.op_counter import BACKWARD, FORWARD, OpCounter, collectives

MODES = ("none", "full", "selective op")
METHODS = ("allgather_kv", "ulysses")


def count(parallel_dims, method: str, mode: str) -> dict:
    argv = ("--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method", method)
    model = build_debug_model(parallel_dims, mode, argv)
    group = parallel_dims.cp_exchange_group()
    plan = ContextParallel(2, parallel_dims.cp_rank(), group, method)

    def on_cp_group(func, args):
        return collectives(func, args) and args[-1] == group.group_name

    tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(0))
    with OpCounter(on_cp_group) as counter, plan.sharded(tokens[:, :-1], tokens[:, 1:]) as (inputs, labels):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        counter.start_backward()
        loss.backward()
    return {"forward": counter.count(phase=FORWARD), "backward": counter.count(phase=BACKWARD)}


def main():
    dist.init_process_group("gloo")
    parallel_dims = ParallelDims(1, 1, 1, dist.get_world_size(), cp=2)
    parallel_dims.build_mesh("cpu")
    report = {method: {mode: count(parallel_dims, method, mode) for mode in MODES} for method in METHODS}
    if dist.get_rank() == 0:
        print(json.dumps(report))
    shut_down()


if __name__ == "__main__":
    main()
