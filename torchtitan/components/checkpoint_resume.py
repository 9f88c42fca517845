"""Which checkpoint a resume loads, what a rollback or restart sets aside, and this run's
hyperparameters put back over a loaded optimizer's and scheduler's."""

import logging
from pathlib import Path

from torchtitan.components.checkpoint_folders import (
    SUPERSEDED_SUFFIX,
    BackgroundFileWork,
    complete_steps,
    hf_export_steps,
    incomplete_steps,
    keep_incomplete_aside,
    resumable_steps,
    set_aside,
    step_folder,
)
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Checkpoint, Optimizer

logger = logging.getLogger(__name__)


def choose_resume_step(folder: Path, config: Checkpoint) -> int | None:
    """The step to resume from in `folder`: `load_step`, else the newest complete checkpoint that
    holds a training state, else a seed checkpoint (model only, step 0), else None. Folders
    without `.metadata` are renamed aside first (only warned about under `load_only`).

    A model-only final save (`last_save_model_only`) is an export: a later run resumes from the
    full checkpoint before it, and with none, is refused rather than restarted from step 0 with
    the exported weights (which would repeat warmup and data on them), unless it names the
    weights to start from (`initial_load_path`): then None.

    Raises:
        ConfigError: for a missing `load_step`, or a folder of exports only.
    """
    _keep_incomplete_aside(folder, config.load_only)
    steps = complete_steps(folder)
    if config.load_step >= 0:
        if config.load_step not in steps:
            raise ConfigError(
                f"'checkpoint.load_step' = {config.load_step} has no complete checkpoint in {folder} "
                f"(complete: {steps or 'none'}); choose one of those, or -1 for the newest."
            )
        return config.load_step
    resumable = resumable_steps(folder)
    if resumable:
        return resumable[-1]
    exports = [s for s in steps if s > 0]
    hf_exports = hf_export_steps(folder)
    if (exports or hf_exports) and config.initial_load_path:
        # The run names its start, so the exports are passed over; upstream torchtitan, which
        # resumes only from folders with DCP metadata, does the same.
        logger.info(
            f"{folder} holds only exports (model-only steps {exports}, Hugging Face steps {hf_exports}), "
            f"which a run cannot resume from: starting from checkpoint.initial_load_path"
        )
        return None
    if exports:
        raise ConfigError(
            f"{folder} holds only model-only checkpoints (steps {exports}: the exports a "
            "run writes at its end with checkpoint.last_save_model_only), which a run cannot "
            "resume from. To train on from those weights, set "
            f"checkpoint.initial_load_path = '{folder / f'step-{exports[-1]}'}'; to end runs "
            "resumably, set checkpoint.last_save_model_only = false."
        )
    if hf_exports:
        raise ConfigError(
            f"{folder} holds only Hugging Face exports (steps {hf_exports}: what a run "
            "writes at its end with checkpoint.last_save_in_hf), which a run cannot resume from. "
            "To train on from those weights, set "
            f"checkpoint.initial_load_path = '{folder / f'step-{hf_exports[-1]}-hf'}' and "
            "checkpoint.initial_load_in_hf = true; to end runs resumably, set last_save_in_hf = false."
        )
    return 0 if steps else None


def _keep_incomplete_aside(folder: Path, load_only: bool) -> None:
    """Rename `step-N` folders without `.metadata` aside (`keep_incomplete_aside`), so that
    neither a resume nor the next save of that step (which replaces the folder) touches them; a
    load_only run, which leaves the folder as it is, only warns."""
    if load_only:
        for step in incomplete_steps(folder):
            logger.warning(f"Checkpoint {step_folder(folder, step)} has no .metadata: not resumed from")
        return
    keep_incomplete_aside(folder)


def rename_newer_than(folder: Path, step: int, file_work: BackgroundFileWork) -> None:
    """Rename the complete checkpoints in `folder` newer than `step` to `step-N.superseded`
    (an earlier rollback's of the same step are deleted by `file_work`): left in place, the
    next plain resume would pick the abandoned run's newest, this run would overwrite them one
    by one, and `keep_latest_k` would delete this run's checkpoints before them. Rank 0 only."""
    newer = [s for s in complete_steps(folder) if s > step]
    for s in newer:
        checkpoint = step_folder(folder, s)
        superseded = checkpoint.with_name(checkpoint.name + SUPERSEDED_SUFFIX)
        if superseded.exists():
            file_work.delete([set_aside(superseded)])
        checkpoint.rename(superseded)
    if newer:
        logger.warning(
            f"Set aside the checkpoints of steps {newer}, newer than step {step} of this run, as "
            f"step-N{SUPERSEDED_SUFFIX} in {folder} (rename one back to resume from it)"
        )


def use_the_schedulers_lr(optimizer, lr_scheduler, config: Optimizer) -> None:
    """After a load: put this run's `[optimizer]` hyperparameters back
    (`use_this_runs_hyperparameters`), then set the optimizer's lr to the one this run's
    schedule gives the next step.

    `LambdaLR.load_state_dict` restores the schedule's position but leaves the optimizer's lr
    alone, and a loaded optimizer brings the lr of the step after its save: with only one of the
    two loaded (`exclude_from_loading`, or an initial load with the optimizer), the first step
    would use an lr the log does not show.
    """
    use_this_runs_hyperparameters(optimizer, lr_scheduler, config)
    # Recomputed from this run's schedule rather than the saved `get_last_lr()`: a resume with
    # another training.steps (or warmup, decay) would run its first step at the old schedule's
    # lr. The multipliers are this run's: LambdaLR saves no plain function.
    factors = [factor(lr_scheduler.last_epoch) for factor in lr_scheduler.lr_lambdas]
    for group, base, factor in zip(optimizer.param_groups, lr_scheduler.base_lrs, factors, strict=True):
        group["lr"] = base * factor


def use_this_runs_hyperparameters(optimizer, lr_scheduler, config: Optimizer) -> None:
    """Put this run's `[optimizer]` peak lr, betas, eps and weight decay back over the
    checkpoint's: a loaded optimizer and scheduler bring the saved ones, so a resume that
    lowered `optimizer.lr` after a loss spike kept training at the old peak, silently.
    Logs what changed."""
    configured = {"lr": config.lr, "betas": (config.beta1, config.beta2), "eps": config.eps,
                  "weight_decay": config.weight_decay}  # fmt: skip
    saved = {
        "lr": lr_scheduler.base_lrs[0],
        **{k: optimizer.param_groups[0][k] for k in configured if k != "lr"},
    }
    changed = [f"{key} {_plain(saved[key])} -> {_plain(value)}" for key, value in configured.items()
               if _plain(saved[key]) != _plain(value)]  # fmt: skip
    if not changed:
        return
    lr_scheduler.base_lrs = [config.lr] * len(optimizer.param_groups)
    for group in optimizer.param_groups:
        group.update({k: v for k, v in configured.items() if k != "lr"}, initial_lr=config.lr)
    logger.info(f"[optimizer] of this run replaces the checkpoint's: {', '.join(changed)}")


def _plain(value):
    """A hyperparameter as a comparable, printable value (betas load back as a list)."""
    return tuple(value) if isinstance(value, (list, tuple)) else value
