"""Facts about the device: peak bf16 FLOPs (for MFU) and peak memory."""

import resource

import torch

# Dense bf16 tensor-core peaks, FLOP/s, from the vendors' datasheets (SXM parts unless
# named). The first entry whose key is in the device's name applies: variants come first.
_PEAK_BF16_FLOPS = (
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("B200", 2.25e15),
    ("A100", 312e12),
)


def peak_bf16_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of `device`, or None when unknown (the CPU, other GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in _PEAK_BF16_FLOPS if key in name), None)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def peak_memory_gib(device: torch.device) -> dict[str, float]:
    """Peak memory since the last reset: accelerator reserved/allocated, or CPU peak RSS."""
    gib = 1024**3
    if device.type == "cpu":
        return {"memory/max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib}
    stats = torch.accelerator.memory_stats(device)
    return {
        "memory/max_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / gib,
        "memory/max_allocated_gib": stats.get("allocated_bytes.all.peak", 0) / gib,
    }


def reset_peak_memory(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats(device)
