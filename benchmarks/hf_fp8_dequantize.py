"""Dequantizing block-scaled fp8 weights on load: what one rank does per MoE layer of DeepSeek-V3.

Builds, on the CPU, random fp8 weights and scales with the shapes of the HF tensors one rank
reads of one MoE layer of a flavor (by default 671B under EP 32: its 8 routed experts, the
shared expert, attention and router), and times `dequantize_fp8` against a reference that
expands every scale to the weight's full size, the way a straightforward implementation does.
Prints one table; both results are checked equal first.

    python benchmarks/hf_fp8_dequantize.py [--flavor 671B] [--ep 32] [--repeats 3] [--threads N]
"""

import argparse
import math
import statistics
import time

import torch

from torchtitan.components.hf_io import DEFAULT_FP8_BLOCK, FP8_SCALE_SUFFIX, dequantize_fp8
from torchtitan.models import get_train_spec


def rank_share_of_one_moe_layer(flavor: str, ep: int) -> dict[str, torch.Size]:
    """HF key -> shape of the projection weights one EP rank reads of the last (MoE) layer."""
    spec = get_train_spec("deepseek_v3")
    args = spec.get_flavor(flavor)
    adapter = spec.state_dict_adapter(args)
    layer = f"layers.{args.n_layers - 1}."
    ours = {
        k: t
        for k, t in spec.build_meta_model(args, torch.float32).state_dict().items()
        if k.startswith(layer)
    }
    hf = adapter.to_hf(ours)
    experts = range(args.moe_args.num_experts // ep)
    return {
        key: hf[key].shape for key in adapter.experts_to_read(hf, experts) if key.endswith("_proj.weight")
    }


def fp8_checkpoint(shapes: dict[str, torch.Size], block) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for key, shape in shapes.items():
        tensors[key] = torch.randn(shape, generator=generator).to(torch.float8_e4m3fn)
        scale_shape = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
        tensors[key + FP8_SCALE_SUFFIX] = torch.rand(scale_shape, generator=generator) + 0.5
    return tensors


def dequantize_by_full_size_scales(tensors: dict[str, torch.Tensor], block) -> dict[str, torch.Tensor]:
    """The reference: every scale expanded to the weight's full size, then one multiply."""
    out = {}
    for key, weight in tensors.items():
        if key.endswith(FP8_SCALE_SUFFIX):
            continue
        scale = tensors[key + FP8_SCALE_SUFFIX]
        rows, columns = weight.shape
        full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :columns]
        out[key] = weight.float() * full
    return out


def median_seconds(fns: dict, repeats: int) -> dict:
    """Each function's median time, the functions taking turns, so that drift in the machine's
    load falls on both alike."""
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="671B")
    parser.add_argument("--ep", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    cli = parser.parse_args()
    if cli.threads:
        torch.set_num_threads(cli.threads)
    block = DEFAULT_FP8_BLOCK
    shapes = rank_share_of_one_moe_layer(cli.flavor, cli.ep)
    tensors = fp8_checkpoint(shapes, block)
    fp8_bytes = sum(s.numel() for s in shapes.values())
    ours, reference = dequantize_fp8(tensors, block), dequantize_by_full_size_scales(tensors, block)
    assert all(torch.equal(ours[key], reference[key]) for key in shapes)
    del ours, reference
    print(
        f"DeepSeek-V3 {cli.flavor}, one MoE layer's share of an EP {cli.ep} rank: {len(shapes)} fp8 "
        f"weights, {fp8_bytes / 2**30:.2f} GiB in fp8; {torch.get_num_threads()} threads; "
        f"median of {cli.repeats}"
    )
    print()
    print("| dequantization | seconds | GiB/s of fp8 read | float32 temporaries per weight |")
    print("|---|---|---|---|")
    methods = {
        "dequantize_fp8": lambda: dequantize_fp8(tensors, block),
        "full-size scales (reference)": lambda: dequantize_by_full_size_scales(tensors, block),
    }
    temporaries = {
        "dequantize_fp8": "none besides the result (1 padded copy for ragged shapes)",
        "full-size scales (reference)": "2 (scales, weight)",
    }
    for name, took in median_seconds(methods, cli.repeats).items():
        print(f"| {name} | {took:.2f} | {fp8_bytes / 2**30 / took:.2f} | {temporaries[name]} |")


if __name__ == "__main__":
    main()
