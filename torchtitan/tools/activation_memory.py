"""Measure the activation bytes a forward leaves alive for backward.

`bytes_held_for_backward` (works under FakeTensorMode): a dispatch mode records the storage
of every tensor an op creates during forward; once forward returns, the storages still alive
(held by autograd, a checkpoint or a SAC cache) are what backward needs. The forward's output
and pre-existing storages (parameters, buffers, inputs) are not counted. Pitfalls: keep the
mode active over forward only (a dispatch mode entered for backward alone breaks
selective-AC recompute); it cannot see inside torch.compile'd code, whose kernels allocate
without dispatching.

`bytes_saved_for_backward`: for compiled modules, what autograd is asked to save.

`held_per_block`: `bytes_held_for_backward` for each block of a running model, measured in
place (the mode "auto" planner's cost model).
"""

import contextlib

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _StorageRecorder(TorchDispatchMode):
    def __init__(self, excluded: set[int]):
        super().__init__()
        self.excluded = excluded
        self.created: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            # A DTensor's own storage has its global size; this rank holds its local shard's.
            t = t._local_tensor if isinstance(t, DTensor) else t
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.excluded:
                    self.created[ref.cdata] = (ref, t.untyped_storage().nbytes())
        return out

    def alive_bytes(self, exclude: set[int]) -> int:
        return sum(n for key, (ref, n) in self.created.items() if not ref.expired() and key not in exclude)


def _storage_keys(tensors) -> set[int]:
    """Storage identities of `tensors`; for a DTensor, also its local shard's (a module that
    computes on the shard, as experts under TP do, holds a view of that storage)."""
    keys = set()
    for t in tensors:
        if isinstance(t, DTensor):
            keys.add(StorageWeakRef(t._local_tensor.untyped_storage()).cdata)
        if isinstance(t, torch.Tensor):
            keys.add(StorageWeakRef(t.untyped_storage()).cdata)
    return keys


def bytes_held_for_backward(module: torch.nn.Module, *inputs: torch.Tensor, elsewhere=()) -> int:
    """Bytes of the storages created by `module(*inputs)` that stay alive after it returns.

    Each input is first copied inside the measurement, as the previous layer's output would
    be, so a block input that backward keeps (as full AC does) counts as held. `elsewhere`:
    tensors whose storages are not the device's to count (an activation offloader's host
    buffers, which the forward fills).
    """

    def copied_inputs_call():
        copies = [x.clone() if x.requires_grad else x for x in inputs]
        return module(*copies)

    out, held = _held_by(copied_inputs_call, module, [*inputs, *elsewhere])
    del out
    return held


def _held_by(call, module: torch.nn.Module, kept) -> tuple[object, int]:
    """(`call()`'s output, the bytes of the storages it created that are alive once it
    returned): its output's, `module`'s parameters and buffers and `kept`'s excluded."""
    recorder = _StorageRecorder(_storage_keys([*module.parameters(), *module.buffers(), *kept]))
    with recorder:
        out = call()
    return out, recorder.alive_bytes(exclude=_storage_keys(tree_leaves(out)))


def bytes_saved_for_backward(module: torch.nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward during `module(*inputs)`,
    the module's parameters and buffers and the inputs themselves excluded.

    A compiled region saves what its partitioner chose through autograd, so this measures
    that choice (e.g. under `memory_budget` AC) where `bytes_held_for_backward` sees nothing.
    Pitfall: an eager checkpoint installs its own saved-tensor hooks, which hide its saves
    from these; use `bytes_held_for_backward` for eager modules.
    """
    excluded = _storage_keys(list(module.parameters()) + list(module.buffers()) + list(inputs))
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = StorageWeakRef(tensor.untyped_storage()).cdata
        if key not in excluded:
            saved[key] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = module(*inputs)
    del out
    return sum(saved.values())


@contextlib.contextmanager
def held_per_block(blocks: dict[int, torch.nn.Module]):
    """While active, each call of a block in `blocks` (index -> module) measures what
    `bytes_held_for_backward` measures, in the running model: the bytes of the storages the
    call creates that are alive once it returns, its output's excluded. Yields a dict, index
    -> the most one call held, filled as the blocks run.

    Unlike `bytes_held_for_backward` the block's input is not copied, so it is not counted
    (it is the previous block's output, held for backward under every AC mode). The block's
    `forward` is shadowed on the instance, inside its hooks (FSDP's all-gather and reshard stay
    outside the measurement), and restored on exit.
    """
    held: dict[int, int] = {}
    shadowed = {}
    for index, block in blocks.items():
        shadowed[index] = block.__dict__.get("forward")
        block.forward = _measured_forward(block, block.forward, index, held)
    try:
        yield held
    finally:
        for index, block in blocks.items():
            del block.forward
            if shadowed[index] is not None:
                block.forward = shadowed[index]


def _measured_forward(block: torch.nn.Module, forward, index: int, held: dict[int, int]):
    def measured(*args, **kwargs):
        out, n = _held_by(lambda: forward(*args, **kwargs), block, tree_leaves((args, kwargs)))
        held[index] = max(held.get(index, 0), n)
        return out

    return measured
