"""Gradient accumulation across replicas: exchanging gradients once per step (the trainer's
behaviour) against once per micro-batch, side by side in one run.

The real Trainer runs DDP (`--layout ddp`, every rank a replica) or HSDP (`--layout hsdp`, 2
shards per replica) with `--micro-batches` per step. Rounds alternate between the two ways so
that machine noise hits both alike; rank 0 prints the median step time of each and their ratio.

    torchrun --nproc_per_node 2 benchmarks/gradient_accumulation_sync.py [--layout ddp]
        [--micro-batches 4] [--rounds 5] [--steps-per-round 3] [--section.key VALUE ...]
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from torchtitan import train as train_module
from torchtitan.config.manager import parse_args
from torchtitan.distributed.data_parallel import set_gradient_sync
from torchtitan.tools.logging import init_logger
from torchtitan.train import Trainer

WAYS = {
    "once per step (default)": set_gradient_sync,
    "every micro-batch": lambda model, parallel_dims, sync: set_gradient_sync(model, parallel_dims, True),
}


def build_trainer(args, rest: list[str]) -> Trainer:
    world = int(os.environ["WORLD_SIZE"])  # the Trainer joins the process group itself
    replicas = world if args.layout == "ddp" else world // 2
    shards = world // replicas
    config = parse_args(
        [
            "--training.seq_len", str(args.seq_len),
            "--training.local_batch_size", str(args.batch),
            "--training.global_batch_size", str(args.batch * world * args.micro_batches),
            "--parallelism.data_parallel_replicate_degree", str(replicas),
            "--parallelism.data_parallel_shard_degree", str(shards),
            "--training.mixed_precision_param", "float32",
            "--metrics.log_freq", "1000000",
            "--job.dump_folder", "/tmp/torchtitan_bench_accumulation",
            *rest,
        ],
        env={},
    )  # fmt: skip
    return Trainer(config)


def time_steps(trainer: Trainer, data_iter, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        loss, _, _ = trainer.train_step(data_iter)
    loss.item()
    dist.barrier()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=["ddp", "hsdp"], default="ddp")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    args, rest = parser.parse_known_args()
    init_logger()
    trainer = build_trainer(args, rest)
    data_iter = iter(trainer.dataloader)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for round_index in range(args.rounds + 1):
        for way, sync in WAYS.items():
            train_module.set_gradient_sync = sync
            seconds = time_steps(trainer, data_iter, args.steps_per_round)
            if round_index:  # round 0 warms up both
                times[way].append(seconds)
    train_module.set_gradient_sync = set_gradient_sync
    if dist.get_rank() == 0:
        medians = {way: statistics.median(t) for way, t in times.items()}
        dims = trainer.parallel_dims
        print(f"\n{trainer.job_config.model.name} {trainer.job_config.model.flavor}, {args.layout} "
              f"(dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard}), {args.micro_batches} "
              f"micro-batches of {args.batch} x {args.seq_len}, {trainer.device.type}, "
              f"{args.rounds} rounds x {args.steps_per_round} steps, torch {torch.__version__}")  # fmt: skip
        print("| gradients exchanged across replicas | median step (ms) |\n|---|---|")
        for way, median in medians.items():
            print(f"| {way} | {1000 * median:.1f} |")
        once, every = medians["once per step (default)"], medians["every micro-batch"]
        print(f"| ratio once / every | {once / every:.3f} |")
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
