"""MoE with expert parallelism: step time, memory held for backward and all-to-all traffic per AC mode.

Trains the Qwen3 MoE debug model (fp32, CPU, gloo) with expert_parallel_degree 2 on 2 processes,
once per AC mode, interleaving the modes round by round so machine noise hits all alike. Both
full-AC options are measured: `reissue` (the token all-to-alls run again in recompute) and
`replay` (their outputs are saved). Where the combine all-to-all is replayed (op-SAC, full
replay), recompute skips the experts' w2, whose output only that all-to-all reads; the rows marked
"w2 recomputed" turn that off, to show what it saves. Rank 0 prints one table.

    python benchmarks/moe_expert_parallel.py [--batch 2] [--seq-len 512] [--rounds 3]
        [--steps-per-round 2] [--warmup 1] [--dim 256] [--moe-hidden-dim 256] [--layers 6]
        [--force-load-balance]

`--dim`, `--moe-hidden-dim` and `--layers` resize the debug flavor (wider experts make the
matmuls, rather than the per-op overheads, the cost). `--force-load-balance` measures at
perfectly balanced routing (`model.moe_force_load_balance`), the all-to-alls then sending equal
splits, where the randomly initialized router's imbalance would otherwise vary with the seed.

Run it as is: it starts itself under torchrun with 2 processes.
"""

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan.config.manager import parse_args
from torchtitan.distributed import activation_checkpoint as ac_module
from torchtitan.distributed.expert_parallel import is_ep_local
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.moe import GroupedExperts, is_expert_matmul
from torchtitan.models.qwen3 import qwen3_flavors
from torchtitan.models.qwen3.args import Qwen3ModelArgs
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.parallelize import parallelize_qwen3
from torchtitan.tools.activation_memory import bytes_held_for_backward
from torchtitan.tools.op_counter import BACKWARD, FORWARD, OpCounter, ops

_MODE = "--activation_checkpoint.mode"
_OPTION = "--activation_checkpoint.selective_ac_option"
MODES = {
    "none": [_MODE, "none"],
    "full, reissue": [_MODE, "full"],
    "full, replay": [_MODE, "full", "--activation_checkpoint.full_ac_all_to_all", "replay"],
    "selective 2": [_MODE, "selective", _OPTION, "2"],
    "selective op": [_MODE, "selective", _OPTION, "op"],
}
MODES["full, replay, w2 recomputed"] = MODES["full, replay"]
MODES["selective op, w2 recomputed"] = MODES["selective op"]
EP = 2


# The experts' matmuls are grouped, or looped where the rows are not 16-byte aligned.
COUNTED = {"a2a": ops(torch.ops._c10d_functional.all_to_all_single.default), "expert mm": is_expert_matmul}


def flavor(cli) -> Qwen3ModelArgs:
    return replace(
        qwen3_flavors["debugmodel_moe"], dim=cli.dim, moe_hidden_dim=cli.moe_hidden_dim, n_layers=cli.layers
    )


def build(parallel_dims: ParallelDims, ac_argv: list[str], cli, skip_w2: bool = True) -> Qwen3Model:
    argv = ["--config", "qwen3_debug_model_moe.toml", "--parallelism.expert_parallel_degree", str(EP)]
    argv += ["--model.moe_force_load_balance"] if cli.force_load_balance else []
    cfg = parse_args(argv + ac_argv + ["--training.seq_len", str(cli.seq_len)], env={})
    with torch.device("meta"):
        model = Qwen3Model(flavor(cli).update_from_config(cfg))
    # Without the skip, the plan skips no matmul in recompute (as before the skip existed).
    no_skip = mock.patch.object(ac_module.ACPlan, "_skips_all_to_all_inputs", return_value=False)
    with contextlib.nullcontext() if skip_w2 else no_skip:
        parallelize_qwen3(model, parallel_dims, cfg, torch.device("cpu"))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


