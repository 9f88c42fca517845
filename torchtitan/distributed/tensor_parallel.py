"""Tensor-parallel pieces shared by every model: the block's MLP plan (dense feed-forward or
MoE), styles the plans share, loss parallel and async TP.

Each model's TP plan lives in its own `parallelize.py`; what is the same for all of them
lives here.
"""

import contextlib

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig, model_compile_enabled
from torchtitan.distributed.expert_parallel import routed_experts
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_helpers import scale_grad


def loss_parallel_enabled(parallel_dims: ParallelDims, job_config: JobConfig) -> bool:
    """Cross-entropy runs on vocab-sharded logits (no gather) under TP unless disabled."""
    return parallel_dims.tp_enabled and not job_config.parallelism.disable_loss_parallel


def loss_context(parallel_dims: ParallelDims, job_config: JobConfig):
    """The context that loss computation and backward must run in (loss_parallel or nothing)."""
    if loss_parallel_enabled(parallel_dims, job_config):
        return loss_parallel()
    return contextlib.nullcontext()


def check_tp_divisibility(
    parallel_dims: ParallelDims, job_config: JobConfig, n_heads: int, n_kv_heads: int
) -> None:
    """Refuse a TP degree that does not divide the head counts (the config's checks refuse
    one that does not divide the sequence lengths)."""
    tp = parallel_dims.tp
    for what, value in (("attention heads", n_heads), ("kv heads", n_kv_heads)):
        if value % tp:
            raise ConfigError(
                f"'parallelism.tensor_parallel_degree' = {tp} does not divide the {value} {what} of "
                f"flavor '{job_config.model.flavor}'; choose a degree that divides {value}."
            )


def maybe_enable_async_tp(parallel_dims: ParallelDims, job_config: JobConfig, device: torch.device) -> None:
    """Turn on async TP (compute/communication overlap done by inductor) when asked.

    It is a compiler pass over symmetric-memory collectives, so it needs compile and CUDA.
    """
    if not job_config.parallelism.enable_async_tensor_parallel:
        return
    if not parallel_dims.tp_enabled or not model_compile_enabled(job_config) or device.type != "cuda":
        raise ConfigError(
            "'parallelism.enable_async_tensor_parallel' = true needs tensor_parallel_degree > 1, "
            'compile.enable = true with "model" in compile.components, and CUDA devices; this run '
            f"has tp {parallel_dims.tp}, compile {model_compile_enabled(job_config)}, device "
            f"{device.type}. Remove the key or meet all three."
        )
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(parallel_dims.submesh("tp").get_group().group_name)


def sum_grad_over_tp(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """Identity in forward; in backward, all-reduces (sums) x's gradient over `tp_mesh`.

    For a tensor every TP rank holds whole but whose consumers each see only their shard of
    the heads or hidden units, so that each rank's gradient is a partial sum (Megatron's "f").
    """
    replicated = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)
    return replicated.to_local(grad_placements=[Partial()])


class ReplicatedParams(ParallelStyle):
    """Keep a module whole on every TP rank: its parameters become Replicate DTensors (so FSDP
    sees one TP layout), and it returns local tensors (it takes local or replicated DTensor input).

    For small projections every rank needs in full (MoE router gate, MLA's latent projections
    and norms); each rank computes the same thing and the same gradient, so nothing is reduced.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(_module, inputs, mesh):
            return tuple(
                x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                for x in inputs
            )

        return distribute_module(
            module,
            device_mesh,
            input_fn=to_dtensor,
            output_fn=lambda _module, out, _mesh: out.to_local(),
        )


class SumGradOverTP(ParallelStyle):
    """For an `nn.Identity` hook point: its output's gradient is summed over TP (`sum_grad_over_tp`)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda _module, _inputs, out: sum_grad_over_tp(out, device_mesh))
        return module


