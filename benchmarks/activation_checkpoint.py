"""Activation checkpointing: step time and activation memory per mode, side by side.

Table 1 trains the Llama 3 debug model (CPU, fp32) once per AC mode, interleaving the modes
round by round so machine noise hits all alike, and reports the median step time relative to
`none` and the activation bytes held for backward per transformer layer.
Table 2 measures one Llama 3 8B block at seq_len 8192 in bf16 under FakeTensorMode (nothing
is allocated), relative to its block input (b * s * h * 2 bytes).

    python benchmarks/activation_checkpoint.py [--batch 2] [--seq-len 1024] [--rounds 3]
        [--steps-per-round 3] [--warmup 2]
"""

import argparse
import statistics
import time
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from torchtitan.config import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.llama3.model import Transformer, TransformerBlock
from torchtitan.models.llama3.parallelize import LLAMA3_SAVE_LIST
from torchtitan.models.rope import precompute_rope_cache
from torchtitan.tools.activation_memory import bytes_held_for_backward

MODES = {
    "none": ActivationCheckpoint(mode="none"),
    "full": ActivationCheckpoint(mode="full"),
    "selective 1": ActivationCheckpoint(mode="selective", selective_ac_option="1"),
    "selective 2": ActivationCheckpoint(mode="selective", selective_ac_option="2"),
    "selective op": ActivationCheckpoint(mode="selective", selective_ac_option="op"),
}


class BlockStack(nn.Module):
    """Runs a model's blocks only, so that held bytes are the blocks' own."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.layers = model.layers

    def forward(self, h, rope_cache):
        for block in self.layers.values():
            h = block(h, rope_cache)
        return h


def build_model(args, ac: ActivationCheckpoint) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    apply_ac(model, ac, op_sac_save_list=LLAMA3_SAVE_LIST)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


class ModeRun:
    def __init__(self, args, ac, tokens):
        self.model = build_model(args, ac)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=True)
        self.tokens = tokens
        self.times: list[float] = []

    def step(self, record: bool) -> None:
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(self.tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), self.tokens[:, 1:].flatten()).backward()
        self.optimizer.step()
        if record:
            self.times.append(time.perf_counter() - start)


def debug_model_table(cli) -> list[str]:
    args = replace(llama3_flavors["debugmodel"], max_seq_len=cli.seq_len)
    tokens = torch.randint(
        0, args.vocab_size, (cli.batch, cli.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    runs = {name: ModeRun(args, ac, tokens) for name, ac in MODES.items()}
    for run in runs.values():
        for _ in range(cli.warmup):
            run.step(record=False)
    for _ in range(cli.rounds):
        for run in runs.values():
            for _ in range(cli.steps_per_round):
                run.step(record=True)
    h = torch.randn(cli.batch, cli.seq_len, args.dim, requires_grad=True)
    rope = precompute_rope_cache(args.head_dim, cli.seq_len, args.rope_theta)
    base_time = statistics.median(runs["none"].times)
    base_bytes = bytes_held_for_backward(BlockStack(runs["none"].model), h, rope) / args.n_layers
    lines = [
        f"Llama 3 debugmodel, batch {cli.batch} x {cli.seq_len}, fp32, "
        f"CPU ({torch.get_num_threads()} threads), median of {cli.rounds * cli.steps_per_round} steps, "
        f"torch {torch.__version__}",
        "",
        "| mode | step (ms) | time vs none | activation MiB / layer | memory vs none |",
        "|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        step = statistics.median(run.times)
        held = bytes_held_for_backward(BlockStack(run.model), h, rope) / args.n_layers
        row = [
            f"{1000 * step:.0f}",
            f"{step / base_time:.2f}",
            f"{held / 2**20:.2f}",
            f"{held / base_bytes:.2f}",
        ]
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return lines


def block_8b_table() -> list[str]:
    seq_len, batch, dtype = 8192, 1, torch.bfloat16
    args = replace(llama3_flavors["8B"], max_seq_len=seq_len)
    block_input = batch * seq_len * args.dim * dtype.itemsize
    held = {}
    for name in ("none", "full", "selective op"):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with FakeTensorMode():
                holder = nn.Module()
                holder.layers = nn.ModuleDict({"0": TransformerBlock(0, args)})
                apply_ac(holder, MODES[name], op_sac_save_list=LLAMA3_SAVE_LIST)
                h = torch.randn(batch, seq_len, args.dim, requires_grad=True)
                rope = precompute_rope_cache(args.head_dim, seq_len, args.rope_theta)
                held[name] = bytes_held_for_backward(holder.layers["0"], h, rope)
        finally:
            torch.set_default_dtype(previous)
    lines = [
        f"Llama 3 8B block, batch {batch} x {seq_len}, bf16, FakeTensorMode "
        f"(block input {block_input / 2**20:.0f} MiB)",
        "",
        "| mode | held MiB | x block input | vs none |",
        "|---|---|---|---|",
    ]
    for name, value in held.items():
        lines.append(
            f"| {name} | {value / 2**20:.0f} | {value / block_input:.2f} | {value / held['none']:.2f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    cli = parser.parse_args()
    print("\n".join(block_8b_table()), end="\n\n", flush=True)
    print("\n".join(debug_model_table(cli)))


if __name__ == "__main__":
    main()
