"""Run under torchrun (4 processes): one optimizer step of 2 accumulated micro-batches under DDP
(4 replicas) and HSDP (2 replicas x 2 shards), with `set_gradient_sync` as the trainer calls it.

Rank 0 prints, per layout, as JSON:
    after_first: the gradients after the first micro-batch: "local" (each replica still holds
        its own, unreduced), "held" (none yet: FSDP keeps the partial sum in its own buffer
        until the all-reduce) or "reduced" (already exchanged across replicas);
    max_rel_error: the largest gradient error after the step against one process's gradient of
        the whole global batch, relative to that gradient's largest entry;
    all_reduces: Python-level `dist.all_reduce` calls during the step (FSDP's HSDP reduction;
        DDP reduces from C++ and is not counted).
"""

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.integration.workers import build_debug_model, shut_down
from torchtitan.distributed.data_parallel import set_gradient_sync
from torchtitan.distributed.parallel_dims import ParallelDims

MICRO_BATCHES = 2
LAYOUTS = {"ddp4": (4, 1), "hsdp2x2": (2, 2)}
all_reduces = 0


def count_all_reduces() -> None:
    original = dist.all_reduce

    def counted(*args, **kwargs):
        global all_reduces
        all_reduces += 1
        return original(*args, **kwargs)

    dist.all_reduce = counted


def _loss(model, rows: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())


def _local_grad(param) -> torch.Tensor:
    grad = param.grad
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _gradient_state(model, replicate_group) -> str:
    grads = [p.grad for p in model.parameters()]
    if all(g is None for g in grads):
        return "held"
    grad = _local_grad(model.get_parameter("tok_embeddings.weight"))
    copies = [torch.empty_like(grad) for _ in range(dist.get_world_size(replicate_group))]
    dist.all_gather(copies, grad.contiguous(), group=replicate_group)
    return "reduced" if all(torch.equal(copies[0], other) for other in copies[1:]) else "local"


def one_step(layout: str, tokens: torch.Tensor) -> dict:
    global all_reduces
    replicate, shard = LAYOUTS[layout]
    parallel_dims = ParallelDims(replicate, shard, 1, dist.get_world_size())
    parallel_dims.build_mesh("cpu")
    model = build_debug_model(parallel_dims, "none")
    rank, world = dist.get_rank(), dist.get_world_size()
    all_reduces = 0
    after_first = None
    for micro_batch in range(MICRO_BATCHES):
        set_gradient_sync(model, parallel_dims, sync=micro_batch == MICRO_BATCHES - 1)
        rows = tokens[micro_batch * world + rank].unsqueeze(0)
        (_loss(model, rows) / MICRO_BATCHES).backward()
        if micro_batch == 0:
            after_first = _gradient_state(model, parallel_dims.submesh("dp_replicate").get_group())
    step_all_reduces = all_reduces

    reference = build_debug_model(None, "none")
    _loss(reference, tokens).backward()
    error = 0.0
    for got, want in zip(model.parameters(), reference.parameters()):
        grad = got.grad.full_tensor() if isinstance(got.grad, DTensor) else got.grad
        error = max(error, ((grad - want.grad).abs().max() / want.grad.abs().max()).item())
    return {"after_first": after_first, "max_rel_error": error,
            "all_reduces": step_all_reduces}  # fmt: skip


def main():
    dist.init_process_group("gloo")
    count_all_reduces()
    torch.manual_seed(1)
    tokens = torch.randint(0, 2048, (MICRO_BATCHES * dist.get_world_size(), 65))
    report = {layout: one_step(layout, tokens) for layout in LAYOUTS}
    if dist.get_rank() == 0:
        print(json.dumps(report))
    shut_down()


if __name__ == "__main__":
    main()
