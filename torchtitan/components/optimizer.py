"""Adam/AdamW from `[optimizer]`, with the fastest kernel the device offers."""

import torch
import torch.nn as nn

from torchtitan.config.job_config import JobConfig


def build_optimizer(model: nn.Module, job_config: JobConfig, device: torch.device):
    """Adam or AdamW over all trainable parameters of `model`.

    `implementation = "fused"` uses the fused kernel on CUDA and falls back to foreach
    elsewhere, where PyTorch has no fused Adam for every dtype and layout. MoE expert weights
    get a param group of their own, same hyperparameters: under expert parallelism they are
    plain local tensors (or DTensors on another mesh), which the multi-tensor kernels refuse to
    mix with FSDP's DTensors. They get it in every layout, so that the optimizer and LR
    scheduler states of one layout load into another.
    """
    cfg = job_config.optimizer
    impl = cfg.implementation
    if impl == "fused" and device.type != "cuda":
        impl = "foreach"
    cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    experts = {id(p) for p in _expert_weights(model)}
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if id(p) not in experts]}]
    if experts:
        groups.append({"params": [p for p in params if id(p) in experts]})
    return cls(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )


def _expert_weights(model: nn.Module) -> list[nn.Parameter]:
    # Imported here: torchtitan.models imports every model, whose specs import this module.
    from torchtitan.models.moe import GroupedExperts

    return [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]
