"""Device and process-group setup, layout-independent init, global-norm clipping, and how the
ranks agree on a config error and how each one exits."""

import atexit
import datetime
import json
import logging
import math
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from torchtitan.config.errors import ConfigError

T = TypeVar("T")

logger = logging.getLogger(__name__)


def device_type() -> str:
    """The accelerator type when one is present, else "cpu"; the only place that decides."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator.type if accelerator is not None else "cpu"


def backend_for(device: str, cpu_collectives: bool = False) -> str:
    """The collective backend for a device type: nccl for CUDA, gloo for the CPU.

    `cpu_collectives`: an accelerator run that also communicates CPU tensors (FSDP's CPU
    offload keeps gradients there, and the gradient norm is reduced where they live) gets
    gloo for those besides its own backend, e.g. "cuda:nccl,cpu:gloo".
    """
    backend = {"cuda": "nccl", "cpu": "gloo"}.get(device, "gloo")
    if cpu_collectives and device != "cpu":
        return f"{device}:{backend},cpu:gloo"
    return backend


def local_device() -> torch.device:
    """This rank's device: accelerator LOCAL_RANK when present, else the CPU."""
    kind = device_type()
    if kind == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", 0))
    torch.accelerator.set_device_index(index)
    return torch.device(kind, index)


def init_distributed(
    device: torch.device,
    timeout_seconds: int,
    trace_buf_size: int,
    cpu_collectives: bool = False,
    trace_dump_prefix: str = "",
) -> int:
    """Join the process group when launched by torchrun; returns the world size.

    A plain `python -m torchtitan.train` (no WORLD_SIZE) runs as one process with no group.
    `cpu_collectives`: see `backend_for`. Under nccl the flight recorder keeps each rank's
    last `trace_buf_size` collectives and, on a collective timeout, writes them to the file
    `trace_dump_prefix` + rank (its folder created here), so that on several nodes they land
    in the run's dump folder rather than in each node's /tmp. Variables the user set win.
    """
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return 1
    backend = backend_for(device.type, cpu_collectives)
    _configure_flight_recorder(trace_buf_size, trace_dump_prefix if "nccl" in backend else "")
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=timeout_seconds),
        device_id=device if device.type != "cpu" else None,
    )
    return dist.get_world_size()


def _configure_flight_recorder(trace_buf_size: int, trace_dump_prefix: str) -> None:
    # The TORCH_NCCL_* names are the deprecated spellings of the TORCH_FR_* ones.
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(trace_buf_size))
    user_chose_a_file = {"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"} & set(os.environ)
    if trace_buf_size == 0 or not trace_dump_prefix or user_chose_a_file:
        return
    # abspath drops a trailing separator, which an empty file prefix leaves.
    prefix = os.path.abspath(trace_dump_prefix) + (os.sep if trace_dump_prefix.endswith(os.sep) else "")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = prefix
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    logger.info(
        f"Flight recorder: each rank's last {trace_buf_size} NCCL collectives are written to "
        f"{prefix}<rank> if a collective times out"
    )


def set_collective_timeout(timeout_seconds: int, keep: tuple = ()) -> None:
    """Shorten every process group's timeout once the slow first step is over: the default
    group's, the device mesh's (FSDP, TP, EP, their flattened groups) and the trainer's own.

    A barrier first, so that no rank applies the shorter timeout to a collective that a rank
    still in its first step has yet to join.

    Args:
        keep: groups whose timeout stays, e.g. the checkpointer's, which wait for rank 0's file
            work or for the slowest rank's write, either of which may take longer.
    """
    if not dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _world

    dist.barrier()
    set_group_timeouts(timeout_seconds, [group for group in list(_world.pg_map) if group not in keep])


