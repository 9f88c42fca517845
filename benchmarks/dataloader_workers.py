"""How long a training step waits for its batch from a streamed dataset, by loader worker count.

Writes a folder of jsonl shards, streams it as `training.dataset` (the path a hub dataset takes:
read, tokenized with the bundled tokenizer and packed on the fly), and for each worker count
takes `--steps` batches with a stand-in for the step's compute (a sleep of `--step-ms`) between
them. Prints a table: the median and mean time `next()` blocked, and that wait as a share of
the step. The first batches, which include starting the workers, are left out.

    python benchmarks/dataloader_workers.py [--workers 0 1 2] [--steps 60] [--step-ms 100]
        [--seq-len 2048] [--batch 8] [--shards 4]
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from torchtitan.components.dataloader import build_text_dataloader
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import parse_args

WARMUP_BATCHES = 5
WORDS = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex a jovial sphinx".split()


def write_shards(folder: Path, shards: int, docs_per_shard: int = 400) -> None:
    folder.mkdir()
    for shard in range(shards):
        docs = [
            " ".join(WORDS[(shard + doc + i * 7) % len(WORDS)] for i in range(600 + doc % 400))
            for doc in range(docs_per_shard)
        ]
        (folder / f"part{shard}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


def measure(stream: str, tokenizer, workers: int, args) -> list[float]:
    cfg = parse_args(["--training.dataset", stream, "--training.seq_len", str(args.seq_len),
                      "--training.local_batch_size", str(args.batch),
                      "--training.dataloader_num_workers", str(workers)], env={})  # fmt: skip
    batches = iter(build_text_dataloader(cfg, tokenizer, 0, 1))
    waits = []
    for step in range(WARMUP_BATCHES + args.steps):
        started = time.perf_counter()
        next(batches)
        if step >= WARMUP_BATCHES:
            waits.append(time.perf_counter() - started)
        time.sleep(args.step_ms / 1000)
    return waits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-ms", type=float, default=100.0)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--shards", type=int, default=4)
    args = parser.parse_args()
    tokenizer = HuggingFaceTokenizer("torchtitan/assets/tokenizer")
    with tempfile.TemporaryDirectory() as tmp:
        stream = Path(tmp) / "stream"
        write_shards(stream, args.shards)
        print(f"batch {args.batch} x {args.seq_len + 1} tokens, step stand-in {args.step_ms:.0f} ms, "
              f"{args.steps} steps after {WARMUP_BATCHES}")  # fmt: skip
        print("| workers | median wait ms | mean wait ms | wait / (wait + step) |")
        print("|---|---|---|---|")
        for workers in args.workers:
            waits = measure(str(stream), tokenizer, workers, args)
            mean = statistics.mean(waits)
            share = mean / (mean + args.step_ms / 1000)
            print(f"| {workers} | {statistics.median(waits) * 1e3:.2f} | {mean * 1e3:.2f} | {share:.1%} |")


if __name__ == "__main__":
    main()
