"""Building a flex-attention BlockMask: eager `create_block_mask` vs the compiled one the model uses.

For each mask type, builds the mask of one batch both ways on one device and prints a table: the
first call (compilation included), the median of the following calls, and the peak memory a build
adds above what was allocated before it. The two block masks are checked equal first.

    python benchmarks/block_mask_build.py [--device cpu] [--batch 2] [--seq-len 8192] [--repeats 5]
        [--mask-type block_causal ...]

Peak memory is the CUDA caching allocator's peak on CUDA; on CPU it is the process's peak
resident set (VmHWM, reset through /proc/self/clear_refs before each build), so it needs Linux.
"""

import argparse
import statistics
import sys
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask

from torchtitan.models.attention import MASK_TYPES, build_block_mask, build_mask_mod

MASK_ARGS = {"eos_id": 0, "sliding_window": 1024, "chunk_size": 2048}


def _resident_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _reset_peak(device: torch.device) -> int:
    """Reset the peak tracker; return the bytes held now."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return _resident_kib("VmRSS") * 1024


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _resident_kib("VmHWM") * 1024


def _timed_build(build, device: torch.device):
    held = _reset_peak(device)
    start = time.perf_counter()
    block_mask = build()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return block_mask, seconds, _peak(device) - held


def measure(build, device: torch.device, repeats: int) -> dict:
    block_mask, first_s, _ = _timed_build(build, device)
    times, peaks = [], []
    for _ in range(repeats):
        _, seconds, peak = _timed_build(build, device)
        times.append(seconds)
        peaks.append(peak)
    return {"mask": block_mask, "first_s": first_s,
            "median_ms": 1e3 * statistics.median(times), "peak_mib": max(peaks) / 2**20}  # fmt: skip


def compare_builds(tokens: torch.Tensor, mask_type: str, device: torch.device, repeats: int) -> str:
    """One table row: eager and compiled builds of ``mask_type``'s BlockMask for ``tokens``."""
    batch, seq_len = tokens.shape
    mask_mod = build_mask_mod(tokens, mask_type, **MASK_ARGS)
    mask_batch = batch if mask_type == "block_causal" else None

    def eager():
        return create_block_mask(mask_mod, mask_batch, None, seq_len, seq_len, device=device)

    def compiled():
        return build_block_mask(mask_mod, mask_batch, seq_len, device)

    results = []
    for name, build in (("eager", eager), ("compiled", compiled)):
        results.append(measure(build, device, repeats))
        # A run stopped at a time limit still says how far it got.
        print(f"{mask_type}, {name}: first build {results[-1]['first_s']:.2f} s", file=sys.stderr, flush=True)
    if not torch.equal(results[0]["mask"].to_dense(), results[1]["mask"].to_dense()):
        raise SystemExit(f"{mask_type}: the compiled BlockMask differs from the eager one")
    cells = [f"{r['first_s']:.2f} | {r['median_ms']:.1f} | {r['peak_mib']:.0f}" for r in results]
    return f"| {mask_type} | {' | '.join(cells)} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mask-type", action="append", choices=MASK_TYPES, help="repeatable; default: all")
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    # Documents of 1-1000 tokens: EOS (id 0) at about one position in 500.
    tokens = torch.randint(0, 500, (args.batch, args.seq_len), generator=generator).to(device)

    print(f"BlockMask build, batch {args.batch}, seq_len {args.seq_len}, on {device.type}; "
          f"torch {torch.__version__}")  # fmt: skip
    print("| mask | eager first s | eager median ms | eager peak MiB "
          "| compiled first s | compiled median ms | compiled peak MiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for mask_type in args.mask_type or MASK_TYPES:
        print(compare_builds(tokens, mask_type, device, args.repeats))


if __name__ == "__main__":
    main()
