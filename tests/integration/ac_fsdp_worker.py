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
import torch.nn.functional as F

from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import parallelize_llama

MODES = {"none": ("none", "2"), "full": ("full", "2"), "selective 1": ("selective", "1"),
         "selective 2": ("selective", "2"), "selective op": ("selective", "op")}  # fmt: skip
SEQ = 64


def build(args, parallel_dims, mode, option):
    overrides = {"activation_checkpoint.mode": mode, "activation_checkpoint.selective_ac_option": option,
                 "training.mixed_precision_param": "float32", "training.seq_len": str(SEQ)}  # fmt: skip
    cfg = parse_args([arg for key, value in overrides.items() for arg in (f"--{key}", value)], env={})
    with torch.device("meta"):
        model = Transformer(args)
    if parallel_dims is not None:
        parallelize_llama(model, parallel_dims, cfg, torch.device("cpu"))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


def loss_and_grads(model, tokens):
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name.replace("._checkpoint_wrapped_module", "")] = grad
    return loss.detach(), grads


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    parallel_dims = ParallelDims(1, -1, 1, world)
    parallel_dims.build_mesh("cpu")
    args = llama3_flavors["debugmodel"]
    tokens = torch.randint(0, args.vocab_size, (4, SEQ + 1), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = loss_and_grads(build(args, None, "none", "2"), tokens)
    local = tokens.chunk(world)[rank]
    report, fsdp_none = {}, None
    for name, (mode, option) in MODES.items():
        loss, grads = loss_and_grads(build(args, parallel_dims, mode, option), local)
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
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
