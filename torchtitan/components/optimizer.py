"""Adam/AdamW from `[optimizer]`, with the fastest kernel the device offers."""

import torch
import torch.nn as nn

from torchtitan.config.job_config import JobConfig


def build_optimizer(model: nn.Module, job_config: JobConfig, device: torch.device):
    """Adam or AdamW over all trainable parameters of `model`.

    `implementation = "fused"` uses the fused kernel on CUDA and falls back to foreach
    elsewhere, where PyTorch has no fused Adam for every dtype and layout. Expert-parallel
    parameters (plain local tensors marked `_ep_local`) get a param group of their own, same
    hyperparameters: the multi-tensor kernels refuse lists mixing them with FSDP's DTensors.
    """
    cfg = job_config.optimizer
    impl = cfg.implementation
    if impl == "fused" and device.type != "cuda":
        impl = "foreach"
    cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    params = [p for p in model.parameters() if p.requires_grad]
    ep_local = [p for p in params if getattr(p, "_ep_local", False)]
    groups = [{"params": [p for p in params if not getattr(p, "_ep_local", False)]}]
    if ep_local:
        groups.append({"params": ep_local})
    return cls(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )
