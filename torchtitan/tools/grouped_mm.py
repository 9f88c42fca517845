"""Whether `torch._grouped_mm` runs for a device and dtype: probed once, cached, eager and traced."""

import logging

import torch

_GROUPED_MM_SUPPORT: dict[tuple[torch.device, torch.dtype, bool], bool] = {}


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs for `dtype` on `device`; probed once per pair, and
    separately for code torch.compile traces.

    A capability check instead of a device-name list: kernels come and go per build and
    device generation. Traced code also needs the op's fake (meta) kernel to accept the dtype,
    which can be stricter than the eager kernel (torch 2.13: bf16 only, while the CPU kernel
    also runs fp32). Pitfall: it only says the op exists; row strides must still be 16-byte
    aligned (see `GroupedExperts.uses_grouped_mm`).
    """
    key = (torch.device(device), dtype, torch.compiler.is_compiling())
    if key not in _GROUPED_MM_SUPPORT:
        _GROUPED_MM_SUPPORT[key] = _probe_grouped_mm(*key)
    return _GROUPED_MM_SUPPORT[key]


def probe_grouped_mm_for_compile(device: torch.device, dtypes) -> bool:
    """Answer `grouped_mm_supported` for traced code ahead of torch.compile, for `device` and
    each of `dtypes`: a probe first reached while tracing would break the graph (and, inside
    an activation checkpoint, send the whole block back to eager).

    Returns:
        Whether compiled experts take the grouped path for every dtype (else the loop, which
        reads token counts on the host).
    """
    for dtype in dtypes:
        key = (torch.device(device), dtype, True)
        if key not in _GROUPED_MM_SUPPORT:
            _GROUPED_MM_SUPPORT[key] = _probe_grouped_mm(*key)
    return all(_GROUPED_MM_SUPPORT[torch.device(device), dtype, True] for dtype in dtypes)


@torch.compiler.disable
def _probe_grouped_mm(device: torch.device, dtype: torch.dtype, traced: bool) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    # Forward only, without grad: the probe may first run inside a checkpointed region,
    # where saving tensors would break the recompute's saved-tensor count. Real tensors even
    # under FakeTensorMode (the memory estimator): the answer is cached for real runs too.
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    with torch.no_grad(), unset_fake_temporarily():
        try:
            _run_grouped_mm(device, dtype)
            if traced:
                # The fake kernel's refusal is an expected answer here, not an error to log.
                fake_log = logging.getLogger("torch._subclasses.fake_tensor")
                level, fake_log.level = fake_log.level, logging.CRITICAL
                try:
                    with FakeTensorMode():
                        _run_grouped_mm(device, dtype)
                finally:
                    fake_log.setLevel(level)
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            return False
    return True


def _run_grouped_mm(device: torch.device, dtype: torch.dtype) -> None:
    a = torch.ones(16, 16, device=device, dtype=dtype)
    b = torch.ones(2, 16, 16, device=device, dtype=dtype)
    offs = torch.tensor([8, 16], device=device, dtype=torch.int32)
    torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
