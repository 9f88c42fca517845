"""Which device a rank uses and which collective backend goes with it; the only place that
names a device type."""

import os

import torch


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
