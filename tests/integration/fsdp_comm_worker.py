"""Run under torchrun (2 processes): count FSDP all-gathers and reduce-scatters in one step
per AC mode. Rank 0 prints {mode: {"all_gather": n, "reduce_scatter": n}} as JSON."""

import json
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import parallelize_llama

MODES = {"none": ("none", "2"), "full": ("full", "2"), "selective op": ("selective", "op")}
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


def one_step(parallel_dims, mode, option) -> dict:
    overrides = ["--activation_checkpoint.mode", mode, "--activation_checkpoint.selective_ac_option", option,
                 "--training.seq_len", "64", "--training.mixed_precision_param", "float32"]  # fmt: skip
    cfg = parse_args(overrides, env={})
    with torch.device("meta"):
        model = Transformer(llama3_flavors["debugmodel"])
    parallelize_llama(model, parallel_dims, cfg, torch.device("cpu"))
    model.to_empty(device="cpu")
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 2048, (2, 65))
    counts.clear()
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
    report = {name: one_step(parallel_dims, *mode) for name, mode in MODES.items()}
    if dist.get_rank() == 0:
        print(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
