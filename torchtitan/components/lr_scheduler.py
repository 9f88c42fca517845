"""Warmup -> stable -> decay learning-rate schedule (WSD), as a LambdaLR multiplier, with
upstream torchtitan's step arithmetic, so that a config brought from there trains alike."""

import functools
import logging
import math

from torch.optim.lr_scheduler import LambdaLR

from torchtitan.config.job_config import JobConfig

logger = logging.getLogger(__name__)


def lr_factor(step: int, warmup: int, decay: int, total: int, decay_type: str, min_factor: float) -> float:
    """The multiplier of the peak lr for optimizer step `step` (1-based).

    Warmup rises linearly to 1 at step `warmup`; the lr stays at 1 until the last `decay`
    steps, which follow `decay_type` (linear, sqrt or cosine) towards `min_factor`. The decay
    would reach `min_factor` one step after the run, at a virtual step `total + 1`, so that the
    last real step still learns (upstream torchtitan's rule).
    """
    if step <= warmup:
        return step / warmup
    decay_start = total + 1 - decay  # the last step at the peak
    if step <= decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / decay)
    if decay_type == "linear":
        remaining = 1.0 - progress
    elif decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    else:
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_factor + (1.0 - min_factor) * remaining


def schedule_steps(job_config: JobConfig) -> int:
    """The steps the schedule spans: `lr_scheduler.total_steps`, or `training.steps` when unset."""
    return job_config.lr_scheduler.total_steps or job_config.training.steps


def decay_steps(job_config: JobConfig) -> int:
    """The steps that decay: `decay_ratio` of the schedule's steps (all after warmup when
    unset), at most the steps after warmup."""
    cfg, total = job_config.lr_scheduler, schedule_steps(job_config)
    after_warmup = total - min(cfg.warmup_steps, total)
    if cfg.decay_ratio is None:
        return after_warmup
    wanted = round(total * cfg.decay_ratio)
    if wanted > after_warmup:
        logger.warning(
            f"'lr_scheduler.decay_ratio' = {cfg.decay_ratio} asks for {wanted} decay steps, but only "
            f"{after_warmup} of the {total} steps follow the warmup; decaying over those. Lower "
            "decay_ratio or lr_scheduler.warmup_steps to silence this warning."
        )
    return min(wanted, after_warmup)


def build_lr_scheduler(optimizer, job_config: JobConfig) -> LambdaLR:
    """A LambdaLR following `lr_factor` over `schedule_steps` steps.

    Pitfall: with `lr_scheduler.total_steps` beyond `training.steps` the run stops before the
    decay ends; past `total_steps` the lr stays at the minimum.
    """
    cfg, total = job_config.lr_scheduler, schedule_steps(job_config)
    _warn_if_only_warmup(
        cfg.warmup_steps, total, "lr_scheduler.total_steps" if cfg.total_steps else "training.steps"
    )
    factor = functools.partial(
        lr_factor,
        warmup=min(cfg.warmup_steps, total),
        decay=decay_steps(job_config),
        total=total,
        decay_type=cfg.decay_type,
        min_factor=cfg.min_lr_factor,
    )
    # LambdaLR counts from 0 at construction; step k of training uses factor(k).
    return LambdaLR(optimizer, lambda last_epoch: factor(last_epoch + 1))


def _warn_if_only_warmup(warmup_steps: int, steps: int, steps_key: str) -> None:
    # Not an error: a short debug run of a preset may be meant to stay in warmup. But a
    # shortened run that keeps the preset's warmup never decays, which is easy to miss in
    # the loss curve.
    if warmup_steps >= steps:
        logger.warning(
            f"'lr_scheduler.warmup_steps' = {warmup_steps} is not below '{steps_key}' = {steps}: "
            "the whole run is warmup, so the lr never decays (and reaches optimizer.lr only at the "
            f"last step, if at all). Set lr_scheduler.warmup_steps below {steps} (e.g. "
            f"--lr_scheduler.warmup_steps {steps // 10})."
        )
