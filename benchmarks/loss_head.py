"""The chunked output head and loss (`training.loss_chunks`): memory at a large model's head, and
time on the debug model, per chunk count, side by side in one run.

    python benchmarks/loss_head.py [--chunks 1 4 16 64 0] [--seq-len 8192] [--flavor 8B] \\
        [--rounds 5] [--steps-per-round 4] [--repeats 20]

`--chunks 0` is the default setting: as many chunks as keep each chunk's fp32 logits within
64 MiB (`auto_loss_chunks`): 64 for Llama 3 8B at 8192 tokens, 1 for the debug model.

Memory: forward and backward of Llama 3 FLAVOR's final norm output through the output projection
and cross-entropy (`ChunkedLoss`), batch 1 x SEQ_LEN tokens, in bf16 as FSDP's mixed precision
gathers it, run under `FakeTensorMode` (nothing is allocated) and tracked by PyTorch's
MemTracker, on both paths: fused (`LinearCrossEntropy`, what a plain linear head runs) and
generic (a checkpointed region per chunk, what a vocabulary-sharded head under loss
parallelism runs). "head peak" is what the head holds at its peak above its inputs (the hidden
states, the weight, the labels): the logits and their gradients, the hidden states' gradient,
and the output weight's gradient (vocab x dim in bf16: 0.98 GiB at 8B). The generic path sums
the chunks' weight gradients out of place, so three weight-gradient-sized buffers are live at
once; the fused path adds them into one.

Time: the debug model's training step (`debug_model.toml` as shipped: 8 x 256 tokens, op-SAC,
fp32), one `Trainer` in this process whose `ChunkedLoss` switches chunk count between rounds,
the chunk counts interleaved so that drift in the machine's speed falls on all of them alike
(median round); and the debug model's head alone (forward and backward) on the fused path,
interleaved the same way.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402

from torchtitan.components.loss import cross_entropy_loss  # noqa: E402
from torchtitan.components.loss_head import ChunkedLoss, auto_loss_chunks  # noqa: E402
from torchtitan.config.manager import parse_args  # noqa: E402
from torchtitan.models.llama3 import llama3_flavors  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402
from torchtitan.train import Trainer  # noqa: E402

GIB = 2**30


def head_peak_bytes(flavor: str, seq_len: int, chunks: int, fused: bool) -> int:
    """Bytes the head holds at its peak above its inputs, forward and backward, under fake tensors."""
    args = llama3_flavors[flavor]
    with FakeTensorMode():
        weight = torch.empty(args.vocab_size, args.dim, dtype=torch.bfloat16, requires_grad=True)
        hidden = torch.empty(1, seq_len, args.dim, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.zeros(1, seq_len, dtype=torch.long)
        tracker = MemTracker()
        tracker.track_external(weight, hidden, labels)
        # A function, not a Linear: MemTracker refuses a module called more than once per step.
        project = lambda h: F.linear(h, weight)  # noqa: E731
        with tracker:
            before = tracker.get_tracker_snapshot("current")
            ChunkedLoss(cross_entropy_loss, chunks, fused)(project, hidden, labels, weight).backward()
            peak = tracker.get_tracker_snapshot("peak")
    device = next(iter(peak))
    return peak[device]["Total"] - before.get(device, {}).get("Total", 0)


def step_seconds(chunk_counts: list[int], rounds: int, steps_per_round: int, folder: str) -> dict[int, float]:
    """Median step of the debug model's trainer per chunk count, rounds interleaved in one process."""
    argv = ["--config", "debug_model.toml", "--metrics.log_freq", "1000000", "--training.steps", "1",
            "--lr_scheduler.warmup_steps", "0", "--job.dump_folder", folder]  # fmt: skip
    trainer = Trainer(parse_args(argv, env={}))
    times: dict[int, list[float]] = {c: [] for c in chunk_counts}
    try:
        for round_ in range(rounds + 1):
            for chunks in chunk_counts:
                trainer.loss_fn.chunks = chunks
                trainer.job_config.training.steps = trainer.step + steps_per_round
                start = time.perf_counter()
                trainer.train()
                if round_:  # the first round warms up
                    times[chunks].append((time.perf_counter() - start) / steps_per_round)
    finally:
        trainer.close()
    return {c: statistics.median(t) for c, t in times.items()}


def head_seconds(chunk_counts: list[int], repeats: int) -> dict[int, float]:
    """Median forward + backward of the debug model's head (8 x 256 tokens, fp32) per chunk count."""
    args = llama3_flavors["debugmodel"]
    torch.manual_seed(0)
    output = torch.nn.Linear(args.dim, args.vocab_size, bias=False)
    hidden = torch.randn(8, 256, args.dim, requires_grad=True)
    labels = torch.randint(0, args.vocab_size, (8, 256))
    times: dict[int, list[float]] = {c: [] for c in chunk_counts}
    for repeat in range(repeats + 1):
        for chunks in chunk_counts:
            start = time.perf_counter()
            ChunkedLoss(cross_entropy_loss, chunks)(output, hidden, labels, output.weight).backward()
            if repeat:  # the first round warms up
                times[chunks].append(time.perf_counter() - start)
    return {c: statistics.median(t) for c, t in times.items()}


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16, 64, 0])
    parser.add_argument("--flavor", default="8B")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    cli = parser.parse_args()
    if cli.chunks[0] != 1:
        parser.error("--chunks must start with 1, the unchunked head every ratio is taken against")
    init_logger()
    fused = {c: head_peak_bytes(cli.flavor, cli.seq_len, c, fused=True) for c in cli.chunks}
    generic = {c: head_peak_bytes(cli.flavor, cli.seq_len, c, fused=False) for c in cli.chunks}
    heads = head_seconds(cli.chunks, cli.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        steps = step_seconds(cli.chunks, cli.rounds, cli.steps_per_round, tmp)
    vocab = llama3_flavors[cli.flavor].vocab_size
    print(f"\nHead peak: Llama 3 {cli.flavor}, 1 x {cli.seq_len} tokens, bf16, FakeTensorMode. "
          f"Time: debug model, 8 x 256 tokens, fp32, {torch.__version__}.\n")  # fmt: skip
    print(f"| loss_chunks | chunks, {cli.flavor} | fused head peak GiB | vs 1 | generic head peak GiB | vs 1 "
          "| chunks, debug | debug head fwd+bwd ms | vs 1 | debug step ms | vs 1 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    debug_vocab, debug_tokens = llama3_flavors["debugmodel"].vocab_size, 8 * 256
    for c in cli.chunks:
        at_head, at_debug = (
            c or auto_loss_chunks(cli.seq_len, vocab),
            c or auto_loss_chunks(debug_tokens, debug_vocab),
        )
        cells = [f"{at_head}", f"{fused[c] / GIB:.3f}", f"{fused[c] / fused[1]:.3f}",
                 f"{generic[c] / GIB:.3f}", f"{generic[c] / generic[1]:.3f}", f"{at_debug}",
                 f"{1000 * heads[c]:.2f}", f"{heads[c] / heads[1]:.3f}",
                 f"{1000 * steps[c]:.1f}", f"{steps[c] / steps[1]:.3f}"]  # fmt: skip
        print(f"| {c} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
