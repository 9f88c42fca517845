"""Run under torchrun (2 processes): every AC mode under FSDP vs the 1-process no-AC model.

Each rank builds the unsharded no-AC reference on the full batch, then the model through
Llama 3's parallelize.py (AC + FSDP) on its half of the batch, and compares the loss (mean
over ranks) and every full gradient, and checks each mode against FSDP without AC bit for bit. Rank 0
prints one JSON line with the largest differences.
"""

import json
import sys

import torch
import torch.distributed as dist

from tests.integration.workers import AC_MODES, SEQ_LEN, build_debug_model, shut_down
from tests.model_testing import next_token_loss_and_grads
from torchtitan.distributed.parallel_dims import ParallelDims


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    parallel_dims = ParallelDims(1, -1, 1, world)
    parallel_dims.build_mesh("cpu")
    tokens = torch.randint(0, 2048, (4, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = next_token_loss_and_grads(build_debug_model(None, "none"), tokens)
    local = tokens.chunk(world)[rank]
    report, fsdp_none = {}, None
    for name in AC_MODES:
        loss, grads = next_token_loss_and_grads(build_debug_model(parallel_dims, name), local)
        dist.all_reduce(loss)
        fsdp_none = fsdp_none or (loss, grads)
        report[name] = {
            "loss_rel_diff": abs(loss.item() / world - ref_loss.item()) / ref_loss.item(),
            "grad_diff": max((grads[k] - g).abs().max().item() for k, g in ref_grads.items()),
            "n_grads": len(grads),
            "equals_fsdp_without_ac": torch.equal(loss, fsdp_none[0])
            and all(torch.equal(g, fsdp_none[1][k]) for k, g in grads.items()),
        }
    if rank == 0:
        print(json.dumps(report))
    shut_down()


if __name__ == "__main__":
    sys.exit(main())
