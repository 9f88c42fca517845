"""The global gradient norm, true in every layout, and clipping by it."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, pp_group=None) -> torch.Tensor:
    """Clip gradients by their global 2-norm and return the norm before clipping.

    The norm is `GradSquareSums`' (float64, the true global one whatever the layout, expert
    parallelism included). `max_norm <= 0` only measures. `pp_group`: under pipeline
    parallelism, the pipeline's ranks, whose stages' squares are summed too.
    """
    params = [p for p in parameters if p.grad is not None]
    squares = GradSquareSums()
    squares.add(params)
    norm = squares.global_norm(pp_group).float()
    if max_norm > 0:
        # clip_grads_with_norm_ takes the parameters and scales their .grad; EP parameters live
        # on another mesh (or none), so each kind gets its own foreach call.
        shared = [p for p in params if not getattr(p, "_ep_local", False)]
        ep_params = [p for p in params if getattr(p, "_ep_local", False)]
        for group in (shared, ep_params):
            if group:
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm


class GradSquareSums:
    """Squared gradient norms, summed per layout, from which `global_norm` makes the global norm.

    Norms accumulate in float64 over local tensors: a float32 reduction over millions of
    elements drifts by ~1e-5, enough for the same gradients to show different norms on
    different layouts. A DTensor gradient contributes its local shard; the squares of the
    gradients sharing a layout are summed, then all-reduced once over each mesh dim they are
    sharded on. (DTensor's own norm would stack partial norms of different layouts,
    redistributing each and warning on every FSDP x TP run.) Expert-parallel parameters
    (`_ep_local`) differ across their `_ep_group`, which their squares are summed over too.

    Gradients may be added a few at a time, as optimizer-in-backward does before it frees each
    one. Pitfall: every rank must add the same layouts in the same order, since `global_norm`
    all-reduces one sum per layout in the order they first appeared.
    """

    def __init__(self) -> None:
        self._by_layout: dict[tuple, torch.Tensor] = {}
        self._device: torch.device | None = None

    def add(self, params: list[torch.Tensor]) -> None:
        """Add the squared norms of `params`' gradients (each must have one)."""
        if not params:
            return
        # Stored back: left Partial, each optimizer op on it would all-reduce it again.
        _reduce_partial_grads(params)
        grads = [p.grad for p in params]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        self._device = self._device or local[0].device
        norms_by_layout: dict[tuple, list[torch.Tensor]] = {}
        for param, grad, norm in zip(params, grads, _float64_norms(local)):
            key = _sharded_groups(grad) + ((param._ep_group,) if getattr(param, "_ep_local", False) else ())
            norms_by_layout.setdefault(key, []).append(norm)
        # One stack, square and sum per layout: per parameter, a square and an add were two
        # kernels each (586 for Llama 3 8B's 291 parameters).
        for key, norms in norms_by_layout.items():
            # One at a time (optimizer-in-backward adds each parameter alone), a plain square.
            square = norms[0].square() if len(norms) == 1 else torch.stack(norms).square().sum()
            self._by_layout[key] = self._by_layout[key] + square if key in self._by_layout else square

    def global_norm(self, across=None) -> torch.Tensor:
        """The global 2-norm of everything added, as a float64 tensor (0 for nothing); resets.

        `across`: a process group whose ranks added different parameters (pipeline stages);
        their sums are added up too. Pitfall: the device is that of the first gradient added,
        so every rank of `across` must add some.
        """
        total = torch.zeros((), dtype=torch.float64, device=self._device)
        for groups, square in self._by_layout.items():
            for group in groups:
                dist.all_reduce(square, group=group)
            total = total + square.to(total.device)
        if across is not None:
            dist.all_reduce(total, group=across)
        self._by_layout, self._device = {}, None
        return total.sqrt()


# Elements per piece of a CPU tensor whose norm is taken in pieces: 32 MiB in float64.
CPU_NORM_PIECE = 1 << 22


def _float64_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each tensor, accumulated in float64.

    On the CPU, torch first converts a tensor to float64 whole, a transient copy twice an fp32
    gradient's size (the CPU offload of FSDP keeps the gradients there); so there a large
    tensor's norm is taken in pieces of `CPU_NORM_PIECE` elements and the pieces' combined.
    CUDA's kernel accumulates in float64 without a copy.
    """
    if not tensors or tensors[0].device.type != "cpu":
        return torch._foreach_norm(tensors, 2.0, dtype=torch.float64)
    norms = []
    for t in tensors:
        pieces = list(t.reshape(-1).split(CPU_NORM_PIECE))
        if len(pieces) == 1:
            norms.append(torch.linalg.vector_norm(t, dtype=torch.float64))
        else:
            norms.append(torch.stack(torch._foreach_norm(pieces, 2.0, dtype=torch.float64)).norm())
    return norms


def _reduce_partial_grads(params: list[torch.Tensor]) -> None:
    """Replace the pending sums (Partial) in `params`' DTensor gradients by their sums.

    Gradients sharing a mesh, placements and dtype are summed by one all-reduce of their
    concatenation per partial mesh dim: redistributed one at a time, tensor parallel's norm
    weights cost two collectives per block. A shard's norm is meaningless before the sum.
    """
    pending: dict[tuple, list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            pending.setdefault((grad.device_mesh, grad.placements, grad.dtype), []).append(param)
    for (mesh, placements, _), same in pending.items():
        if any(p.is_partial() and p.reduce_op != "sum" for p in placements):
            for param in same:
                param.grad = param.grad.redistribute(mesh, _summed(placements))
            continue
        local = [param.grad.to_local() for param in same]
        flat = torch.cat([t.reshape(-1) for t in local])
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                dist.all_reduce(flat, group=mesh.get_group(dim))
        for param, summed in zip(same, flat.split([t.numel() for t in local])):
            grad = param.grad
            param.grad = DTensor.from_local(
                summed.view(grad.to_local().shape),
                mesh,
                _summed(placements),
                run_check=False,
                shape=grad.shape,
                stride=grad.stride(),
            )


def _summed(placements: tuple) -> list:
    return [Replicate() if p.is_partial() else p for p in placements]


def _sharded_groups(grad: torch.Tensor) -> tuple:
    """The process groups of the mesh dims `grad` is sharded on (none for a plain tensor).

    Pitfall: FSDP over a TP-sharded dim places `_StridedShard`, for which `is_shard()` is
    False; every placement but Replicate (Partial is gone by now) splits the tensor."""
    if not isinstance(grad, DTensor):
        return ()
    mesh = grad.device_mesh
    return tuple(mesh.get_group(dim) for dim, p in enumerate(grad.placements) if not p.is_replicate())
