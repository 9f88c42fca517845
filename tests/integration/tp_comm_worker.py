"""Run under torchrun (2 processes, TP 2): count the TP/SP collectives issued in forward and
in backward per AC mode. Rank 0 prints {mode: {"forward": {collective: n}, "backward": {...}}}
as JSON."""

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.integration.workers import build_debug_model, shut_down
from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import loss_context
from torchtitan.tools.op_counter import BACKWARD, FORWARD, OpCounter, collectives

MODES = ("none", "full", "selective op")
TP2 = ("--parallelism.tensor_parallel_degree", "2")
# The report's name for each functional collective counted.
REPORTED = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
            "all_reduce": "all_reduce"}  # fmt: skip


def count(parallel_dims, mode: str) -> dict:
    model = build_debug_model(parallel_dims, mode, TP2)
    cfg = parse_args(list(TP2), env={})
    tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(0))
    with OpCounter(collectives) as counter, loss_context(parallel_dims, cfg):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        counter.start_backward()
        loss.backward()
    return {
        phase: {reported: counter.count(name, phase=phase) for name, reported in REPORTED.items()}
        for phase in (FORWARD, BACKWARD)
    }


def main():
    dist.init_process_group("gloo")
    parallel_dims = ParallelDims(1, 1, 2, dist.get_world_size())
    parallel_dims.build_mesh("cpu")
    report = {mode: count(parallel_dims, mode) for mode in MODES}
    if dist.get_rank() == 0:
        print(json.dumps(report))
    shut_down()


if __name__ == "__main__":
    main()
