"""Adam/AdamW from `[optimizer]`, with the fastest kernel the device offers."""

import torch
import torch.nn as nn

from torchtitan.config.job_config import JobConfig


def build_optimizer(model: nn.Module, job_config: JobConfig, device: torch.device):
    """Adam or AdamW over all trainable parameters of `model`.

    `implementation = "fused"` uses the fused kernel on CUDA and falls back to foreach
    elsewhere, where PyTorch has no fused Adam for every dtype and layout.
    """
    cfg = job_config.optimizer
    impl = cfg.implementation
    if impl == "fused" and device.type != "cuda":
        impl = "foreach"
    cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    return cls(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )
