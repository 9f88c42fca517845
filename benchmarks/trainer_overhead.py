"""Trainer overhead: steady-state step time of `Trainer.train` vs a bare PyTorch loop.

Both train the same model (same flavor, init, batch shape, AdamW settings, AC off) in one
process, alternating rounds so that machine noise hits both alike. Prints a table with the
median step time of each and their ratio.

    python benchmarks/trainer_overhead.py [--rounds 5] [--steps-per-round 10] [--seq-len 256]
        [--batch 8] [--flavor debugmodel]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from torchtitan.config.manager import parse_args
from torchtitan.distributed.grad_norm import clip_grad_norm_
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.tools.logging import init_logger
from torchtitan.train import Trainer


def build_trainer(args) -> Trainer:
    config = parse_args(
        [
            "--model.flavor", args.flavor,
            "--training.seq_len", str(args.seq_len),
            "--training.local_batch_size", str(args.batch),
            "--training.mixed_precision_param", "float32",
            "--activation_checkpoint.mode", "none",
            "--metrics.log_freq", "1000000",
            "--lr_scheduler.warmup_steps", "0",
            "--training.steps", "1",
            "--job.dump_folder", "/tmp/torchtitan_bench",
        ],
        env={},
    )  # fmt: skip
    return Trainer(config)


class BareLoop:
    """The minimum a hand-written loop does: forward, fp32 CE, backward, clip, AdamW."""

    def __init__(self, trainer: Trainer, args):
        cfg = trainer.job_config
        with torch.device("meta"):
            self.model = Transformer(trainer.model_args)
        self.model.to_empty(device=trainer.device)
        torch.manual_seed(0)
        self.model.init_weights()
        o, kernel = cfg.optimizer, trainer.optimizer.defaults  # the trainer's kernel: fused or foreach
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
            weight_decay=o.weight_decay, fused=kernel["fused"], foreach=kernel["foreach"],
        )  # fmt: skip
        vocab = llama3_flavors[args.flavor].vocab_size
        self.tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1), device=trainer.device)
        self.max_norm = cfg.training.max_norm

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        inputs, labels = self.tokens[:, :-1], self.tokens[:, 1:]
        logits = self.model(inputs)
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.optimizer.step()


def _synchronize() -> None:
    """Waits for the device's queued work, so that a timed round is not charged the last one's."""
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def time_trainer(trainer: Trainer, steps: int) -> float:
    trainer.job_config.training.steps = trainer.step + steps
    _synchronize()
    start = time.perf_counter()
    trainer.train()
    _synchronize()
    return (time.perf_counter() - start) / steps


def time_bare(loop: BareLoop, steps: int) -> float:
    _synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        loop.step()
    _synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--flavor", default="debugmodel")
    args = parser.parse_args()
    init_logger()
    trainer = build_trainer(args)
    bare = BareLoop(trainer, args)
    time_trainer(trainer, 3)  # warm-up: allocator, dataloader, first-step setup
    time_bare(bare, 3)
    trainer_times, bare_times = [], []
    for _ in range(args.rounds):
        trainer_times.append(time_trainer(trainer, args.steps_per_round))
        bare_times.append(time_bare(bare, args.steps_per_round))
    t, b = statistics.median(trainer_times), statistics.median(bare_times)
    print(f"\nllama3 {args.flavor}, batch {args.batch} x {args.seq_len}, {trainer.device.type}, "
          f"{args.rounds} rounds x {args.steps_per_round} steps, torch {torch.__version__}")  # fmt: skip
    print("| loop | median step (ms) |\n|---|---|")
    print(f"| bare PyTorch | {1000 * b:.1f} |\n| torchtitan Trainer | {1000 * t:.1f} |")
    print(f"| ratio trainer / bare | {t / b:.3f} |")
    trainer.close()


if __name__ == "__main__":
    main()
