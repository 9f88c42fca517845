"""Dataloaders as torchdata `StatefulDataLoader`s, so a resume continues with unseen tokens."""

import logging
import warnings

from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.config.job_config import JobConfig, Training, Validation
from torchtitan.datasets.text_datasets import build_text_dataset

logger = logging.getLogger(__name__)

# torchdata 0.11 calls an API torch deprecated later; the warning says nothing to our users.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")


def build_text_dataloader(
    job_config: JobConfig, tokenizer, dp_rank: int, dp_degree: int
) -> StatefulDataLoader:
    """The infinite training loader of `[training]`: batches of (input, label) token ids."""
    t = job_config.training
    dataset = build_text_dataset(
        t.dataset,
        t.dataset_path,
        tokenizer,
        t.seq_len,
        dp_rank,
        dp_degree,
        t.local_batch_size,
        infinite=True,
    )
    return StatefulDataLoader(dataset, batch_size=t.local_batch_size, num_workers=0)


def build_validation_dataloader(
    job_config: JobConfig, tokenizer, dp_rank: int, dp_degree: int
) -> StatefulDataLoader:
    """One finite pass over the held-out split of `[validation]`."""
    _warn_if_validating_on_the_bundled_corpus_only(job_config)
    _warn_if_validating_on_the_training_data(job_config)
    v = job_config.validation
    dataset = build_text_dataset(
        v.dataset,
        v.dataset_path,
        tokenizer,
        v.seq_len,
        dp_rank,
        dp_degree,
        v.local_batch_size,
        infinite=False,
        key="validation.dataset",
    )
    global_batch = v.local_batch_size * dp_degree
    whole_batches = dataset.num_windows // global_batch
    batches = whole_batches if v.steps == -1 else min(v.steps, whole_batches)
    if batches * global_batch < dataset.num_windows:
        why = f"'validation.steps' = {v.steps} batches" if batches < whole_batches else "whole batches"
        logger.info(
            f"Each validation pass reads {batches * global_batch} of the split's {dataset.num_windows} "
            f"windows of {v.seq_len + 1} tokens: {why} of {v.local_batch_size} x {dp_degree} ranks"
        )
    return StatefulDataLoader(dataset, batch_size=v.local_batch_size, num_workers=0)


def _warn_if_validating_on_the_bundled_corpus_only(job_config: JobConfig) -> None:
    # [validation]'s defaults name the bundled smoke split, which suits only the bundled
    # training corpus; for any other data its loss says nothing about the run.
    t, v = job_config.training, job_config.validation
    trains_on_bundled = t.dataset == Training.dataset and t.dataset_path is None
    validation_default = v.dataset == Validation.dataset and v.dataset_path is None
    if trains_on_bundled or not validation_default:
        return
    trained_on = f"'training.dataset_path' = '{t.dataset_path}'" if t.dataset_path else f"'{t.dataset}'"
    logger.warning(
        f"Validating on the bundled smoke corpus ('validation.dataset' = '{v.dataset}', the default) "
        f"while training on {trained_on}, so the validation loss does not measure this data. "
        "Set validation.dataset_path to local files of a held-out split of it."
    )


def _warn_if_validating_on_the_training_data(job_config: JobConfig) -> None:
    t, v = job_config.training, job_config.validation
    same = (t.dataset_path, v.dataset_path) if t.dataset_path or v.dataset_path else (t.dataset, v.dataset)
    if same[0] == same[1]:
        key = "dataset_path" if t.dataset_path or v.dataset_path else "dataset"
        logger.warning(
            f"'validation.{key}' = '{same[1]}' is the training data ('training.{key}'), so the "
            "validation loss measures memorization, not generalization; point it at a held-out split."
        )
