"""Context parallelism through the real trainer and the estimator's tracker: step time and
per-rank activation memory against one process, at growing sequence lengths.

    python benchmarks/context_parallel.py [--cp 2] [--seq-lens 1024 2048 4096] [--ac none] \\
        [--methods allgather_kv ulysses] [-- EXTRA OVERRIDES]

Per sequence length: one process (CP 1), then each method on `--cp` processes (torchrun, one
thread each), the same config and global batch. "step ms" is the trainer's median step after
the warm-up steps. "activations MiB" is rank 0's "activations" row of one step run on real
tensors under PyTorch's MemTracker (`scripts/estimate_memory.py`'s tracked step, each rank in
its own process), so it counts what the step holds, not the allocator's pools.

"attention work, max/min rank" is the load balance: per rank, the keys its queries attend under
the causal mask, the busiest rank over the idlest. It comes from the positions each rank holds
(`token_positions`), not from a timer: the CPU runs masks as dense SDPA masks, which compute
every score whatever the mask, so only a GPU's flex kernel, which skips masked blocks, turns
balance into time.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchtitan.distributed.context_parallel import token_positions  # noqa: E402

METHODS = ["allgather_kv", "ulysses"]


def _run(program: list[str], nproc: int, timeout: float) -> subprocess.CompletedProcess:
    """`program` (a script and its arguments, or -m and a module) on `nproc` ranks."""
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend",
                "c10d", "--rdzv_endpoint=localhost:0"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(launcher + program, capture_output=True, text=True, env=env, timeout=timeout)


def _config_argv(cli, seq_len: int, cp: int, method: str) -> list[str]:
    argv = [
        "--config",
        cli.config,
        "--training.seq_len",
        str(seq_len),
        "--training.local_batch_size",
        "1",
        "--activation_checkpoint.mode",
        cli.ac,
        "--training.mixed_precision_param",
        "float32",
    ]
    if cp > 1:
        p = "--parallelism.context_parallel_"
        argv += [p + "degree", str(cp), p + "method", method]
    return argv + cli.extra


def step_seconds(cli, seq_len: int, cp: int, method: str, folder: Path) -> float | str:
    """The trainer's median step time after warm-up, or why there is none."""
    run = ["--training.steps", str(cli.steps), "--metrics.log_freq", "1", "--job.dump_folder", str(folder)]
    argv = _config_argv(cli, seq_len, cp, method) + run
    proc = _run(["-m", "torchtitan.train", *argv], cp, cli.timeout)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return f"failed (exit {proc.returncode})"
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return statistics.median([r["step_seconds"] for r in records if "step_seconds" in r][cli.warmup :])


def activation_bytes(cli, seq_len: int, cp: int, method: str) -> int | str:
    """Rank 0's activations at the peak of one tracked step on real tensors."""
    proc = _run([__file__, "--worker", *_config_argv(cli, seq_len, cp, method)], cp, cli.timeout)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return f"failed (exit {proc.returncode})"
    return json.loads(proc.stdout.strip().splitlines()[-1])["activations"]


def attention_imbalance(seq_len: int, cp: int, balancer: str) -> float:
    """The busiest rank's causal attention work over the idlest's."""
    work = [sum(p + 1 for p in token_positions(seq_len, cp, r, balancer)) for r in range(cp)]
    return max(work) / min(work)


def worker(argv: list[str]) -> None:
    """One rank of `activation_bytes`: the estimator's tracked step on real tensors."""
    import importlib.util

    import torch
    import torch.distributed as dist

    from torchtitan.config import parse_args
    from torchtitan.distributed.parallel_dims import ParallelDims

    spec = importlib.util.spec_from_file_location("estimate_memory", ROOT / "scripts" / "estimate_memory.py")
    estimator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(estimator)
    cfg = parse_args(argv, env={})
    dist.init_process_group("gloo")
    dims = ParallelDims.from_config(cfg.parallelism, dist.get_world_size())
    dims.build_mesh("cpu")
    device = torch.device("cpu")
    model = estimator.build_model(cfg, dims, device)
    with estimator.gpu_norm_kernel():  # as the estimate's step runs
        step = estimator.tracked_step(cfg, model, dims, device, prepare=lambda m: m.init_weights())
    peak = estimator.breakdown(step)
    if dist.get_rank() == 0:
        print(json.dumps(peak))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="debug_model.toml")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--ac", default="none", help="activation_checkpoint.mode")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("extra", nargs="*", help="trainer overrides, after --")
    cli = parser.parse_args()
    print(f"{cli.config}, local batch 1, fp32, AC {cli.ac}; CP {cli.cp} against one process\n")
    print(
        "| seq_len | layout | step ms | vs CP 1 | activations MiB | vs CP 1 | attention work, max/min rank |"
    )
    print("|---|---|---|---|---|---|---|")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for seq_len in cli.seq_lens:
            base_s = step_seconds(cli, seq_len, 1, "", Path(tmp) / f"one{seq_len}")
            base_b = activation_bytes(cli, seq_len, 1, "")
            if isinstance(base_s, str) or isinstance(base_b, str):
                print(f"| {seq_len} | CP 1 | {base_s} | | {base_b} | | |")
                failed = True
                continue
            print(f"| {seq_len} | CP 1 | {1000 * base_s:.0f} | 1.00 | {base_b / 2**20:.1f} | 1.00 | 1.00 |")
            for method in cli.methods:
                seconds = step_seconds(cli, seq_len, cli.cp, method, Path(tmp) / f"{method}{seq_len}")
                held = activation_bytes(cli, seq_len, cli.cp, method)
                if isinstance(seconds, str) or isinstance(held, str):
                    print(f"| {seq_len} | CP {cli.cp}, {method} | {seconds} | | {held} | | |")
                    failed = True
                    continue
                balance = f"{attention_imbalance(seq_len, cli.cp, 'headtail'):.2f}"
                balance += f" (contiguous: {attention_imbalance(seq_len, cli.cp, 'none'):.2f})"
                cells = [f"{1000 * seconds:.0f}", f"{seconds / base_s:.2f}", f"{held / 2**20:.1f}",
                         f"{held / base_b:.2f}", balance]  # fmt: skip
                print(f"| {seq_len} | CP {cli.cp}, {method} | " + " | ".join(cells) + " |")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
