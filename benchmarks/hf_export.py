"""The Hugging Face export (`checkpoint.last_save_in_hf`) from every rank against the earlier
path through rank 0: time and peak host memory per rank, per number of ranks, in one run.

    python benchmarks/hf_export.py [--ranks 1 2 4] [--layers 2] [--flavor 8B] [--dtype bfloat16]

The model is Llama 3 FLAVOR's shapes with LAYERS blocks (8B's embedding and output, 2 blocks:
2.9 GB in bf16), FSDP-sharded over the ranks (gloo, CPU), its weights filled with noise. Each
(path, ranks) runs in fresh processes (`torchrun`), so that each peak is the path's own:

- all ranks: every rank writes its shards through DCP's HuggingFaceStorageWriter, then every
  rank consolidates some of the output files (`hf_distributed_export`).
- rank 0: each tensor is gathered whole and kept on rank 0, which writes every file
  (`whole_model_state` + `write_hf_export`).

"export s" is the slowest rank's wall time from the first barrier to the last. "peak MiB" is
the largest rise, over the ranks, of a rank's peak resident memory during the export (its
shards of the model are already resident before).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PATHS = ("all ranks", "rank 0")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def worker(cli) -> None:
    """One (path, ranks) export under torchrun; rank 0 prints a JSON line."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchtitan.components.checkpoint_hf_export import whole_model_state, write_hf_export
    from torchtitan.components.hf_distributed_export import write_hf_export_from_all_ranks
    from torchtitan.models.llama3 import llama3_flavors
    from torchtitan.models.llama3.model import Transformer
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    args = replace(llama3_flavors[cli.flavor], n_layers=cli.layers)
    with torch.device("meta"):
        model = Transformer(args)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    dtype = getattr(torch, cli.dtype)
    model.to(dtype)
    generator = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_(generator=generator)
    adapter = Llama3StateDictAdapter(args)
    folder = Path(cli.folder) / "export"
    dist.barrier()
    before, start = _peak_mib(), time.perf_counter()
    if cli.path == "all ranks":
        write_hf_export_from_all_ranks(folder, model, adapter, cli.dtype)
    else:
        whole = whole_model_state(model, cli.dtype)
        if rank == 0:
            write_hf_export(folder, whole, adapter, cli.dtype)
        del whole
    dist.barrier()
    seconds = time.perf_counter() - start
    rise = torch.tensor([_peak_mib() - before, seconds])
    gathered = [torch.zeros(2) for _ in range(world)] if rank == 0 else None
    dist.gather(rise, gathered, dst=0)
    if rank == 0:
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        peak = max(g[0].item() for g in gathered)
        print(json.dumps({"seconds": max(g[1].item() for g in gathered), "peak_mib": peak, "bytes": size}))
    dist.destroy_process_group()


def run(cli, path: str, ranks: int) -> dict:
    with tempfile.TemporaryDirectory(dir=cli.tmp) as folder:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   __file__, "--worker", "--path", path, "--folder", folder, "--layers", str(cli.layers),
                   "--flavor", cli.flavor, "--dtype", cli.dtype]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return {"error": f"exit {done.returncode}"}
        return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--flavor", default="8B")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tmp", default=None, help="where the exports are written (default: the system's)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.worker:
        worker(cli)
        return
    results = {(path, ranks): run(cli, path, ranks) for ranks in cli.ranks for path in PATHS}
    import torch

    print(f"\nLlama 3 {cli.flavor} shapes, {cli.layers} blocks, {cli.dtype}, FSDP over gloo on the CPU, "
          f"torch {torch.__version__}\n")  # fmt: skip
    print("| ranks | path | export s | peak MiB per rank | GB written |")
    print("|---|---|---|---|---|")
    for (path, ranks), r in results.items():
        if "error" in r:
            print(f"| {ranks} | {path} | {r['error']} | | |")
            continue
        print(f"| {ranks} | {path} | {r['seconds']:.1f} | {r['peak_mib']:.0f} | {r['bytes'] / 1e9:.2f} |")


if __name__ == "__main__":
    main()
