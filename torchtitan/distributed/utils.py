"""Device and process-group setup, layout-independent init, and global-norm clipping."""

import datetime
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor


def device_type() -> str:
    """The accelerator type when one is present, else "cpu"; the only place that decides."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator.type if accelerator is not None else "cpu"


def backend_for(device: str) -> str:
    """The collective backend for a device type: nccl for CUDA, gloo for the CPU."""
    return {"cuda": "nccl", "cpu": "gloo"}.get(device, "gloo")


def local_device() -> torch.device:
    """This rank's device: accelerator LOCAL_RANK when present, else the CPU."""
    kind = device_type()
    if kind == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", 0))
    torch.accelerator.set_device_index(index)
    return torch.device(kind, index)


def init_distributed(device: torch.device, timeout_seconds: int, trace_buf_size: int) -> int:
    """Join the process group when launched by torchrun; returns the world size.

    A plain `python -m torchtitan.train` (no WORLD_SIZE) runs as one process with no group.
    """
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return 1
    # TORCH_NCCL_TRACE_BUFFER_SIZE is the deprecated spelling; a user's setting of either wins.
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(trace_buf_size))
    dist.init_process_group(
        backend=backend_for(device.type),
        timeout=datetime.timedelta(seconds=timeout_seconds),
        device_id=device if device.type != "cpu" else None,
    )
    return dist.get_world_size()


def set_collective_timeout(timeout_seconds: int) -> None:
    """Shorten the default group's timeout once the slow first step is over."""
    if dist.is_initialized():
        from torch.distributed.distributed_c10d import _get_default_group, _set_pg_timeout

        _set_pg_timeout(datetime.timedelta(seconds=timeout_seconds), _get_default_group())


@torch.no_grad()
def init_param_(param: torch.Tensor, fill_) -> None:
    """Initialize `param` in place with `fill_`, identically for every parallel layout.

    `fill_(tensor)` draws from the global RNG. For a DTensor the full parameter is drawn on
    every rank and each keeps its own shard, so a seeded 1-process run and an N-process run
    start from the same weights. Likewise for an expert-parallel slice (`_ep_local`, see
    `expert_parallel.shard_experts_`): the full tensor is drawn and its `_ep_slice` kept.
    Pitfall: this briefly holds one full parameter per rank.
    """
    ep_local = getattr(param, "_ep_local", False)
    if not ep_local and not isinstance(param, DTensor):
        fill_(param)
        return
    local = param.to_local() if isinstance(param, DTensor) else param
    shape = param._ep_full_shape if ep_local else param.shape
    full = torch.empty(shape, dtype=param.dtype, device=local.device)
    fill_(full)
    if ep_local:
        full = full[param._ep_slice]
    if isinstance(param, DTensor):
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    local.copy_(full)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Clip gradients by their global 2-norm and return the norm before clipping.

    DTensor gradients (FSDP or TP shards) reduce their partial norms across the mesh, so the
    norm is the true global one whatever the layout. Per-tensor norms accumulate in float64:
    a float32 reduction over millions of elements drifts by ~1e-5, enough for the same
    gradients to show different norms on different layouts. `max_norm <= 0` only measures.

    Expert-parallel gradients (parameters marked `_ep_local`, plain or FSDP-sharded) differ
    across the EP group: their squared norms are summed over the parameter's `_ep_group` and
    added to the rest.
    """
    params = [p for p in parameters if p.grad is not None]
    shared = [p for p in params if not getattr(p, "_ep_local", False)]
    ep_params = [p for p in params if getattr(p, "_ep_local", False)]
    norm = _norm64([p.grad for p in shared])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if ep_params:
        norm = (norm.square() + _ep_square_sum(ep_params, norm.device)).sqrt()
    norm = norm.float()
    if max_norm > 0:
        # clip_grads_with_norm_ takes the parameters and scales their .grad; EP parameters live
        # on another mesh (or none), so each kind gets its own foreach call.
        for group in (shared, ep_params):
            if group:
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm


def _norm64(grads: list[torch.Tensor]) -> torch.Tensor:
    """2-norm of `grads` together, accumulated in float64 (0 for none)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    try:
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float64)
    except (RuntimeError, TypeError):
        # torch 2.14's DTensor rule for _foreach_norm reads the dtype argument as a dim and
        # fails before any collective, on every rank alike; per-tensor norms take another rule.
        norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float64) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms))


def _ep_square_sum(ep_params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squared gradient norms of `_ep_local` parameters over each one's `_ep_group`."""
    by_group: dict = {}
    for p in ep_params:
        by_group.setdefault(p._ep_group, []).append(p.grad)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for group, grads in by_group.items():
        square = plain_tensor(_norm64(grads)).to(device).square()
        dist.all_reduce(square, group=group)
        total = total + square
    return total


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` as a plain tensor: a DTensor (e.g. the loss under loss parallel) is materialized."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def set_determinism(seed: int | None, deterministic: bool) -> None:
    """Seed every RNG (same seed on all ranks) and optionally force deterministic kernels."""
    torch.manual_seed(0 if seed is None else seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def all_reduce_mean(value: float, device: torch.device) -> float:
    """Mean of a Python float over all ranks (itself when not distributed)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def finite_or_raise(loss: float, step: int) -> None:
    """Stop at the first non-finite loss, naming the step, rather than training on NaNs."""
    if not math.isfinite(loss):
        raise FloatingPointError(f"loss is {loss} at step {step}; lower optimizer.lr or check data")
