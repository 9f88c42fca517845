"""Run under torchrun (2 processes, TP 2): after one backward of the debug model, count the
all-reduces that measuring the global gradient norm issues, and compare the norm with one
computed from the full gradients. Rank 0 prints the report as JSON."""

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.integration.workers import build_debug_model, shut_down
from torchtitan.config.manager import parse_args
from torchtitan.distributed.grad_norm import GradSquareSums
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import loss_context
from torchtitan.tools.op_counter import OpCounter, ops

TP2 = ("--parallelism.tensor_parallel_degree", "2")
# Functional (DTensor's) and in-place (direct process-group) all-reduces.
ALL_REDUCES = ops(torch.ops._c10d_functional.all_reduce.default, torch.ops.c10d.allreduce_.default)


def main():
    dist.init_process_group("gloo")
    parallel_dims = ParallelDims(1, 1, 2, dist.get_world_size())
    parallel_dims.build_mesh("cpu")
    model = build_debug_model(parallel_dims, "none", TP2)
    tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(0))
    with loss_context(parallel_dims, parse_args(list(TP2), env={})):
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    params = list(model.parameters())
    partial = sum(any(p.is_partial() for p in param.grad.placements) for param in params)
    reference = torch.stack([param.grad.full_tensor().double().norm() for param in params]).norm()
    sums = GradSquareSums()
    with OpCounter(ALL_REDUCES) as counter:
        sums.add(params)
        norm = sums.global_norm()
    left_partial = sum(any(p.is_partial() for p in param.grad.placements) for param in params)
    if dist.get_rank() == 0:
        report = {"partial_grads": partial, "left_partial": left_partial, "all_reduces": counter.count(),
                  "norm": norm.item(), "reference": reference.item(),
                  "all_dtensors": all(isinstance(p.grad, DTensor) for p in params)}  # fmt: skip
        print(json.dumps(report))
    shut_down()


if __name__ == "__main__":
    main()