class SequenceGatheredPartialSum(ParallelStyle):
    """For a module that reads the whole sequence and returns a partial sum over TP (the MoE):
    its input's sequence shards are all-gathered into a local tensor, and its output is
    reduce-scattered back to sequence shards, as a dense feed-forward's is.

    In backward the input's gradient is declared a partial sum, so the all-gather's backward is
    one reduce-scatter of the gradients every consumer inside leaves partial, rather than an
    all-reduce per consumer. Each consumer must therefore leave its share: hidden-sharded
    experts do; a replicated one (the router) scales its full gradient by 1 / tp.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_module, args):
            x = args[0]  # sequence shards: the norm's DTensor, or a local tensor
            shards = (
                x
                if isinstance(x, DTensor)
                else DTensor.from_local(x, device_mesh, [Shard(1)], run_check=False)
            )
            whole = shards.redistribute(device_mesh, [Replicate()])
            return (whole.to_local(grad_placements=[Partial()]), *args[1:])

        def scatter(_module, _args, out):
            partial = DTensor.from_local(out, device_mesh, [Partial()], run_check=False)
            return partial.redistribute(device_mesh, [Shard(1)]).to_local()

        module.register_forward_pre_hook(gather)
        module.register_forward_hook(scatter)
        return module


class _ReplicatedInputPartialGrad(torch.autograd.Function):
    """A local tensor every TP rank holds whole, as a Replicate DTensor whose gradient stays
    the local partial sum (`from_local` would all-reduce it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh):
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad: DTensor):
        if all(p.is_partial() for p in grad.placements):
            return grad.to_local(), None
        # Compiled code hands back a whole (Replicate) gradient; each rank's share of the
        # partial sum is then 1/tp of it, what a redistribute to Partial gives, which compile
        # refuses ("redistributing to Partial is for internal use only").
        whole = grad.redistribute(grad.device_mesh, [Replicate()]).to_local()
        return whole / grad.device_mesh.size(), None


