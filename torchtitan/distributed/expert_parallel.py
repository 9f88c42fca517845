"""Expert parallelism (EP): each rank of an EP group owns `num_experts / ep` experts.

The EP group is the "ep" dim of the mesh, borrowed from the FSDP shard group (and from the
TP ranks under expert_tensor_parallel_degree 1; see `ParallelDims`). Ranks at the same position
of different EP groups hold the same experts; `data_parallel.apply_fsdp` shards those experts
over them (or, when there is only one such rank, leaves the experts alone).

`apply_expert_parallel(model, ep_mesh)` shards every `moe.experts` (a `GroupedExperts`) along
its expert dim and installs forward pre/post hooks on it, so `MoE` keeps calling
`self.experts(x_sorted, num_tokens_per_expert)` unchanged:

    dispatch: all-to-all the tokens (sorted by global expert) to the ranks owning their experts,
        then regroup the received rows by local expert;
    compute:  the local GroupedExperts slice;
    combine:  undo the regrouping and all-to-all the outputs back to the ranks they came from.

Under tensor parallelism the experts take one of two layouts:

    expert_tensor_parallel_degree = TP: the experts are first sharded over their hidden units
        (`tensor_parallel.ExpertTensorParallel`) and then split here: every TP rank of an EP
        group routes the same tokens, each "ep" group is one TP position, and each rank runs
        its experts' slice of the hidden units; the partial outputs travel back through the
        combine and are reduced over TP with the rest of the MoE output.
    expert_tensor_parallel_degree = 1 (torchtitan's default): the EP group spans the TP ranks
        as well, and the experts stay whole. The TP ranks route the same tokens, so each
        dispatches only its 1/tp share of the routed rows (`_SplitRowsOverTP`) and gets zeros
        for the rest: again a partial sum over TP. Fewer, larger grouped matmuls than the
        layout above, and an all-to-all over more ranks.

The expert weights are this rank's slice, marked `_ep_local = True` (`clip_grad_norm_` sums
their squares over `_ep_group`; `init_param_` draws the full tensor and keeps `_ep_slice`). A
slice's gradient sums the contributions of the ranks that sent it tokens; 1/(the data ranks in
the group) applied on the way back, with FSDP's mean over the ranks holding the same slice,
makes it the data-parallel mean like every other gradient.

Checkpoints see each expert weight whole: `global_expert_view` wraps this rank's slice (and
its optimizer moments) as a DTensor over all experts, so DCP saves and reshards them like any
other sharded tensor.

Pitfall: one path only, autograd-aware (`all_to_all_single_autograd`). The split sizes are
exchanged with a functional all_to_all_single and read on the host once per call through a
device-to-host copy; op-SAC saves both, so a recompute neither communicates nor syncs for them.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from torchtitan.distributed.tensor_helpers import scale_grad
from torchtitan.tools.fqn import clean_fqn

EXPERT_WEIGHTS = ("w1", "w2", "w3")


def tokens_per_rank_to_host(
    x: torch.Tensor, counts: torch.Tensor, counts_recv: torch.Tensor, ep: int
) -> tuple[list, list]:
    """(input_splits, output_splits): rows this rank sends to / receives from each EP rank, read
    from the exchanged token counts (a host sync); `x` is the rows to dispatch."""
    both = torch.stack([counts, counts_recv]).view(2, ep, -1).sum(dim=-1).to("cpu")
    send, recv = both.tolist()
    return send, recv


class _ExpertParallelHooks:
    """Pre/post forward hooks of one GroupedExperts. The two run back to back for each call, so
    one slot carries the pre hook's context to the post hook; a recompute that stops early
    (AC early_stop) between them leaves a stale slot that the next call overwrites.

    `data_ranks`: how many ranks of the EP group see different data (ep, or ep / tp when the
    group spans the TP ranks, which share their data); the experts' gradients are averaged over
    those.
    """

    def __init__(self, ep_group: dist.ProcessGroup, data_ranks: int | None = None, split_sizes=None):
        self.group = ep_group
        self.ep = dist.get_world_size(ep_group)
        self.data_ranks = data_ranks or self.ep
        self.split_sizes = split_sizes or tokens_per_rank_to_host
        self._ctx: tuple | None = None

    def dispatch(self, module: nn.Module, args: tuple):
        x, counts = args
        ep = self.ep
        counts_recv = funcol.all_to_all_single(counts, None, None, self.group)
        counts_recv = funcol.wait_tensor(counts_recv)
        send, recv = self.split_sizes(x, counts, counts_recv, ep)
        x_recv = funcol.all_to_all_single_autograd(x, recv, send, self.group)
        # Received rows come grouped by (source rank, local expert); the experts want them
        # grouped by (local expert, source rank).
        per_source = counts_recv.view(ep, -1)
        local_experts = per_source.shape[1]
        segment = torch.arange(ep * local_experts, device=counts.device)
        segment = segment.repeat_interleave(counts_recv, output_size=sum(recv))
        key = (segment % local_experts) * ep + segment // local_experts
        order = torch.argsort(key, stable=True)
        self._ctx = (order, send, recv)
        return scale_grad(x_recv[order], float(self.data_ranks)), per_source.sum(dim=0)

    def combine(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        (order, send, recv), self._ctx = self._ctx, None
        # The 1/data_ranks scale on the way back makes the experts' weight gradients the
        # data-parallel mean (as FSDP's reduce-scatter gives the others); _ScaleGrad(data_ranks)
        # on the input side restores the token gradients.
        out = scale_grad(out, 1.0 / self.data_ranks)
        y_recv = torch.empty_like(out)
        y_recv[order] = out  # in place: out-of-place index_put first copied the empty buffer
        return funcol.all_to_all_single_autograd(y_recv, send, recv, self.group)


class _SplitRowsOverTP:
    """Pre/post forward hooks that make each TP rank run the experts on its own 1/tp share of
    the routed rows, for expert parallelism over the TP ranks (which all route the same tokens).

    Before dispatch: keep rows [n * r / tp, n * (r + 1) / tp) of the expert-sorted rows and
    their per-expert counts; after combine: zeros for the other ranks' rows, so that the MoE
    output is a partial sum over TP, reduced with the shared experts' partial output. The rows'
    gradient is likewise this rank's share, left a partial sum for the MoE input's one
    reduce-scatter (see `SequenceGatheredPartialSum`).
    """

    def __init__(self, tp_mesh: DeviceMesh):
        self.tp, self.rank = tp_mesh.size(), tp_mesh.get_local_rank()
        self._pad: tuple[int, int] | None = None

    def keep_own_rows(self, module: nn.Module, args: tuple):
        x, counts = args
        rows = x.shape[0]
        lo, hi = rows * self.rank // self.tp, rows * (self.rank + 1) // self.tp
        ends = counts.cumsum(0)
        starts = ends - counts
        own = (ends.clamp(max=hi) - starts.clamp(min=lo)).clamp(min=0).to(counts.dtype)
        self._pad = (lo, rows - hi)
        return x[lo:hi], own

    def restore_all_rows(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        (before, after), self._pad = self._pad, None
        return nn.functional.pad(out, (0, 0, before, after))


def shard_experts_(experts: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Keep this rank's `num_experts / ep` experts of w1/w2/w3 as local Parameters: plain
    tensors, or, for experts already sharded over TP, DTensors over "tp" of the kept experts.

    Works on meta (before `to_empty`) and on materialized weights. Each kept Parameter is
    marked: `_ep_local = True`, `_ep_mesh` (1-D "ep"), `_ep_group`, `_ep_full_shape` and
    `_ep_slice` (rows of dim 0).
    """
    ep_group = ep_mesh.get_group()
    ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    if experts.num_experts % ep:
        raise ValueError(f"num_experts = {experts.num_experts} is not divisible by ep = {ep}")
    local = experts.num_experts // ep
    rows = slice(rank * local, (rank + 1) * local)
    marks = {}
    for name in EXPERT_WEIGHTS:
        full = getattr(experts, name)
        with torch.no_grad():
            kept = full[rows].clone() if full.device.type != "meta" else full[rows].detach()
        setattr(experts, name, nn.Parameter(kept.contiguous(), requires_grad=full.requires_grad))
        marks[name] = {"_ep_local": True, "_ep_mesh": ep_mesh, "_ep_group": ep_group}
        marks[name]["_ep_full_shape"] = tuple(full.shape)
        marks[name]["_ep_slice"] = rows
    experts.num_experts = local
    experts._ep_marks = marks
    _mark_params(experts)
    # `to_empty`/`to` replace Parameters by new ones (without the marks): mark those again.
    original_apply = experts._apply

    def _apply_and_mark(*args, **kwargs):
        result = original_apply(*args, **kwargs)
        _mark_params(experts)
        return result

    experts._apply = _apply_and_mark


