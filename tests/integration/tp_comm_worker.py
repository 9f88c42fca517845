"""Run under torchrun (2 processes, TP 2): count the TP/SP collectives issued in forward and
in backward per AC mode. Rank 0 prints {mode: {"forward": {collective: n}, "backward": {...}}}
as JSON."""

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.integration.workers import build_debug_model, shut_down
from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import loss_context

MODES = ("none", "full", "selective op")
TP2 = ("--parallelism.tensor_parallel_degree", "2")
_c10d = torch.ops._c10d_functional
COLLECTIVES = {
    _c10d.all_gather_into_tensor.default: "all_gather",
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
    _c10d.all_reduce.default: "all_reduce",
}


class CountCollectives(TorchDispatchMode):
    """Active over forward and backward (a backward-only mode breaks SAC recompute)."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.counts = {phase: dict.fromkeys(COLLECTIVES.values(), 0) for phase in ("forward", "backward")}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in COLLECTIVES:
            self.counts[self.phase][COLLECTIVES[func]] += 1
        return func(*args, **(kwargs or {}))


def count(parallel_dims, mode: str) -> dict:
    model = build_debug_model(parallel_dims, mode, TP2)
    cfg = parse_args(list(TP2), env={})
    tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(0))
    with CountCollectives() as counter, loss_context(parallel_dims, cfg):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        counter.phase = "backward"
        loss.backward()
    return counter.counts


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
