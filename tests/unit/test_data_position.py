"""A resume under another data-parallel degree, local batch or seq_len reads the next unread data.

Each rank of the saving run is simulated in one process: its dataloader state goes into a real
DCP checkpoint, and every rank of the resuming layout loads it as a resume does
(`restore_data_position`).
"""

import logging

import numpy as np
import pytest
import torch.distributed.checkpoint as dcp
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.components.checkpoint_data_position import restore_data_position
from torchtitan.datasets.text_datasets import PackedTokenDataset

TOKENS = np.arange(10_000, dtype=np.int64)  # token t sits at position t, so inputs name their windows


def _loader(rank: int, dp: int, batch: int, seq_len: int = 4, tokens=TOKENS) -> StatefulDataLoader:
    dataset = PackedTokenDataset(tokens, seq_len, rank, dp, batch)
    return StatefulDataLoader(dataset, batch_size=batch, num_workers=0)


def _first_tokens(batch) -> list[int]:
    return batch[0][:, 0].tolist()


def _train(loaders, micro_batches: int) -> list[int]:
    """Every rank reads `micro_batches` batches; returns the first token of each window read."""
    iterators = [iter(loader) for loader in loaders]
    read = []
    for _ in range(micro_batches):
        for it in iterators:
            read += _first_tokens(next(it))
    return read


def _save(folder, loaders, batch: int) -> dict:
    state = {"dataloader": {f"dp{rank}": loader.state_dict() for rank, loader in enumerate(loaders)}}
    dcp.save(state, checkpoint_id=str(folder))
    return {"dp_degree": len(loaders), "local_batch_size": batch}


def _resume(folder, saved_train_state, dp: int, batch: int, seq_len: int = 4, tokens=TOKENS):
    loaders = []
    for rank in range(dp):
        loader = _loader(rank, dp, batch, seq_len, tokens)
        restore_data_position(
            loader, folder, saved_train_state, dp_rank=rank, dp_degree=dp, dataset_name="smoke"
        )
        loaders.append(loader)
    return loaders


@pytest.mark.parametrize(
    "saved, resumed",
    [((2, 2), (1, 4)),  # same global micro-batch
     ((2, 2), (1, 2)),  # dp halves, the global batch kept by more accumulation
     ((1, 4), (2, 4)),  # dp doubles
     ((2, 2), (2, 4)),  # same dp, other local batch
     ((2, 4), (3, 1))],  # a global micro-batch that does not divide what was read
)  # fmt: skip
def test_resume_under_another_layout_reads_the_next_unread_windows(saved, resumed, tmp_path):
    (dp, batch), (new_dp, new_batch) = saved, resumed
    loaders = [_loader(rank, dp, batch) for rank in range(dp)]
    read = _train(loaders, micro_batches=3)
    assert sorted(read) == [4 * w for w in range(3 * dp * batch)]
    train_state = _save(tmp_path / "step-3", loaders, batch)

    resumed_loaders = _resume(tmp_path / "step-3", train_state, new_dp, new_batch)

    next_read = sorted(_train(resumed_loaders, micro_batches=2))
    first_unread = len(read)
    assert next_read == [4 * w for w in range(first_unread, first_unread + 2 * new_dp * new_batch)]


def test_a_carried_over_position_survives_the_next_checkpoint(tmp_path):
    loaders = [_loader(rank, 2, 2) for rank in range(2)]
    _train(loaders, micro_batches=3)  # windows 0-11
    state = _save(tmp_path / "a", loaders, 2)
    single = _resume(tmp_path / "a", state, dp=1, batch=4)
    assert sorted(_train(single, micro_batches=1)) == [4 * w for w in range(12, 16)]
    state = _save(tmp_path / "b", single, 4)

    back_to_two = _resume(tmp_path / "b", state, dp=2, batch=2)

    assert sorted(_train(back_to_two, micro_batches=1)) == [4 * w for w in range(16, 20)]


def test_the_same_layout_loads_each_rank_its_own_position(tmp_path):
    loaders = [_loader(rank, 2, 2) for rank in range(2)]
    _train(loaders, micro_batches=2)
    state = _save(tmp_path / "step-2", loaders, 2)

    resumed = _resume(tmp_path / "step-2", state, dp=2, batch=2)

    # Windows 0-7 are read; the next global micro-batch is 8-9 on rank 0 and 10-11 on rank 1.
    assert [_first_tokens(next(iter(loader))) for loader in resumed] == [[32, 36], [40, 44]]


def test_a_new_seq_len_starts_at_the_first_window_after_the_unread_token(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    loaders = [_loader(rank, 2, 2, seq_len=4) for rank in range(2)]
    _train(loaders, micro_batches=3)  # 12 windows of 4: tokens 0-47 are read
    state = _save(tmp_path / "step-3", loaders, 2)

    resumed = _resume(tmp_path / "step-3", state, dp=1, batch=2, seq_len=10)

    # Token 48 is the first unread; windows of 10 start at 0, 10, ..., 50.
    assert _first_tokens(next(iter(resumed[0]))) == [50, 60]
    assert "from data-parallel degree 2 x local batch 2 to 1 x 2, seq_len 4 -> 10: 5 windows" in caplog.text


def test_positions_past_the_end_of_the_data_wrap_into_the_next_epoch(tmp_path):
    tokens = np.arange(41, dtype=np.int64)  # 10 windows of 4
    loaders = [_loader(rank, 2, 2, tokens=tokens) for rank in range(2)]
    _train(loaders, micro_batches=3)  # 12 windows: a whole epoch and 2 more
    state = _save(tmp_path / "step-3", loaders, 2)

    resumed = _resume(tmp_path / "step-3", state, dp=1, batch=4, tokens=tokens)

    assert sorted(_train(resumed, micro_batches=1)) == [8, 12, 16, 20]  # windows 2-5


def test_a_checkpoint_from_before_window_offsets_still_loads(tmp_path):
    loaders = [_loader(rank, 2, 2) for rank in range(2)]
    _train(loaders, micro_batches=3)
    old_format = {f"dp{rank}": loader.state_dict() for rank, loader in enumerate(loaders)}
    for state in old_format.values():
        state["dataset_state"] = {"sample_index": state["dataset_state"]["sample_index"]}
    dcp.save({"dataloader": old_format}, checkpoint_id=str(tmp_path / "old"))

    resumed = _resume(tmp_path / "old", {"dp_degree": 2, "local_batch_size": 2}, dp=1, batch=4)

    assert sorted(_train(resumed, micro_batches=1)) == [4 * w for w in range(12, 16)]
