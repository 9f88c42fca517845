"""keep_latest_k: which checkpoint folders survive a save."""

import torch
import torch.distributed.checkpoint as dcp

from torchtitan.components.checkpoint import complete_steps, prune_checkpoints


def _save(folder, step: int, resumable: bool = True) -> None:
    state = {"model": {"weight": torch.full((2,), float(step))}}
    if resumable:
        state["train_state"] = {"step": step}
    dcp.save(state, checkpoint_id=str(folder / f"step-{step}"))


def test_keeps_the_k_newest_checkpoints(tmp_path):
    for step in (2, 4, 6, 8):
        _save(tmp_path, step)
    prune_checkpoints(tmp_path, keep=2)
    assert complete_steps(tmp_path) == [6, 8]


def test_a_model_only_final_save_does_not_push_out_the_last_resumable_checkpoint(tmp_path):
    for step in (2, 4):
        _save(tmp_path, step)
    _save(tmp_path, 5, resumable=False)  # last_save_model_only
    prune_checkpoints(tmp_path, keep=1)
    assert complete_steps(tmp_path) == [4, 5]


def test_zero_keeps_every_checkpoint(tmp_path):
    for step in (2, 4, 6):
        _save(tmp_path, step)
    prune_checkpoints(tmp_path, keep=0)
    assert complete_steps(tmp_path) == [2, 4, 6]


def test_an_unfinished_save_is_neither_counted_nor_removed(tmp_path):
    for step in (2, 4):
        _save(tmp_path, step)
    (tmp_path / "step-6.partial").mkdir()
    prune_checkpoints(tmp_path, keep=1)
    assert complete_steps(tmp_path) == [4]
    assert (tmp_path / "step-6.partial").is_dir()
