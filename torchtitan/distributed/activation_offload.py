"""Activation offload: what a block holds for backward waits in host memory instead of the device.

The AC plan (`activation_checkpoint.ACPlan`) turns this on with `[activation_checkpoint] offload =
"saved"`. For each chosen block, the tensors the block's AC mode would keep for backward leave
the device as soon as they are made: with mode "none" every tensor autograd saves, with full AC
the block's input, with op-SAC its input and the saved op outputs. Backward brings each block's
tensors back one block ahead of need.

On an accelerator the copies run on two side streams, device-to-host into pinned buffers of a
reused `HostPool`, host-to-device into fresh device memory; events order them with the compute
stream, so nothing waits on the host. A device tensor handed to the copy is dropped at once: its
memory is marked used by the copy stream (`record_stream`), so the allocator reuses it only
after the copy has run. On the CPU the same steps copy synchronously, and "host" is the pool,
which tests can inspect apart from the tensors autograd holds. Fake tensors (the memory
estimator's) move no data: their host side is a byte count, and only the device side allocates.
"""

import contextlib
import weakref
from collections import defaultdict

import torch
import torch.nn as nn
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor

MIB = 2**20


class HostPool:
    """Host buffers kept for reuse, one free list per byte size: activations come in a few sizes
    that repeat every block and every step, so after the first step nothing is allocated.

    Buffers for an accelerator's tensors are pinned (asynchronous copies need it). A fake
    tensor's buffer (the memory estimator's) has no memory: it only counts bytes.
    """

    def __init__(self):
        self._free: dict[tuple[int, str], list[_HostBuffer]] = defaultdict(list)
        self.bytes_in_use = 0
        self.bytes_allocated = 0

    def take(self, nbytes: int, kind: str) -> "_HostBuffer":
        """A buffer of `nbytes` bytes of `kind` ("plain", "pinned" or "fake")."""
        free = self._free[nbytes, kind]
        if free:
            buffer = free.pop()
        else:
            data = (
                None
                if kind == "fake"
                else torch.empty(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned")
            )
            buffer = _HostBuffer(data, nbytes, kind)
            self.bytes_allocated += nbytes
        self.bytes_in_use += nbytes
        return buffer

    def give_back(self, buffer: "_HostBuffer") -> None:
        self.bytes_in_use -= buffer.nbytes
        self._free[buffer.nbytes, buffer.kind].append(buffer)

    @property
    def free_buffers(self) -> int:
        return sum(len(free) for free in self._free.values())

    def free_buffer_tensors(self) -> list[torch.Tensor]:
        """The free buffers' memory (a measurement leaves it out of the device's bytes)."""
        return [buffer.data for free in self._free.values() for buffer in free if buffer.data is not None]


class _HostBuffer:
    """One pooled host buffer; `last_read` is the event after the last copy out of it, which a
    new copy into it waits for."""

    def __init__(self, data: torch.Tensor | None, nbytes: int, kind: str):
        self.data, self.nbytes, self.kind = data, nbytes, kind
        self.last_read: torch.Event | None = None


class _StorageCopy:
    """One device storage's bytes in a host buffer, and (after a prefetch) on the device again.
    Tensors that share the storage (a tensor and a view of it, both saved) share the copy."""

    def __init__(self, offloader: "ActivationOffloader", local: torch.Tensor, group: "_Group"):
        self.group, self.device = group, local.device
        self.nbytes = local.untyped_storage().nbytes()
        self._offloader = offloader
        self._buffer: _HostBuffer | None = offloader.pool.take(self.nbytes, _buffer_kind(local))
        self._copied: torch.Event | None = None
        self.on_device: torch.Tensor | None = None
        self._arrived: torch.Event | None = None
        # A copy that backward never reads (a checkpoint's early stop) still returns its buffer.
        weakref.finalize(self, _give_back_once, offloader.pool, self.__dict__)

    def start(self, local: torch.Tensor) -> None:
        """Start the copy of `local` (a tensor on this storage) to the host buffer."""
        self._copied = self._offloader._to_host(local, self._buffer)

    def prefetch(self) -> None:
        """Start the copy back to the device (no wait); the host buffer goes back to the pool."""
        if self.on_device is None:
            offloader = self._offloader
            self.on_device, self._arrived = offloader._to_device(self._buffer, self._copied, self.device)
            _give_back_once(offloader.pool, self.__dict__)

    def restore(self) -> torch.Tensor:
        """The storage's bytes on the device, as a flat uint8 tensor."""
        self.prefetch()
        if self._arrived is not None:
            self._offloader._wait_for(self._arrived, self.device)
            self._arrived = None
        return self.on_device


class OffloadedTensor:
    """A tensor whose storage waits in host memory (`_StorageCopy`), and how to view it again on
    the device: its dtype, shape and strides, and for a DTensor its mesh and placements (the
    local shard is what moves). `restore()` may be called more than once (a tensor saved by two
    ops, a zero-bubble schedule's second backward pass): the first brings it back, later ones
    view the same device memory.
    """

    def __init__(self, tensor: torch.Tensor, storage: _StorageCopy):
        self.storage = storage
        local = _local(tensor)
        self.dtype, self.shape, self.stride = local.dtype, local.shape, local.stride()
        self.spec = None
        if isinstance(tensor, DTensor):
            self.spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())

    def restore(self) -> torch.Tensor:
        """The tensor on the device, as it was offloaded (a DTensor again if it was one)."""
        local = self.storage.restore().view(self.dtype).as_strided(self.shape, self.stride)
        if self.spec is None:
            return local
        mesh, placements, shape, stride = self.spec
        with torch.no_grad():
            return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _give_back_once(pool: HostPool, state: dict) -> None:
    buffer = state.get("_buffer")
    if buffer is not None:
        state["_buffer"] = None
        pool.give_back(buffer)


