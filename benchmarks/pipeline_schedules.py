"""Pipeline schedules through the real trainer: step time, bubble and peak memory per rank.

Runs the trainer once in one process and once per schedule on `--pp` processes (torchrun),
the same config and global batch, one thread per process, and prints one table of medians
after the warm-up steps:

    python benchmarks/pipeline_schedules.py [--pp 2] [--microbatches 8] [--ac none] \\
        [--schedules GPipe 1F1B ...] [-- EXTRA OVERRIDES]

Bubble, measured: the share of a pipelined step that is not the one-process step's work split
over the ranks, 1 - t(1 process) / (pp x t(step)). It counts the sends and receives as bubble
too. Theory: (pp - 1) / (v m + pp - 1) for m microbatches and v stages per rank (GPipe, 1F1B,
Interleaved1F1B); the zero-bubble schedules' depends on the cost of the weight-gradient pass
and is left blank. Memory is each rank's peak (allocated on an accelerator, RSS on the CPU);
rank r holds stage r (and stage 2pp-1-r under the V schedules, r + pp under the looped ones).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SCHEDULES = [
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
]
SINGLE_STAGE = {"GPipe", "1F1B"}
MEMORY_KEYS = ("memory/max_allocated_gib", "memory/max_rss_gib")


def _train(cli, folder: Path, nproc: int, extra: list[str]) -> list[list[dict]] | str:
    """Each rank's records after warm-up, or why the run gave none."""
    argv = ["--config", cli.config, "--training.steps", str(cli.steps),
            "--training.seq_len", str(cli.seq_len), "--training.local_batch_size", str(cli.microbatches),
            "--metrics.log_freq", "1", "--metrics.save_for_all_ranks", "--activation_checkpoint.mode", cli.ac,
            "--job.dump_folder", str(folder), *extra, *cli.extra]  # fmt: skip
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend",
                "c10d", "--rdzv_endpoint=localhost:0", "-m", "torchtitan.train"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(launcher + argv, capture_output=True, text=True, env=env, timeout=cli.timeout)
    except subprocess.TimeoutExpired:
        return f"stopped after {cli.timeout:.0f} s"
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return f"failed (exit {proc.returncode})"
    ranks = []
    for rank in range(nproc):
        lines = (folder / f"metrics_rank{rank}.jsonl").read_text().splitlines()
        ranks.append([r for r in map(json.loads, lines) if "step_seconds" in r][cli.warmup :])
    return ranks


def _seconds(ranks: list[list[dict]]) -> float:
    return statistics.median(r["step_seconds"] for r in ranks[0])


def _peak(records: list[dict]) -> float:
    key = next(k for k in MEMORY_KEYS if k in records[-1])
    return max(r[key] for r in records)


def theoretical_bubble(schedule: str, pp: int, microbatches: int) -> float | None:
    """(pp - 1) / (v m + pp - 1) for the schedules it describes; None for the zero-bubble ones."""
    per_rank = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2}.get(schedule)
    if per_rank is None:
        return None
    return (pp - 1) / (per_rank * microbatches + pp - 1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="debug_model.toml")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8, help="the local batch, in microbatches of 1")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ac", default="none", help="activation_checkpoint.mode")
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("extra", nargs="*", help="trainer overrides, after --")
    cli = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = _train(cli, Path(tmp) / "one", 1, [])
        if isinstance(base, str):
            raise SystemExit(f"the one-process run {base}")
        base_seconds = _seconds(base)
        run = f"{cli.config}, seq_len {cli.seq_len}, {cli.microbatches} microbatches of 1, AC {cli.ac}"
        one = f"one process: {1000 * base_seconds:.0f} ms/step, peak {_peak(base[0]):.2f} GiB"
        print(f"{run}, pp {cli.pp}; {one}\n")
        ranks_header = " | ".join(f"rank {r} GiB" for r in range(cli.pp))
        print(f"| schedule | step ms | vs 1 process | bubble, theory | bubble, measured | {ranks_header} |")
        print("|---" * (5 + cli.pp) + "|")
        failed = False
        for schedule in cli.schedules:
            extra = ["--parallelism.pipeline_parallel_degree", str(cli.pp),
                     "--parallelism.pipeline_parallel_schedule", schedule]  # fmt: skip
            ranks = _train(cli, Path(tmp) / schedule, cli.pp, extra)
            if isinstance(ranks, str):
                failed = True
                print(f"| {schedule} | {ranks} |" + " |" * (3 + cli.pp))
                continue
            seconds = _seconds(ranks)
            theory = theoretical_bubble(schedule, cli.pp, cli.microbatches)
            measured = 1 - base_seconds / (cli.pp * seconds)
            cells = [f"{1000 * seconds:.0f}", f"{seconds / base_seconds:.2f}",
                     "" if theory is None else f"{theory:.2f}", f"{measured:.2f}",
                     *(f"{_peak(records):.2f}" for records in ranks)]  # fmt: skip
            print(f"| {schedule} | " + " | ".join(cells) + " |")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
