"""Op-SAC under tensor parallelism: peak memory per rank with the sequence-parallel all-gathers
recomputed (the default) and saved, side by side, from the memory estimator (FakeTensorMode:
nothing is allocated, so an 8-GPU layout is measured on a laptop).

Saving them spares two all-gathers per block in backward (tests/integration/test_parallelism.py
counts them); this prints what that costs in memory.

    python benchmarks/op_sac_tp_all_gather.py [--config llama3_8b.toml] [--ngpu 8] [--tp 8]
        [--seq-len 8192] [--local-batch-size 1]
"""

import argparse
import importlib.util
from pathlib import Path

import torchtitan.models.llama3.parallelize as llama3_parallelize
from torchtitan.config.manager import parse_args
from torchtitan.distributed.activation_checkpoint import TP_ALL_GATHER_OPS

ROOT = Path(__file__).resolve().parents[1]
GiB = 1024**3


def _estimator():
    spec = importlib.util.spec_from_file_location("estimate_memory", ROOT / "scripts" / "estimate_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="llama3_8b.toml")
    parser.add_argument("--ngpu", type=int, default=8)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--local-batch-size", type=int, default=1)
    args = parser.parse_args()
    cfg = parse_args(["--config", args.config, "--parallelism.tensor_parallel_degree", str(args.tp),
                      "--training.seq_len", str(args.seq_len), "--training.local_batch_size",
                      str(args.local_batch_size), "--activation_checkpoint.mode", "selective",
                      "--activation_checkpoint.selective_ac_option", "op"], env={})  # fmt: skip
    estimator = _estimator()
    default_list = llama3_parallelize.LLAMA3_SAVE_LIST
    results = {}
    for label, save_list in {
        "recomputed (default)": default_list,
        "saved": default_list | TP_ALL_GATHER_OPS,
    }.items():
        llama3_parallelize.LLAMA3_SAVE_LIST = save_list
        results[label] = estimator.measure(cfg, args.ngpu)
    llama3_parallelize.LLAMA3_SAVE_LIST = default_list

    print(f"op-SAC, {estimator.describe(cfg, args.ngpu)}\n")
    # The last column is not measured here: test_parallelism's TP collective counts assert it.
    print("| SP all-gathers | peak GiB per rank | activations GiB | backward all-gathers per block, tested |")
    print("|---|---|---|---|")
    for label, rows in results.items():
        regathers = 2 if label.startswith("recomputed") else 0
        print(
            f"| {label} | {rows[estimator.TOTAL] / GiB:.2f} | {rows['activations'] / GiB:.2f} | {regathers} |"
        )
    saved, recomputed = (results[k][estimator.TOTAL] for k in ("saved", "recomputed (default)"))
    print(f"\nrecomputed / saved peak: {recomputed / saved:.3f}")


if __name__ == "__main__":
    main()