def set_group_timeouts(timeout_seconds: int, groups) -> None:
    """Give each of `groups` the collective timeout `timeout_seconds`, from the next collective
    on. No collective of theirs may be in flight (it could be timed against either value)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    timeout = datetime.timedelta(seconds=timeout_seconds)
    for group in groups:
        _set_pg_timeout(timeout, group)


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

    The norm is `GradSquareSums`' (float64, the true global one whatever the layout, expert
    parallelism included). `max_norm <= 0` only measures.
    """
    params = [p for p in parameters if p.grad is not None]
    squares = GradSquareSums()
    squares.add(params)
    norm = squares.global_norm().float()
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

    def global_norm(self) -> torch.Tensor:
        """The global 2-norm of everything added, as a float64 tensor (0 for nothing); resets."""
        total = torch.zeros((), dtype=torch.float64, device=self._device)
        for groups, square in self._by_layout.items():
            for group in groups:
                dist.all_reduce(square, group=group)
            total = total + square.to(total.device)
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


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` as a plain tensor: a DTensor (e.g. the loss under loss parallel) is materialized."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def set_determinism(seed: int | None, deterministic: bool, warn_only: bool = False) -> None:
    """Seed every RNG (same seed on all ranks) and optionally force deterministic kernels.

    Args:
        seed: the seed; None seeds 0.
        deterministic: make torch use deterministic kernels, and raise for an op that has none.
        warn_only: with `deterministic`, warn for such an op instead and run its
            nondeterministic kernel (the run is then not bit-for-bit repeatable).
    """
    torch.manual_seed(0 if seed is None else seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
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


def mean_and_max_over_ranks(value: float, device: torch.device) -> tuple[float, float]:
    """Mean and largest of a Python float over all ranks, from one all-gather."""
    if not dist.is_initialized():
        return value, value
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)  # the list form: torch 2.13 deprecates all_gather_into_tensor
    values = torch.cat(every)
    return values.mean().item(), values.max().item()


def finite_or_raise(step: int, loss: float, grad_norm: float) -> None:
    """Stop at the first non-finite loss or gradient norm, naming the step, rather than train on
    (or checkpoint) the NaN weights the optimizer step made of them."""
    for name, value in (("loss", loss), ("gradient norm", grad_norm)):
        if not math.isfinite(value):
            raise FloatingPointError(
                f"{name} is {value} at step {step}, so the weights are no longer finite; lower "
                "optimizer.lr or check the data, then resume from the last checkpoint (none was "
                "written of this step)"
            )


def agree_on_config_errors(work: Callable[[], T]) -> T:
    """Run `work` on every rank and return its result; a ConfigError it raised on any rank is
    raised on every rank (the lowest such rank's message), so that all exit 2 with it.

    For work that only some ranks do, or whose outcome can differ between ranks (rank 0 writes
    the resolved config, chooses the checkpoint to resume, starts wandb): raised on one rank
    alone, the error ended that rank while the others waited in their next collective until it
    failed or timed out, and the launcher reported exit 1 with a traceback. Collective: every
    rank calls it. Other exceptions are not shared (they are bugs, not the user's to fix).
    """
    result, error = None, None
    try:
        result = work()
    except ConfigError as e:
        error = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise ConfigError(error)
    return result


def exit_skipping_interpreter_teardown(code: int) -> NoReturn:
    """End the process with `code` the way the interpreter would, less its final teardown:
    non-daemon threads are joined, atexit handlers run (logging flushes its handlers), the
    standard streams are flushed, and then `os._exit(code)`. Call it from the main thread.

    For a rank that ran collectives, after `destroy_process_group`. A gloo worker thread frees
    a finished collective's tensors a moment after the collective has returned to Python; when
    that lands after the interpreter has begun finalizing, the thread cannot take the GIL, is
    ended inside C++, and the rank aborts with SIGABRT ("terminate called without an active
    exception", torch 2.13). A rank that exits right after a collective (every rank leaving on
    an agreed config error) hit it about once in 30 runs under torchrun, and torchrun then
    reported the abort rather than the error. Pitfall: objects still alive are not finalized,
    so whatever must reach disk is closed before this (the trainer's writers and checkpointer).
    """
    # The interpreter's own first two exit steps, in its order. `_shutdown` also wakes idle
    # thread-pool workers (its registered callbacks) before it joins them; joining threads
    # directly waited forever on a finished run's idle ThreadPoolExecutor.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to say there
            pass
    os._exit(code)


def report_to_torchrun(message: str) -> None:
    """Write `message` where torchrun's failure summary reads this rank's error
    (`$TORCHELASTIC_ERROR_FILE`), for an error the rank handles itself rather than raising:
    the summary then shows it even when `LOG_RANK` hides the rank's output. Outside torchrun
    there is no such file and nothing is written."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(datetime.datetime.now().timestamp())}, f)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity in forward; multiplies x's gradient by `scale` in backward."""
    return _ScaleGrad.apply(x, scale)
