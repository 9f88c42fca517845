"""Dataloaders as torchdata `StatefulDataLoader`s, so a resume continues with unseen tokens."""

import atexit
import logging
import signal
import warnings
import weakref

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig, Training, Validation
from torchtitan.datasets.text_datasets import StreamingTokenDataset, build_text_dataset

logger = logging.getLogger(__name__)

# torchdata 0.11 calls an API torch deprecated later; the warning says nothing to our users.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")


def build_text_dataloader(
    job_config: JobConfig, tokenizer, dp_rank: int, dp_degree: int
) -> StatefulDataLoader:
    """The infinite training loader of `[training]`: batches of (input, label) token ids.

    A hub-streamed dataset is read and tokenized by `training.dataloader_num_workers` worker
    processes, each over its own file shards of this rank's part of the stream, so a step does
    not wait on the network or the tokenizer. Batches then come from the workers in turn, so
    the token order differs from a run with another worker count; a resume needs the count the
    checkpoint was saved with. Local and bundled data are pre-tokenized windows that load in
    microseconds, and load in the training process whatever the key says.

    Raises:
        ConfigError: more workers than this rank's file shards of the stream (the extra ones
            would have nothing to read).
    """
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
    workers = _training_workers(t, dataset, dp_rank)
    loader = StatefulDataLoader(
        dataset,
        batch_size=t.local_batch_size,
        num_workers=workers,
        pin_memory=_pin_memory(t),
        worker_init_fn=_leave_stop_signals_to_the_trainer if workers else None,
    )
    if workers:
        _shut_down_workers_at_exit(loader)
    return loader


def _training_workers(t: Training, dataset, dp_rank: int) -> int:
    if not t.dataloader_num_workers:
        return 0
    if not isinstance(dataset, StreamingTokenDataset):
        if dp_rank == 0:
            logger.info(
                f"'training.dataloader_num_workers' = {t.dataloader_num_workers} applies to hub-streamed "
                f"datasets; '{t.dataset_path or t.dataset}' is read as pre-tokenized windows in the "
                "training process, which takes microseconds a batch"
            )
        return 0
    if t.dataloader_num_workers > dataset.num_shards:
        raise ConfigError(
            f"'training.dataloader_num_workers' = {t.dataloader_num_workers}, but data-parallel rank "
            f"{dp_rank} reads {dataset.num_shards} file shard(s) of '{t.dataset}' and each worker needs "
            f"one of its own; set it to at most {dataset.num_shards}."
        )
    if dp_rank == 0:
        logger.info(
            f"'{t.dataset}' streams through {t.dataloader_num_workers} loader worker(s) per rank, over "
            f"rank 0's {dataset.num_shards} file shard(s)"
        )
    return t.dataloader_num_workers


def _leave_stop_signals_to_the_trainer(worker_id: int) -> None:
    """SLURM (a preemption, scancel) and Ctrl-C signal every process of the job, loader workers
    included. A worker ended by the signal makes the loader raise in the training process
    before that process can save its stop checkpoint, so a worker ignores SIGINT and its first
    SIGTERM: the trainer stops at the end of its step and its loader then ends the workers (as
    their own watchdog does, should the trainer die). A later SIGTERM ends the worker, so that
    one stuck past the loader's shutdown still ends when terminated."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: signal.signal(signal.SIGTERM, signal.SIG_DFL))


def _shut_down_workers_at_exit(loader: StatefulDataLoader) -> None:
    """End `loader`'s workers when the process exits, whatever the exit. Left to interpreter
    exit, the DataLoader skips its own shutdown and multiprocessing terminates the workers with
    a SIGTERM, which they ignore (see above), so the exit would wait on them."""
    ref = weakref.ref(loader)

    def shut_down() -> None:
        # torchdata keeps the loader's iterator, which owns the workers, in `_iterator`.
        iterator = getattr(ref(), "_iterator", None)
        if hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    atexit.register(shut_down)


def _pin_memory(t: Training) -> bool:
    if t.dataloader_pin_memory and not torch.accelerator.is_available():
        logger.info("'training.dataloader_pin_memory' has no effect without an accelerator")
        return False
    return t.dataloader_pin_memory


def unwrap_worker_error(error: ConfigError) -> ConfigError:
    """A loader worker's ConfigError with its own message, not the worker traceback that the
    DataLoader re-raises it with: a bad record deep in a hub stream is the user's to fix."""
    marker = "ConfigError: "
    text = str(error)
    if not text.startswith("Caught ConfigError in DataLoader worker") or marker not in text:
        return error
    return ConfigError(text.rpartition(marker)[2].strip())


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
