"""Dataloaders as torchdata `StatefulDataLoader`s, so a resume continues with unseen tokens."""

import warnings

from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.config.job_config import JobConfig
from torchtitan.datasets.text_datasets import build_text_dataset

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
    return StatefulDataLoader(dataset, batch_size=v.local_batch_size, num_workers=0)
