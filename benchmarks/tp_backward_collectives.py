"""The collectives one backward pass issues under tensor parallelism, per debug model: how many
reduce-scatters and all-reduces, and how many elements they move. Counted, not timed, so the
CPU (gloo) gives the same table as a GPU. A whole-tokens x dim all-reduce moves twice a
reduce-scatter's bytes over a ring.

    torchrun --nproc_per_node 2 benchmarks/tp_backward_collectives.py [--seq-len 64] [--batch 2]
"""

import argparse
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import loss_context
from torchtitan.models import get_train_spec
from torchtitan.tools.op_counter import BACKWARD, OpCall, OpCounter, collectives

MODELS = [("llama3", "debugmodel"), ("qwen3", "debugmodel_moe"), ("deepseek_v3", "debugmodel")]
COUNTED = {"reduce_scatter_tensor": "reduce-scatter", "all_reduce": "all-reduce"}


def _backward_calls(name: str, flavor: str, tp: int, seq_len: int, batch: int) -> list[OpCall]:
    """The counted collectives that one backward of the model issues."""
    spec = get_train_spec(name)
    cfg = parse_args(["--model.name", name, "--model.flavor", flavor, "--training.seq_len", str(seq_len),
                      "--training.mixed_precision_param", "float32",
                      "--parallelism.tensor_parallel_degree", str(tp),
                      "--activation_checkpoint.mode", "none"], env={})  # fmt: skip
    with torch.device("meta"):
        model = spec.model_cls(spec.get_flavor(flavor).update_from_config(cfg))
    dims = ParallelDims(1, 1, tp, tp)
    dims.build_mesh("cpu")
    spec.parallelize_fn(model, dims, cfg, torch.device("cpu"))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    tokens = torch.randint(0, 2000, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    with OpCounter(collectives) as counter, loss_context(dims, cfg):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        counter.start_backward()
        loss.backward()
    return [call for call in counter.matching(phase=BACKWARD) if call.name in COUNTED]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    cli = parser.parse_args()
    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    rows = []
    for name, flavor in MODELS:
        backward = _backward_calls(name, flavor, tp, cli.seq_len, cli.batch)
        sizes = Counter((COUNTED[call.name], call.numel) for call in backward)
        calls = Counter(COUNTED[call.name] for call in backward)
        elements = Counter()
        for call in backward:
            elements[COUNTED[call.name]] += call.numel
        detail = ", ".join(f"{n} x {size:,}" for (_, size), n in sorted(sizes.items()))
        rows.append(
            f"| {name} {flavor} | {calls['reduce-scatter']} | {calls['all-reduce']} | "
            f"{elements['reduce-scatter']:,} | {elements['all-reduce']:,} | {detail} |"
        )
    if dist.get_rank() == 0:
        print(f"TP {tp}, batch {cli.batch} x {cli.seq_len} tokens, one backward (fp32, no AC)\n")
        print("| model | reduce-scatters | all-reduces | elements reduce-scattered | elements all-reduced | "
              "calls x elements |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        print("\n".join(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
