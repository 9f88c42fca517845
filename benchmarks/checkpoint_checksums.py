"""What checkpoint checksums cost: DCP save and load of a large model state, with and without.

    python benchmarks/checkpoint_checksums.py [--flavor 1B] [--dtype float32] [--repeats 4] [--folder DIR]

Builds the state dict of a Llama 3 flavor (random values in `--dtype`; the weights' shapes are
the flavor's), then in one process, side by side, for each of `--repeats` rounds:

    save  dcp.save with DCP's FileSystemWriter, then with `ChecksummedWriter` (which also
          hashes each file it wrote and writes the manifests)
    load  dcp.load alone, then the checksum verification followed by dcp.load (as a resume does)

and prints the median seconds, the ratio and the bytes per second. The files are fsynced (DCP's
default) and read back while still in the page cache, as on a resume right after a save; from a
cold cache or a parallel file system the verification reads each file once more.
"""

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.components.checkpoint_checksums import ChecksummedWriter, verify_share  # noqa: E402
from torchtitan.models import get_train_spec  # noqa: E402
from torchtitan.tools.dtypes import TORCH_DTYPES  # noqa: E402


def model_state(flavor: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Llama 3 `flavor`'s parameters as plain tensors of random values."""
    spec = get_train_spec("llama3")
    meta = spec.build_meta_model(spec.get_flavor(flavor), dtype)
    generator = torch.Generator().manual_seed(0)
    return {n: torch.rand(p.shape, dtype=dtype, generator=generator) for n, p in meta.named_parameters()}


def _timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def one_round(state: dict, folder: Path, checksums_first: bool) -> dict[str, float]:
    """Seconds of each step, saved into and loaded from `folder` (removed afterwards); the
    rounds alternate which save and load goes first, so that neither always meets a cache
    the other warmed."""
    plain, summed = folder / "plain", folder / "summed"
    saves = {
        "save": lambda: dcp.save(state, checkpoint_id=str(plain)),
        "save + checksums": lambda: dcp.save(state, storage_writer=ChecksummedWriter(summed)),
    }
    loads = {
        "load": lambda: dcp.load(state, checkpoint_id=str(plain)),
        "verify + load": lambda: (verify_share(summed, 0, 1), dcp.load(state, checkpoint_id=str(summed))),
        "verify alone": lambda: verify_share(summed, 0, 1),
    }

    def order(keys):
        return sorted(keys, key=lambda key: ("checksums" in key or "verify" in key) != checksums_first)

    seconds = {key: _timed(saves[key]) for key in order(saves)}
    seconds |= {key: _timed(loads[key]) for key in order(loads)}
    shutil.rmtree(folder)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--dtype", default="float32", choices=sorted(TORCH_DTYPES))
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)

    state = {"model": model_state(args.flavor, TORCH_DTYPES[args.dtype])}
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    params = sum(t.numel() for t in state["model"].values())
    root = Path(args.folder or tempfile.mkdtemp(prefix="checksum-bench-"))
    times = {key: [] for key in ("save", "save + checksums", "load", "verify + load", "verify alone")}
    try:
        for round_ in range(args.repeats):
            for key, seconds in one_round(state, root / f"round-{round_}", round_ % 2 == 1).items():
                times[key].append(seconds)
    finally:
        if args.folder is None:
            shutil.rmtree(root, ignore_errors=True)

    median = {key: statistics.median(values) for key, values in times.items()}
    print(f"Llama 3 {args.flavor} weights: {params / 1e9:.2f}B parameters, {nbytes / 2**30:.2f} GiB in "
          f"{args.dtype}; {args.repeats} round(s), median; torch {torch.__version__}")  # fmt: skip
    print()
    print("| step | seconds | GiB/s | vs without checksums |")
    print("|---|---|---|---|")
    baseline = {"save": "save", "save + checksums": "save", "load": "load", "verify + load": "load",
                "verify alone": "load"}  # fmt: skip
    for key, seconds in median.items():
        ratio = seconds / median[baseline[key]]
        print(f"| {key} | {seconds:.2f} | {nbytes / 2**30 / seconds:.2f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