def mark_expert_params(experts: nn.Module) -> None:
    """Set the `_ep_*` marks again on `experts`' current Parameters (after FSDP replaced them)."""
    _mark_params(experts)


def _mark_params(experts: nn.Module) -> None:
    for name, marks in experts._ep_marks.items():
        for key, value in marks.items():
            setattr(getattr(experts, name), key, value)


def routed_experts(model: nn.Module) -> list[nn.Module]:
    """The routed experts (a `GroupedExperts`) of each MoE block of `model.layers`, as each block
    (a `DecoderBlock`) names them. Wrapped blocks (AC, compile) forward the attribute."""
    return [block.routed_experts for block in model.layers.children() if block.is_moe]


def apply_expert_parallel(
    model: nn.Module,
    ep_mesh: DeviceMesh,
    data_ranks: int | None = None,
    rows_split_mesh: DeviceMesh | None = None,
    split_sizes=None,
) -> list[nn.Module]:
    """Shard and hook every block's routed experts (`routed_experts`) over the 1-D `ep_mesh`, in place.

    Call after tensor parallelism and before activation checkpointing and compile wrap the blocks.

    Args:
        ep_mesh: the EP group (the "ep" dim, or "ep" flattened from dp_shard and tp).
        data_ranks: ranks of the EP group that see different data (default: all of them).
        rows_split_mesh: the TP mesh when the EP group spans the TP ranks: each TP rank then
            dispatches its own share of the routed rows (`_SplitRowsOverTP`).
        split_sizes: `(x, counts, counts_recv, ep) -> (send, recv)`, the rows this rank sends to
            and receives from each EP rank; default `tokens_per_rank_to_host`.

    Returns:
        The sharded `GroupedExperts` modules, for data parallelism to shard or ignore.

    Raises:
        ValueError: no block has a `moe` (a model that names its MoE layer otherwise).
    """
    sharded = routed_experts(model)
    if not sharded:
        raise ValueError("expert parallelism found no block with routed experts: name each MoE layer `moe`")
    for experts in sharded:
        shard_experts_(experts, ep_mesh)
        split = _SplitRowsOverTP(rows_split_mesh) if rows_split_mesh is not None else None
        if split is not None:
            experts.register_forward_pre_hook(split.keep_own_rows)
        hooks = experts._ep_hooks = _ExpertParallelHooks(ep_mesh.get_group(), data_ranks, split_sizes)
        experts.register_forward_pre_hook(hooks.dispatch)
        experts.register_forward_hook(hooks.combine)
        # Forward hooks run in registration order: the rows come back, then are padded.
        if split is not None:
            experts.register_forward_hook(split.restore_all_rows)
    return sharded