class ModeRun:
    def __init__(self, parallel_dims, ac_argv, tokens, cli, skip_w2: bool = True):
        self.model = build(parallel_dims, ac_argv, cli, skip_w2)
        # Experts are plain local tensors, the rest DTensors: foreach kernels take one kind at a time.
        local = [p for p in self.model.parameters() if is_ep_local(p)]
        sharded = [p for p in self.model.parameters() if not is_ep_local(p)]
        self.optimizer = torch.optim.AdamW([{"params": local}, {"params": sharded}], lr=1e-4, foreach=True)
        self.tokens = tokens
        self.times: list[float] = []

    def loss(self) -> torch.Tensor:
        logits = self.model(self.tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), self.tokens[:, 1:].flatten())

    def step(self, record: bool) -> None:
        dist.barrier()
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        self.loss().backward()
        self.optimizer.step()
        dist.barrier()
        if record:
            self.times.append(time.perf_counter() - start)

    def traffic(self) -> tuple[int, int, int, int]:
        """(forward calls, backward calls, backward bytes) of one step's all-to-alls, and the
        experts' matmuls recomputed in its backward."""
        with OpCounter(COUNTED) as counter:
            loss = self.loss()
            counter.start_backward()
            loss.backward()
        self.optimizer.zero_grad(set_to_none=True)
        backward_a2a = counter.matching("a2a", phase=BACKWARD)
        # With grad mode on in backward: the recompute's matmuls (not the gradients').
        recomputed = counter.count("expert mm", phase=BACKWARD, grad_enabled=True)
        return (counter.count("a2a", phase=FORWARD), len(backward_a2a),
                sum(call.nbytes for call in backward_a2a), recomputed)  # fmt: skip

    def held_bytes(self) -> int:
        return bytes_held_for_backward(self.model, self.tokens[:, :-1])


def _expert_matmuls_counted(cli) -> str:
    """What one expert matmul is on the path the experts take at this size (fp32, CPU)."""
    experts = GroupedExperts(cli.dim, cli.moe_hidden_dim, num_experts=1)
    if experts.uses_grouped_mm(torch.empty(0, cli.dim)):
        return "grouped mm: one per projection"
    return "rows not 16-byte aligned, looped: one per projection and expert"


def table(cli) -> list[str]:
    parallel_dims = ParallelDims(1, EP, 1, dist.get_world_size(), ep=EP)
    parallel_dims.build_mesh("cpu")
    vocab = qwen3_flavors["debugmodel_moe"].vocab_size
    generator = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, vocab, (cli.batch, cli.seq_len + 1), generator=generator)
    runs = {
        name: ModeRun(parallel_dims, argv, tokens, cli, skip_w2="w2 recomputed" not in name)
        for name, argv in MODES.items()
    }
    for run in runs.values():
        for _ in range(cli.warmup):
            run.step(record=False)
    for _ in range(cli.rounds):
        for run in runs.values():
            for _ in range(cli.steps_per_round):
                run.step(record=True)
    base_time = statistics.median(runs["none"].times)
    runs["none"].held_bytes()  # the first measurement also counts lazily created state
    held = {name: run.held_bytes() for name, run in runs.items()}
    routing = "routing forced round-robin" if cli.force_load_balance else "routing by the router"
    lines = [
        f"Qwen3 debugmodel_moe (dim {cli.dim}, moe_hidden_dim {cli.moe_hidden_dim}, {cli.layers} "
        f"layers), EP {EP} on {dist.get_world_size()} CPU processes (gloo), batch "
        f"{cli.batch} x {cli.seq_len} per rank, fp32, median of {cli.rounds * cli.steps_per_round} "
        f"steps, torch {torch.__version__}, "
        f"{routing}; all-to-alls, MiB sent and the experts' matmuls "
        f"recomputed ({_expert_matmuls_counted(cli)}), per rank per step",
        "",
        "| mode | step (ms) | time vs none | held for backward MiB | memory vs none "
        "| a2a fwd | a2a bwd | MiB sent bwd | expert matmuls recomputed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        step = statistics.median(run.times)
        fwd_calls, bwd_calls, bwd_bytes, recomputed = run.traffic()
        row = [
            f"{1000 * step:.0f}", f"{step / base_time:.2f}",
            f"{held[name] / 2**20:.1f}", f"{held[name] / held['none']:.2f}",
            str(fwd_calls), str(bwd_calls), f"{bwd_bytes / 2**20:.1f}", str(recomputed),
        ]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    debug = qwen3_flavors["debugmodel_moe"]
    parser.add_argument("--dim", type=int, default=debug.dim)
    parser.add_argument("--moe-hidden-dim", type=int, default=debug.moe_hidden_dim)
    parser.add_argument("--layers", type=int, default=debug.n_layers)
    parser.add_argument(
        "--force-load-balance",
        action="store_true",
        help="route round-robin (model.moe_force_load_balance): equal all-to-all splits on every rank",
    )
    cli = parser.parse_args()
    if "RANK" not in os.environ:
        launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={EP}", __file__]
        sys.exit(subprocess.call(launch + sys.argv[1:], env={**os.environ, "OMP_NUM_THREADS": "1"}))
    dist.init_process_group("gloo")
    lines = table(cli)
    if dist.get_rank() == 0:
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
