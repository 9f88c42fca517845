"""Seeding and deterministic kernels."""

import os

import torch


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
