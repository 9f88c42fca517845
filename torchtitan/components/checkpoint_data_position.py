"""The data loader's position in a checkpoint: saved per data-parallel rank, and restored into
the same layout, or, for a packed dataset, carried over to another one."""

import logging
import pickle
from pathlib import Path

from torch.distributed.checkpoint import DefaultLoadPlanner

from torchtitan.components.checkpoint_folders import load_from, read_metadata
from torchtitan.config.errors import ConfigError

logger = logging.getLogger(__name__)


def saved_data_position(dataloader, dp_rank: int) -> dict:
    """What a checkpoint stores of `dataloader`: its state under this rank's slot, pickled whole
    (DCP restores nested non-tensor values only where the loading run's own state has the same
    keys, and a streaming dataset's nested state varies)."""
    return {f"dp{dp_rank}": pickle.dumps(dataloader.state_dict())}


def restore_data_position(
    dataloader, folder: Path, saved_train_state: dict, *, dp_rank: int, dp_degree: int, dataset_name: str
) -> None:
    """Load into `dataloader` the position saved in the checkpoint `folder`.

    Args:
        saved_train_state: the checkpoint's `dp_degree` and `local_batch_size`.
        dp_rank, dp_degree: this rank's data-parallel index and the data-parallel size.
        dataset_name: `training.dataset`, for messages.

    Raises:
        ConfigError: for a position that cannot continue here: a streamed dataset's in another
            layout or with another loader worker count, or a packed dataset's into a streamed
            one (and the reverse); each message says what to change.
    """
    saved_dp = int(saved_train_state["dp_degree"])
    saved_batch = int(saved_train_state["local_batch_size"])
    dataset = dataloader.dataset
    packed = hasattr(dataset, "state_continuing")
    own_slot = f"dp{dp_rank}" if saved_dp == dp_degree else "dp0"
    loader_state = _read_loader_state(dataloader, folder, own_slot, packed)
    if ("sample_index" in _a_dataset_state(loader_state)) != packed:
        raise ConfigError(
            f"checkpoint {folder} holds the data position of a "
            f"{'streamed' if packed else 'packed'} dataset, but training.dataset = "
            f"'{dataset_name}' is {'packed' if packed else 'streamed'} here; "
            "add 'dataloader' to checkpoint.exclude_from_loading to start its data from the beginning."
        )
    same_layout = saved_dp == dp_degree and (
        not packed
        or (saved_batch, loader_state["dataset_state"].get("seq_len", dataset.seq_len))
        == (dataset.local_batch_size, dataset.seq_len)
    )
    if same_layout and not packed:
        _refuse_other_worker_count(folder, loader_state, dataloader.num_workers)
    if same_layout:
        dataloader.load_state_dict(loader_state)
        return
    if not packed:
        raise ConfigError(
            f"checkpoint {folder} was saved with data-parallel degree {saved_dp} and this run has "
            f"{dp_degree}: a streaming dataset's position cannot move between layouts. Add "
            "'dataloader' to checkpoint.exclude_from_loading to restart the data stream."
        )
    # Packed datasets deal global windows in order, so the number consumed is
    # layout-independent and this layout continues from it. (The loader applies the
    # dataset state when its iterator is created, so the saved state itself is rewritten.)
    saved_seq_len = loader_state["dataset_state"].get("seq_len", dataset.seq_len)
    loader_state["dataset_state"] = dataset.state_continuing(
        loader_state["dataset_state"], saved_batch, saved_dp
    )
    dataloader.load_state_dict(loader_state)
    seq_lens = ""
    if saved_seq_len != dataset.seq_len:
        seq_lens = f", seq_len {saved_seq_len} -> {dataset.seq_len}"
    logger.info(
        f"Data position carried over from data-parallel degree {saved_dp} x local batch {saved_batch} "
        f"to {dp_degree} x {dataset.local_batch_size}{seq_lens}: "
        f"{loader_state['dataset_state']['window_offset']} windows of {dataset.seq_len} tokens consumed"
    )


def _refuse_other_worker_count(folder: Path, loader_state: dict, workers: int) -> None:
    """Each loader worker saves its own place in its own shards of a stream, so a position
    restores only into as many workers as saved it."""
    saved = _loader_workers(loader_state)
    if saved != workers:
        raise ConfigError(
            f"checkpoint {folder} holds the stream's position as read by {saved} loader worker(s) "
            f"('training.dataloader_num_workers' = {saved}) and this run sets {workers}: each worker "
            f"keeps its own place in its own shards. Set it to {saved}, or add 'dataloader' to "
            "checkpoint.exclude_from_loading to restart the data stream."
        )


def _read_loader_state(dataloader, folder: Path, slot: str, packed: bool) -> dict:
    """The loader state saved under `slot`: pickled whole, or, by checkpoints written before
    that, as DCP's nested keys, which restore a packed dataset's flat state only."""
    if f"dataloader.{slot}" in read_metadata(folder).state_dict_metadata:
        state = {"dataloader": {slot: b""}}
        load_from(folder, state)
        return pickle.loads(state["dataloader"][slot])
    if not packed:
        raise ConfigError(
            f"checkpoint {folder} stores a streaming dataset's position in an older form that does "
            "not restore exactly; add 'dataloader' to checkpoint.exclude_from_loading to restart "
            "the data stream."
        )
    state = {"dataloader": {slot: dataloader.state_dict()}}
    # Partial: keys added to the dataset state since then keep this run's values.
    load_from(folder, state, planner=DefaultLoadPlanner(allow_partial_load=True))
    return state["dataloader"][slot]


def _loader_workers(loader_state: dict) -> int:
    """The worker count of the StatefulDataLoader that saved `loader_state`."""
    snapshot = loader_state.get("_snapshot")
    return 0 if snapshot is None else int(snapshot["_main_snapshot"]["_num_workers"])


def _a_dataset_state(loader_state: dict) -> dict:
    """The dataset's state in `loader_state`, or, where loader workers saved it, worker 0's
    (every worker's has the same keys, which tell a packed dataset from a streamed one)."""
    if "_snapshot" not in loader_state:
        return loader_state["dataset_state"]
    workers = loader_state["_snapshot"]["_worker_snapshots"]
    return workers[min(workers)]["dataset_state"]
