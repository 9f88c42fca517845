"""Host staging of async saves (`checkpoint.async_mode = "async_with_pinned_mem"`): the state is
copied to host memory in the background, by one stager that every save reuses."""

import logging

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

logger = logging.getLogger(__name__)

# torch before 2.13 closes a DefaultStager's copier at the end of every copy, which drops its
# host buffers and empties its deepcopy table: a second copy fails (KeyError: <class 'type'>).
# There each save gets a stager of its own.
STAGER_REUSABLE = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


class HostStaging:
    """The stager of `async_with_pinned_mem` saves and the copy of the pending one.

    Args:
        device: the training device; on an accelerator the host buffers are pinned and the
            copies non-blocking.

    Pitfall: the copy runs while training goes on; `wait` before changing any saved tensor in
    place (the optimizer step).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stager: DefaultStager | None = None  # built at the first save
        self.pending = None  # future of the pending save's copy to host memory

    def stager_for_this_step(self) -> DefaultStager:
        """The stager for a save of the state as it is now. Built at the first save, since its
        copy stream must come after the training stream exists; reused after that so that its
        host buffers are allocated once (before torch 2.13, see STAGER_REUSABLE, a new one
        each save: the previous save's copy is done by then)."""
        if self.device.type != "cpu":
            # The stager copies on a stream of its own that does not wait for this one: without
            # this, the copy could read weights the optimizer step is still writing.
            torch.accelerator.current_stream(self.device).synchronize()
        if self.stager is not None and not STAGER_REUSABLE:
            self.close()
        if self.stager is None:
            accelerator = self.device.type != "cpu"
            if not accelerator:
                logger.info("checkpoint.async_mode 'async_with_pinned_mem' on the CPU: staging unpinned")
            options = StagingOptions(
                use_pinned_memory=accelerator,
                use_shared_memory=False,  # the upload runs in a thread of this process
                use_async_staging=True,
                use_non_blocking_copy=accelerator,
            )
            self.stager = DefaultStager(options)
        return self.stager

    def copying(self, future) -> None:
        """Note `future`, the copy of the save just started, for `wait`."""
        self.pending = future

    def wait(self) -> None:
        """Block until the pending save's copy to host memory is done; at once when none is."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def close(self) -> None:
        """Release the stager and its host buffers."""
        if self.stager is not None:
            self.stager.close()
            self.stager = None
