"""Run under torchrun (2 processes): count FSDP all-gathers and reduce-scatters in one step
per AC mode, and without AC per `fsdp_reshard_after_forward` policy, each also with the loss
computed by the model in 16 chunks ("..., 16 loss chunks"). Rank 0 prints
{mode or "reshard <policy>": {"all_gather": n, "reduce_scatter": n}} as JSON."""

import json
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.integration.workers import build_debug_model, shut_down
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.components.loss_head import ChunkedLoss
from torchtitan.distributed.parallel_dims import ParallelDims

MODES = ("none", "full", "selective op")
COLLECTIVES = {
    "all_gather": ("all_gather_single", "all_gather_into_tensor"),
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
}
counts: Counter = Counter()


def count_calls(kind: str, name: str) -> None:
    original = getattr(dist, name)

    def counted(*args, **kwargs):
        counts[kind] += 1
        return original(*args, **kwargs)

    setattr(dist, name, counted)


def one_step(parallel_dims, mode: str, extra_args: tuple = (), loss_chunks: int = 0) -> dict:
    """Counts of one step; `loss_chunks` > 0: the model computes the loss (`ChunkedLoss`)."""
    model = build_debug_model(parallel_dims, mode, extra_args)
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 2048, (2, 65))
    counts.clear()
    if loss_chunks:
        model(tokens[:, :-1], tokens[:, 1:], ChunkedLoss(cross_entropy_loss, loss_chunks)).backward()
    else:
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    return dict(counts)


def main():
    dist.init_process_group("gloo")
    for kind, names in COLLECTIVES.items():
        for name in names:
            if hasattr(dist, name):
                count_calls(kind, name)
    parallel_dims = ParallelDims(1, -1, 1, dist.get_world_size())
    parallel_dims.build_mesh("cpu")
    report = {mode: one_step(parallel_dims, mode) for mode in MODES}
    report["none, 16 loss chunks"] = one_step(parallel_dims, "none", loss_chunks=16)
    for policy in ("always", "never"):
        extra = ("--parallelism.fsdp_reshard_after_forward", policy)
        report[f"reshard {policy}"] = one_step(parallel_dims, "none", extra)
        report[f"reshard {policy}, 16 loss chunks"] = one_step(parallel_dims, "none", extra, loss_chunks=16)
    if dist.get_rank() == 0:
        print(json.dumps(report))
    shut_down()


if __name__ == "__main__":
    main()