def _buffer_kind(local: torch.Tensor) -> str:
    if isinstance(local, FakeTensor):
        return "fake"
    return "plain" if local.device.type == "cpu" else "pinned"


def _storage_bytes(local: torch.Tensor) -> torch.Tensor:
    """`local`'s whole storage as a flat uint8 tensor (`local` covers it: see `offloads`)."""
    return torch.empty(0, dtype=torch.uint8, device=local.device).set_(local.untyped_storage())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds `tensor`'s memory on this rank, outside autograd."""
    with torch.no_grad():
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor.detach()


class _Group:
    """The tensors one block offloaded in one forward pass (one micro-batch)."""

    def __init__(self, block: int, previous: "_Group | None"):
        self.block, self.previous = block, previous
        self.copies: weakref.WeakSet = weakref.WeakSet()
        # While the block runs forward: each offloaded storage by identity, with a tensor on it
        # held so that the storage is not freed (and its identity reused) before the block ends.
        self.packing: dict[int, tuple[torch.Tensor, _StorageCopy]] = {}
        # Copies that start when the block ends: a collective's output is written only once
        # the block waits for it.
        self.deferred: list[tuple[torch.Tensor, _StorageCopy]] = []
        self.entered_backward = False


class ActivationOffloader:
    """Moves what the chosen blocks hold for backward to a `HostPool`, and back.

    One per model. The plan calls `new_pass()` at the start of each forward of the model (each
    micro-batch), and runs each chosen block's forward inside `block(index)` with
    `saved_tensors_hooks()`; op-SAC's cache offloads its saved outputs through `offload`.

    Args:
        min_bytes: tensors smaller than this stay on the device: their copy costs more in launch
            time than their memory is worth.

    Attributes:
        pool: the host buffers.
        log: what happened, in order, for tests and the benchmark: ("offload", block, bytes) in
            forward; in backward ("backward", block) at a block's first restore and
            ("prefetch", block) when a block's copies back start. `new_pass()` clears it unless
            `keep_log` is set.
        bytes_by_block: the bytes each block offloaded in the latest forward.
        bytes_total_by_block: the bytes each block offloaded since this offloader was made
            (each crosses the bus twice: out in forward, back in backward); `bytes_total` sums
            them.

    Pitfalls: a tensor is offloaded only when it is a plain tensor (or a DTensor of one) that
    owns its whole storage, is not a parameter or a view of one, and has at least `min_bytes`;
    anything else stays where it is. A saved tensor mutated in place after its block's forward
    would be restored as it was when saved (autograd would have refused the mutation anyway).
    """

    def __init__(self, min_bytes: int = MIB):
        self.min_bytes = min_bytes
        self.pool = HostPool()
        self._streams: dict[torch.device, tuple[torch.Stream, torch.Stream]] = {}
        self._group: _Group | None = None
        self._last_group: _Group | None = None
        self.log: list[tuple] = []
        self.keep_log = False
        self.bytes_by_block: dict[int, int] = defaultdict(int)
        self.bytes_total_by_block: dict[int, int] = defaultdict(int)

    @property
    def bytes_total(self) -> int:
        """The bytes offloaded since this offloader was made, all blocks."""
        return sum(self.bytes_total_by_block.values())

    # ----- forward ---------------------------------------------------------------------------

    def new_pass(self) -> None:
        """A forward of the model begins: the blocks' groups chain anew (backward prefetches
        along this chain, last block first)."""
        self._last_group = None
        self.bytes_by_block.clear()
        if not self.keep_log:
            self.log.clear()

    @contextlib.contextmanager
    def block(self, index: int):
        """What is offloaded inside belongs to block `index`."""
        self._group = _Group(index, self._last_group)
        try:
            yield
        finally:
            for local, copy in self._group.deferred:
                copy.start(local)
            self._group.deferred.clear()
            self._group.packing.clear()
            self._last_group, self._group = self._group, None

    def saved_tensors_hooks(self):
        """autograd's saved-tensor hooks that offload what `offloads` accepts."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def offloads(self, tensor) -> bool:
        """Whether `tensor` leaves the device (see the class's pitfalls)."""
        if self._group is None or not isinstance(tensor, torch.Tensor) or isinstance(tensor, nn.Parameter):
            return False
        if tensor._base is not None and isinstance(tensor._base, nn.Parameter):
            return False
        local = _local(tensor)
        if (
            type(local) not in (torch.Tensor, FakeTensor)
            or local.is_sparse
            or not is_non_overlapping_and_dense_or_false(local)
        ):
            return False
        nbytes = local.numel() * local.element_size()
        return nbytes >= self.min_bytes and local.untyped_storage().nbytes() == nbytes

    def offload(self, tensor: torch.Tensor, when_block_ends: bool = False) -> OffloadedTensor:
        """Start the copy of `tensor`'s storage to host memory and return its handle; the caller
        drops `tensor`. Tensors on one storage (saved by several ops, or views of each other)
        share one copy within a block.

        Args:
            when_block_ends: start the copy only when the block's forward ends: for the output
                of an asynchronous collective, which holds its data only after a wait.
        """
        group, local = self._group, _local(tensor)
        # The storage's identity (its C++ object), which fake tensors have too, unlike an address.
        identity = local.untyped_storage()._cdata
        if identity not in group.packing:
            copy = _StorageCopy(self, local, group)
            if when_block_ends:
                group.deferred.append((local, copy))
            else:
                copy.start(local)
            group.packing[identity] = (local, copy)
            group.copies.add(copy)
            self.bytes_by_block[group.block] += copy.nbytes
            self.bytes_total_by_block[group.block] += copy.nbytes
            self.log.append(("offload", group.block, copy.nbytes))
        return OffloadedTensor(tensor, group.packing[identity][1])

    def _pack(self, tensor):
        # Autograd also saves tensors outside the graph (masks, the RoPE table, a module's
        # buffers): only activations, which require grad, move.
        if tensor.requires_grad and self.offloads(tensor):
            return self.offload(tensor)
        # Not the tensor itself: a saved output would then hold its own grad_fn, a cycle through
        # C++ that keeps the whole graph alive when forward runs without backward.
        return tensor.detach()

    def _unpack(self, packed):
        return self.restore(packed) if isinstance(packed, OffloadedTensor) else packed

    # ----- backward --------------------------------------------------------------------------

    def restore(self, handle: OffloadedTensor) -> torch.Tensor:
        """`handle`'s tensor on the device. The first restore from a block's group also starts
        bringing back the group of the block before it (one block ahead of backward)."""
        group = handle.storage.group
        if not group.entered_backward:
            group.entered_backward = True
            self.log.append(("backward", group.block))
            self._prefetch(group)
            if group.previous is not None:
                self._prefetch(group.previous)
        return handle.restore()

    def _prefetch(self, group: _Group) -> None:
        copies = list(group.copies)
        if any(copy.on_device is None for copy in copies):
            self.log.append(("prefetch", group.block))
        for copy in copies:
            copy.prefetch()

    # ----- copies ----------------------------------------------------------------------------

    def _to_host(self, local: torch.Tensor, buffer: _HostBuffer) -> torch.Event | None:
        """Copy `local`'s storage into `buffer`; from an accelerator, asynchronously on the
        offload stream, after the last copy out of that buffer."""
        if buffer.kind == "fake":
            return None
        host, local = buffer.data, _storage_bytes(local)
        if buffer.kind == "plain":
            with torch.no_grad():
                host.copy_(local)
            return None
        to_host, _ = self._side_streams(local.device)
        to_host.wait_stream(torch.accelerator.current_stream(local.device))
        if buffer.last_read is not None:
            to_host.wait_event(buffer.last_read)
        with to_host, torch.no_grad():
            host.copy_(local, non_blocking=True)
            local.record_stream(to_host)
            done = torch.Event(device=local.device)
            done.record(to_host)
        return done

    def _to_device(
        self, buffer: _HostBuffer, copied: torch.Event | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Event | None]:
        """A device copy of `buffer` (flat uint8), and the event after which it is there."""
        if buffer.kind != "pinned":
            on_device = torch.empty(buffer.nbytes, dtype=torch.uint8, device=device)
            if buffer.kind == "plain":
                with torch.no_grad():
                    on_device.copy_(buffer.data)
            return on_device, None
        compute = torch.accelerator.current_stream(device)
        _, to_device = self._side_streams(device)
        if copied is not None:
            to_device.wait_event(copied)
        # Allocated on the copy stream, so that the copy cannot overwrite memory the compute
        # stream's queued kernels still read; marked used by the compute stream, which frees it.
        with to_device, torch.no_grad():
            on_device = torch.empty(buffer.nbytes, dtype=torch.uint8, device=device)
            on_device.copy_(buffer.data, non_blocking=True)
            arrived = torch.Event(device=device)
            arrived.record(to_device)
        on_device.record_stream(compute)
        buffer.last_read = arrived
        return on_device, arrived

    def _side_streams(self, device: torch.device) -> tuple[torch.Stream, torch.Stream]:
        """(device-to-host, host-to-device) streams of `device`, made on first use."""
        if device not in self._streams:
            self._streams[device] = (torch.Stream(device), torch.Stream(device))
        return self._streams[device]

    def _wait_for(self, event: torch.Event, device: torch.device) -> None:
        torch.accelerator.current_stream(device).wait_event(event)


# The offloader of each model whose AC plan offloads (see `attach`).
_OFFLOADERS: "weakref.WeakKeyDictionary[nn.Module, ActivationOffloader]" = weakref.WeakKeyDictionary()


def attach(model: nn.Module, offloader: ActivationOffloader) -> None:
    """Make `offloader` `model`'s: each forward of `model` starts a new pass of it, and
    `offloaders_in` finds it."""
    _OFFLOADERS[model] = offloader
    model.register_forward_pre_hook(lambda module, args: offloader.new_pass())


def offloaders_in(module: nn.Module) -> list[ActivationOffloader]:
    """The offloaders attached to `module` or its submodules (one per pipeline stage)."""
    return [_OFFLOADERS[m] for m in module.modules() if m in _OFFLOADERS]
