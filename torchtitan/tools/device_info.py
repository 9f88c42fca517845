"""Facts about the device: peak bf16 FLOPs (for MFU), peak memory bandwidth, and peak memory."""

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


# Peak memory bandwidths, bytes/s, from the same datasheets, matched the same way.
_PEAK_MEMORY_BANDWIDTH = (
    ("H200 NVL", 4.8e12),
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("B200", 8.0e12),
    ("A100", 2.0e12),
)


def peak_memory_bandwidth(device: torch.device) -> float | None:
    """Peak memory bandwidth of `device` in bytes/s, or None when unknown (the CPU, other GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bandwidth for key, bandwidth in _PEAK_MEMORY_BANDWIDTH if key in name), None)


def peak_bf16_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of `device`, or None when unknown (the CPU, other GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in _PEAK_BF16_FLOPS if key in name), None)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def peak_memory_gib(device: torch.device) -> dict[str, float]:
    """Memory statistics for the log: on an accelerator, the peak reserved and active bytes (also
    as percentages of the device's capacity) and allocated bytes since the last
    `reset_peak_memory`, and the caching allocator's running counts of allocation retries and
    out-of-memory errors; on the CPU, the process's peak RSS over its whole life (the kernel
    offers no reset, so a spike, e.g. while a checkpoint loads, shows in every later record)."""
    gib = 1024**3
    if device.type == "cpu":
        return {"memory/max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib}
    stats = torch.accelerator.memory_stats(device)
    reserved = stats.get("reserved_bytes.all.peak", 0)
    active = stats.get("active_bytes.all.peak", 0)
    record = {
        "memory/max_reserved_gib": reserved / gib,
        "memory/max_active_gib": active / gib,
        "memory/max_allocated_gib": stats.get("allocated_bytes.all.peak", 0) / gib,
        "memory/num_alloc_retries": stats.get("num_alloc_retries", 0),
        "memory/num_ooms": stats.get("num_ooms", 0),
    }
    capacity = capacity_bytes(device)
    if capacity:
        record["memory/max_reserved_pct"] = 100 * reserved / capacity
        record["memory/max_active_pct"] = 100 * active / capacity
    return record


def capacity_bytes(device: torch.device) -> int | None:
    """The device's memory in bytes; None on the CPU (and devices other than CUDA's)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def reset_peak_memory(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats(device)