def is_ep_local(param: torch.Tensor) -> bool:
    return getattr(param, "_ep_local", False)


def expert_parallel_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """`model`'s expert-parallel parameters by clean FQN (see `tools.fqn`), in the same order on
    every rank, which the collectives that gather them one at a time rely on."""
    return {clean_fqn(n): p for n, p in model.named_parameters() if is_ep_local(p)}


def global_expert_view(value: torch.Tensor, param: torch.Tensor) -> DTensor:
    """`value` (this rank's part of the expert-parallel `param`, or of a state shaped like it)
    as a DTensor of the whole `param._ep_full_shape`, sharing `value`'s storage.

    A plain slice is `Shard(0)` over "ep". A slice that is itself a DTensor (FSDP's `Shard(0)`
    over the ranks holding the same experts, TP's shard of the hidden units, or both) is
    `Shard(0)` over "ep" followed by its own placements: FSDP splits the rows of this rank's
    slice further, which is what DTensor's left-to-right sharding means. Writing into the view
    (DCP load) writes into `value`.
    """
    shape = torch.Size(param._ep_full_shape)
    stride = torch.empty(shape, device="meta").stride()
    if isinstance(value, DTensor):
        mesh = DeviceMesh._concatenate([param._ep_mesh, value.device_mesh])
        placements, local = (Shard(0), *value.placements), value.to_local()
    else:
        mesh, placements, local = param._ep_mesh, (Shard(0),), value
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def full_expert_tensor(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The whole expert weight (every expert) from this rank's part `value` of `param`, on
    every rank: gathered over the experts' FSDP ranks (if sharded), then over "ep". A
    collective: every rank calls it, for the same parameters in the same order."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return DTensor.from_local(value, param._ep_mesh, (Shard(0),), run_check=False).full_tensor()
