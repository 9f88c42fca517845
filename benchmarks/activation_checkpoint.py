"""Activation checkpointing: step time and activation memory per mode, side by side.

Table 1 trains the Llama 3 debug model (CPU, fp32) once per AC mode, interleaving the modes
round by round so machine noise hits all alike, and reports the median step time relative to
`none` and the activation bytes held for backward per transformer layer. Its "earlier defaults"
rows run full AC and op-SAC as before `early_stop` became the default and op-SAC stopped saving
the block's last matmul (upstream torchtitan's defaults).
Table 2 measures one Llama 3 8B block at seq_len 8192 in bf16 under FakeTensorMode (nothing
is allocated), relative to its block input (b * s * h * 2 bytes).
Table 3 does what table 1 does with every block compiled (inductor, as `compile.enable`
does), adding `memory_budget` at several budgets; its bytes are what the compiled blocks save
for backward (`bytes_saved_for_backward`), relative to compiled `none`. Its modes run one after
another (see `compiled_table`), so machine noise is not spread over them as in table 1.
Table 4 sets mode "auto"'s budget to each fixed mode's step peak (the memory estimator's, for
the trainer's step at table 1's batch and seq_len) and puts the plan beside that mode: the
plan's peak and recompute FLOPs per step (`scripts/estimate_memory.py --plan`'s measurements),
and step times timed as in table 1, interleaved, relative to the fixed mode.

Table 5 fits mode "auto"'s host prices (`auto_host_us_per_op`, `auto_host_us_per_rerun`): each
block choice on every block of the debug model, timed as in table 1 (run it with a tiny batch
and seq_len, so that kernels cost next to nothing), against the host ops and region reruns
that `RecomputeCost` counts.

    python benchmarks/activation_checkpoint.py [--batch 2] [--seq-len 1024] [--rounds 3]
        [--steps-per-round 3] [--warmup 2] [--tables 1,2,3,4,5]
"""

import argparse
import importlib.util
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from torchtitan.config import ActivationCheckpoint
from torchtitan.config.manager import parse_args
from torchtitan.distributed.activation_checkpoint import apply_ac, in_selective_checkpoint
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.llama3.model import Transformer, TransformerBlock
from torchtitan.models.llama3.parallelize import LLAMA3_SAVE_LIST, parallelize_llama
from torchtitan.models.rope import precompute_rope_cache
from torchtitan.tools.activation_memory import bytes_held_for_backward, bytes_saved_for_backward
from torchtitan.tools.op_counter import RecomputeCost

MODES = {
    "none": ActivationCheckpoint(mode="none"),
    "full": ActivationCheckpoint(mode="full"),
    "selective 1": ActivationCheckpoint(mode="selective", selective_ac_option="1"),
    "selective 2": ActivationCheckpoint(mode="selective", selective_ac_option="2"),
    "selective op": ActivationCheckpoint(mode="selective", selective_ac_option="op"),
}
# The defaults before early_stop and the block's last matmul changed (upstream torchtitan's),
# measured beside the current ones.
EARLIER_DEFAULTS = {"early_stop": False, "per_op_sac_force_recompute_mm_shapes_by_fqns": ["moe.router.gate"]}
MODES |= {
    "full, earlier defaults": replace(MODES["full"], **EARLIER_DEFAULTS),
    "selective op, earlier defaults": replace(MODES["selective op"], **EARLIER_DEFAULTS),
    # Mode auto's "regions" choice on every block: norms, RoPE and SwiGLU gates checkpointed one by
    # one, without SAC's per-op dispatch.
    "auto, regions on every block": ActivationCheckpoint(mode="auto", auto_plan="regions:0-999"),
}

