"""Warmup -> stable -> decay learning-rate schedule (WSD), as a LambdaLR multiplier."""

import functools
import logging
import math

from torch.optim.lr_scheduler import LambdaLR

from torchtitan.config.job_config import JobConfig

logger = logging.getLogger(__name__)


def lr_factor(
    step: int, warmup: int, stable_end: int, total: int, decay_type: str, min_factor: float
) -> float:
    """The multiplier of the peak lr for optimizer step `step` (1-based).

    Warmup rises linearly to 1 over `warmup` steps, stays at 1 until `stable_end`, then
    decays to `min_factor` at `total` following `decay_type` (linear, sqrt or cosine).
    """
    if step <= warmup:
        return step / (warmup + 1)
    if step <= stable_end or total <= stable_end:
        return 1.0
    progress = min(1.0, (step - stable_end) / (total - stable_end))
    if decay_type == "linear":
        remaining = 1.0 - progress
    elif decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    else:
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_factor + (1.0 - min_factor) * remaining


def build_lr_scheduler(optimizer, job_config: JobConfig) -> LambdaLR:
    """A LambdaLR following `lr_factor` over `training.steps` steps."""
    cfg, total = job_config.lr_scheduler, job_config.training.steps
    _warn_if_only_warmup(cfg.warmup_steps, total)
    warmup = min(cfg.warmup_steps, total)
    decay_steps = total - warmup if cfg.decay_ratio is None else round((total - warmup) * cfg.decay_ratio)
    factor = functools.partial(
        lr_factor,
        warmup=warmup,
        stable_end=total - decay_steps,
        total=total,
        decay_type=cfg.decay_type,
        min_factor=cfg.min_lr_factor,
    )
    # LambdaLR counts from 0 at construction; step k of training uses factor(k).
    return LambdaLR(optimizer, lambda last_epoch: factor(last_epoch + 1))


def _warn_if_only_warmup(warmup_steps: int, steps: int) -> None:
    # Not an error: a short debug run of a preset may be meant to stay in warmup. But a
    # shortened run that keeps the preset's warmup never reaches optimizer.lr, which is
    # easy to miss in the loss curve.
    if warmup_steps >= steps:
        logger.warning(
            f"'lr_scheduler.warmup_steps' = {warmup_steps} is not below 'training.steps' = {steps}: "
            "the whole run is warmup, so the lr never reaches optimizer.lr nor decays. Set "
            f"lr_scheduler.warmup_steps below {steps} (e.g. --lr_scheduler.warmup_steps "
            f"{steps // 10})."
        )