class PartialGradColwiseParallel(ColwiseParallel):
    """`ColwiseParallel` for a Linear inside a `SequenceGatheredPartialSum` module: its input
    gradient is left a partial sum for the module's one reduce-scatter."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Registered before ColwiseParallel's own input hook, so it runs first and that hook finds
        # the DTensor it wants. Not by `prepend=True` afterwards: torch 2.11's dynamo then guards
        # the wrong hook and compiled TP fails with "IndexError: tuple index out of range".
        module.register_forward_pre_hook(
            lambda _module, args: (_ReplicatedInputPartialGrad.apply(args[0], device_mesh), *args[1:])
        )
        return super()._apply(module, device_mesh)


class RouterTensorParallel(ParallelStyle):
    """An MoE router under TP: the gate whole on every rank (`ReplicatedParams`), so every rank
    routes alike. The combine weights (the router's first output) scale the experts' partial
    outputs, so their gradient is a partial sum: it is summed over TP (T x top_k values), which
    makes the gate's gradient whole. The router's input gradient is then whole on every rank
    too, so it is scaled by 1 / tp: its share of the MoE input's partial-sum gradient."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        ReplicatedParams()._apply(module.gate, device_mesh)
        share = 1.0 / device_mesh.size()

        def share_input_grad(_module, args):
            return (scale_grad(args[0], share), *args[1:])

        def sum_weight_grads(_module, _inputs, out):
            return (sum_grad_over_tp(out[0], device_mesh), *out[1:])

        module.register_forward_pre_hook(share_input_grad)
        module.register_forward_hook(sum_weight_grads)
        return module


class ExpertTensorParallel(ParallelStyle):
    """Shard a `GroupedExperts`' hidden units over TP (w1/w3 [E, hidden, dim] on dim 1, w2
    [E, dim, hidden] on dim 2): each rank runs every expert on every routed token for its slice
    of the hidden units and returns a partial sum, reduced with the rest of the MoE output.

    The routed tokens' gradient is a partial sum too, left so for the MoE input's one
    reduce-scatter (`SequenceGatheredPartialSum`).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard_hidden(name, mod, mesh):
            for param_name, param in list(mod.named_parameters(recurse=False)):
                dim = 2 if param_name == "w2" else 1
                sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(dim)]), param.requires_grad)
                mod.register_parameter(param_name, sharded)

        return distribute_module(module, device_mesh, partition_fn=shard_hidden)


def apply_tp_to_ends(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """The embedding (row-wise, out to sequence shards), final norm and output projection
    (column-wise; vocab-sharded logits under loss parallel) of any decoder with these names.

    The embedding's reduce-scatter, and without loss parallel the logits' all-gather, run
    asynchronously; their outputs are waited for at once, since they enter compiled code
    (block 0, the loss) next. An un-waited collective's output that enters a compiled region
    breaks its backward (pytorch/pytorch#180614, #179506), or is read before it has arrived.
    """
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    # A pipeline stage holds some of the ends, or none.
    present = {name: style for name, style in plan.items() if getattr(model, name) is not None}
    if present:
        parallelize_module(model, tp_mesh, present)
    for name in ("tok_embeddings", "output"):
        if name in present:
            getattr(model, name).register_forward_hook(_wait_for_collective)


def _wait_for_collective(_module, _inputs, out):
    # wait_tensor, unlike AsyncCollectiveTensor.wait(), keeps the output in the autograd graph.
    return funcol.wait_tensor(out) if isinstance(out, AsyncCollectiveTensor) else out


def dense_mlp_plan(feed_forward: nn.Module, tp: int) -> dict[str, ParallelStyle]:
    """A block's SwiGLU feed-forward: gather the sequence, w1/w3 column-wise, w2 row-wise with a
    reduce-scatter back to sequence shards.

    Raises:
        ConfigError: when TP does not divide the hidden width.
    """
    hidden = feed_forward.w1.out_features
    if hidden % tp:
        raise ConfigError(
            f"'parallelism.tensor_parallel_degree' = {tp} does not divide the feed-forward hidden "
            f"width {hidden}; choose a degree that divides it."
        )
    return {
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def moe_plan(moe: nn.Module, tp: int) -> dict[str, ParallelStyle]:
    """A block's MoE under TP, all but the routed experts (`shard_experts_over_tp`, or expert
    parallelism over the TP ranks, decides those).

    Every rank gathers the whole sequence and routes every token (the router gate replicated,
    so all ranks route alike); the shared experts are sharded over their hidden units and the
    routed experts contribute a share per rank, so each rank's MoE output is a partial sum,
    reduce-scattered back to sequence shards like a dense feed-forward's. In backward, each
    branch leaves its input gradient a partial sum, and one reduce-scatter of their sum returns
    the sequence shards' gradient, as for a dense feed-forward.

    Raises:
        ConfigError: when TP does not divide the experts' hidden width.
    """
    hidden = moe.experts.w1.shape[1]
    if hidden % tp:
        raise ConfigError(
            f"'parallelism.tensor_parallel_degree' = {tp} does not divide the experts' hidden width "
            f"{hidden}; choose a degree that divides it."
        )
    plan = {
        "ffn_norm": SequenceParallel(),
        "moe": SequenceGatheredPartialSum(),
        "moe.router": RouterTensorParallel(),
    }
    if moe.shared_experts is not None:
        plan |= {
            "moe.shared_experts.w1": PartialGradColwiseParallel(),
            "moe.shared_experts.w2": RowwiseParallel(output_layouts=Partial()),
            "moe.shared_experts.w3": PartialGradColwiseParallel(),
        }
    return plan


def shard_experts_over_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard every MoE's routed experts over their hidden units (`ExpertTensorParallel`), in
    place: what TP does to the experts unless expert parallelism spreads them over the TP ranks."""
    for experts in routed_experts(model):
        parallelize_module(experts, tp_mesh, ExpertTensorParallel())


def mlp_plan(block: nn.Module, tp: int) -> dict[str, ParallelStyle]:
    """The TP plan of `block`'s MLP (a `DecoderBlock`'s), whichever it has: dense or MoE."""
    return moe_plan(block.mlp, tp) if block.is_moe else dense_mlp_plan(block.mlp, tp)