_MODE, _OPTION, _BUDGET = (
    "--activation_checkpoint.mode",
    "--activation_checkpoint.selective_ac_option",
    "--activation_checkpoint.memory_budget",
)
COMPILED_MODES = {
    "none": [_MODE, "none"],
    "memory_budget 0.5": [_MODE, "memory_budget", _BUDGET, "0.5"],
    "memory_budget 0.2": [_MODE, "memory_budget", _BUDGET, "0.2"],
    "memory_budget 0": [_MODE, "memory_budget", _BUDGET, "0"],
    "full": [_MODE, "full"],
    "selective op": [_MODE, "selective", _OPTION, "op"],
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


def build_compiled_model(args, ac_argv: list[str], seq_len: int) -> Transformer:
    """The model as the trainer builds it with `compile.enable` (AC, then per-block inductor)."""
    cfg = parse_args(["--training.seq_len", str(seq_len), "--compile.enable", *ac_argv], env={})
    with torch.device("meta"):
        model = Transformer(args)
    parallelize_llama(model, ParallelDims(1, 1, 1, 1), cfg, torch.device("cpu"))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


class ModeRun:
    def __init__(self, model, tokens):
        self.model = model
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
    runs = {name: ModeRun(build_model(args, ac), tokens) for name, ac in MODES.items()}
    for run in runs.values():
        for _ in range(cli.warmup):
            run.step(record=False)
    _timed_rounds(runs, cli)
    h, rope = _block_inputs(args, cli)
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
        held = bytes_held_for_backward(BlockStack(run.model), h, rope) / args.n_layers
        lines.append(_mode_row(name, run, base_time, held, base_bytes))
    return lines


def _row(name: str, cells: list[str]) -> str:
    return f"| {name} | " + " | ".join(cells) + " |"


def _mode_row(name: str, run: "ModeRun", base_time: float, bytes_per_layer: float, base_bytes: float) -> str:
    """A row of tables 1 and 3: median step, its ratio to none's, bytes per layer and theirs."""
    step = statistics.median(run.times)
    cells = [f"{1000 * step:.0f}", f"{step / base_time:.2f}", f"{bytes_per_layer / 2**20:.2f}",
             f"{bytes_per_layer / base_bytes:.2f}"]  # fmt: skip
    return _row(name, cells)


def _timed_rounds(runs: dict, cli) -> None:
    """Interleave the modes round by round, so that machine noise hits all alike."""
    for _ in range(cli.rounds):
        for run in runs.values():
            for _ in range(cli.steps_per_round):
                run.step(record=True)


def _block_inputs(args, cli) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.randn(cli.batch, cli.seq_len, args.dim, requires_grad=True)
    return h, precompute_rope_cache(args.head_dim, cli.seq_len, args.rope_theta)


def compiled_table(cli) -> list[str]:
    """Table 1 with compiled blocks, memory_budget included.

    The modes run one after another, not interleaved: torch's partitioner budget is
    process-wide and read when a graph compiles, and dynamo's cache is process-wide too, so a
    model is compiled, measured and timed before the next one resets the cache (interleaved,
    the earlier models recompiled under the last model's budget).
    """
    args = replace(llama3_flavors["debugmodel"], max_seq_len=cli.seq_len)
    tokens = torch.randint(
        0, args.vocab_size, (cli.batch, cli.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    h, rope = _block_inputs(args, cli)
    runs, saved = {}, {}
    with torch._functorch.config.patch(activation_memory_budget=1.0):
        for name, ac_argv in COMPILED_MODES.items():
            torch._dynamo.reset()
            run = runs[name] = ModeRun(build_compiled_model(args, ac_argv, cli.seq_len), tokens)
            for _ in range(max(cli.warmup, 1)):
                run.step(record=False)
            saved[name] = bytes_saved_for_backward(BlockStack(run.model), h, rope) / args.n_layers
            for _ in range(cli.rounds * cli.steps_per_round):
                run.step(record=True)
    base_time, base_bytes = statistics.median(runs["none"].times), saved["none"]
    lines = [
        f"Llama 3 debugmodel, every block compiled (inductor), batch {cli.batch} x {cli.seq_len}, fp32, "
        f"CPU ({torch.get_num_threads()} threads), median of {cli.rounds * cli.steps_per_round} steps, "
        f"torch {torch.__version__}",
        "",
        "| mode | step (ms) | time vs none | saved MiB / layer | memory vs none |",
        "|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        lines.append(_mode_row(name, run, base_time, saved[name], base_bytes))
    return lines


def block_8b_table() -> list[str]:
    seq_len, batch, dtype = 8192, 1, torch.bfloat16
    args = replace(llama3_flavors["8B"], max_seq_len=seq_len)
    block_input = batch * seq_len * args.dim * dtype.itemsize
    held = {}
    for name in (
        "none",
        "full",
        "selective op",
        "selective op, earlier defaults",
        "auto, regions on every block",
    ):
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


def _estimator():
    path = Path(__file__).resolve().parents[1] / "scripts" / "estimate_memory.py"
    spec = importlib.util.spec_from_file_location("estimate_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def this_cpus_rates(activation_elements: int) -> tuple[float, float]:
    """(TFLOP/s of an fp32 matmul, GB/s of SiLU on `activation_elements` floats) on this CPU, so
    that mode "auto" prices recompute at this machine's rates, not a GPU's. The element-wise
    rate is taken at the model's activation size: where that fits in the CPU's caches it is
    several times the rate out of memory."""

    def best_of(fn, repeats: int = 5) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    tflops = 2 * 1024**3 / best_of(lambda: a @ b) / 1e12
    x = torch.randn(activation_elements)
    gbps = 2 * x.numel() * x.element_size() / best_of(lambda: torch.nn.functional.silu(x)) / 1e9
    return tflops, gbps


def auto_table(cli) -> list[str]:
    """Mode "auto" at the budget of each fixed mode's peak, beside that mode; recompute priced at
    this CPU's rates (`this_cpus_rates`), and no offload (the CPU copies synchronously, as the
    trainer plans on it)."""
    em = _estimator()
    args = replace(llama3_flavors["debugmodel"], max_seq_len=cli.seq_len)
    tflops, gbps = this_cpus_rates(cli.batch * cli.seq_len * args.ffn_hidden_dim)
    prices = ["--activation_checkpoint.auto_tflops", repr(tflops), "--activation_checkpoint.auto_memory_gbps",
              repr(gbps), "--activation_checkpoint.auto_offload", "false"]  # fmt: skip
    cfg = parse_args(["--config", "debug_model.toml", "--training.local_batch_size", str(cli.batch),
                      "--training.seq_len", str(cli.seq_len), *prices], env={})  # fmt: skip
    (costs,) = em.rank_costs(cfg, 1)
    n = len(costs.blocks)
    fixed = {
        "full": ({i: "full" for i in range(n)}, costs.peak["full"]),
        "selective op": ({i: "op" for i in range(n)}, costs.peak["op"]),
        "selective 2": ({i: "none" if i % 2 else "full" for i in range(n)},
                        em.estimate(cfg, 1, ["selective 2"])["selective 2"][em.TOTAL]),
    }  # fmt: skip
    tokens = torch.randint(
        0, args.vocab_size, (cli.batch, cli.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    runs, facts = {}, {}
    for name, (choices, peak) in fixed.items():
        plan = em.plan_to_budget(cfg, 1, peak, costs=[costs])
        auto = ActivationCheckpoint(mode="auto", auto_plan=plan.spec)
        runs[name] = ModeRun(build_model(args, MODES[name]), tokens)
        runs[f"auto at {name}'s peak"] = ModeRun(build_model(args, auto), tokens)
        facts[name] = (name, peak, costs.recompute_flops(choices))
        facts[f"auto at {name}'s peak"] = (
            plan.spec,
            plan.ranks[""]["measured"],
            plan.ranks[""]["recompute_flops"],
        )
    for run in runs.values():
        for _ in range(cli.warmup):
            run.step(record=False)
    _timed_rounds(runs, cli)
    lines = [
        f"Llama 3 debugmodel, batch {cli.batch} x {cli.seq_len}, fp32, "
        f"CPU ({torch.get_num_threads()} threads), median of {cli.rounds * cli.steps_per_round} steps, "
        f"torch {torch.__version__}; peaks and FLOPs from the memory estimator (the trainer's step); "
        f"recompute priced at {tflops:.3f} TFLOP/s and {gbps:.1f} GB/s (this CPU)",
        "",
        "| run | blocks | step peak MiB | recompute GFLOP / step | step (ms) | time vs the fixed mode |",
        "|---|---|---|---|---|---|",
    ]
    for name in fixed:
        base = statistics.median(runs[name].times)
        for row in (name, f"auto at {name}'s peak"):
            blocks, peak, flops = facts[row]
            step = statistics.median(runs[row].times)
            cells = [
                blocks,
                f"{peak / 2**20:.1f}",
                f"{flops / 1e9:.2f}",
                f"{1000 * step:.0f}",
                f"{step / base:.3f}",
            ]
            lines.append(_row(row, cells))
    return lines


HOST_CHOICES = ("none", "regions", "op", "op_all_mm", "full")


def host_cost_table(cli) -> list[str]:
    """Mode "auto"'s host prices, fitted: per block choice, the host time per layer over no AC
    (the debug model at table 1's batch and seq_len, which should be tiny so that kernels cost
    next to nothing), beside the ops and region reruns `RecomputeCost` counts for it."""
    args = replace(llama3_flavors["debugmodel"], max_seq_len=cli.seq_len)
    tokens = torch.randint(
        0, args.vocab_size, (cli.batch, cli.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    plans = {
        c: ActivationCheckpoint(mode="auto", auto_plan=f"{c}:0-{args.n_layers - 1}") for c in HOST_CHOICES
    }
    runs = {c: ModeRun(build_model(args, ac), tokens) for c, ac in plans.items()}
    counts = {}
    for choice, run in runs.items():
        blocks = {int(name): block for name, block in run.model.layers.named_children()}
        with RecomputeCost(blocks, in_selective_checkpoint) as cost:
            run.step(record=False)
        host_ops = sum(cost.ops.values()) + sum(cost.sac_ops.values())
        counts[choice] = (host_ops / args.n_layers, sum(cost.runs.values()) / args.n_layers)
        for _ in range(cli.warmup):
            run.step(record=False)
    _timed_rounds(runs, cli)
    base = statistics.median(runs["none"].times)
    per_layer_ms = {c: 1e3 * (statistics.median(runs[c].times) - base) / args.n_layers for c in HOST_CHOICES}
    rows = [c for c in HOST_CHOICES if c != "none"]
    (us_per_op, us_per_rerun), *_ = np.linalg.lstsq(
        np.array([counts[c] for c in rows]), np.array([1e3 * per_layer_ms[c] for c in rows]), rcond=None
    )
    default = ActivationCheckpoint()
    lines = [
        f"Llama 3 debugmodel, batch {cli.batch} x {cli.seq_len}, fp32, CPU ({torch.get_num_threads()} "
        f"threads), median of {cli.rounds * cli.steps_per_round} steps, torch {torch.__version__}",
        "",
        "| choice | host ops / layer | reruns / layer | measured ms / layer over none | fitted model | "
        "model at the defaults |",
        "|---|---|---|---|---|---|",
    ]
    for c in rows:
        ops, reruns = counts[c]
        fitted = (ops * us_per_op + reruns * us_per_rerun) / 1e3
        at_default = (ops * default.auto_host_us_per_op + reruns * default.auto_host_us_per_rerun) / 1e3
        lines.append(_row(c, [f"{ops:.0f}", f"{reruns:.0f}", f"{per_layer_ms[c]:.2f}", f"{fitted:.2f}",
                              f"{at_default:.2f}"]))  # fmt: skip
    lines.append(
        f"\nFitted: {us_per_op:.1f} µs per op, {us_per_rerun:.0f} µs per rerun (defaults "
        f"auto_host_us_per_op {default.auto_host_us_per_op:g}, auto_host_us_per_rerun "
        f"{default.auto_host_us_per_rerun:g})."
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tables", default="1,2,3,4,5", help="which tables, e.g. 3 or 1,2")
    cli = parser.parse_args()
    tables = {"2": block_8b_table, "1": lambda: debug_model_table(cli), "3": lambda: compiled_table(cli),
              "4": lambda: auto_table(cli), "5": lambda: host_cost_table(cli)}  # fmt: skip
    wanted = [t for t in ("2", "1", "3", "4", "5") if t in cli.tables.split(",")]
    for index, table in enumerate(wanted):
        print(("\n" if index else "") + "\n".join(tables[table]()), flush=True)


if __name__ == "__main__":
    main()
