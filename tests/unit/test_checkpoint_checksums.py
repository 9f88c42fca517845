"""Checksums of a DCP checkpoint: written with every save, checked before any tensor is loaded."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan.components.checkpoint import CheckpointManager, TrainState
from torchtitan.components.checkpoint_checksums import (
    METADATA_MANIFEST,
    ChecksumError,
    ChecksummedWriter,
    is_intact,
    verify_share,
)
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args


def _save(folder, step: int = 1) -> None:
    state = {
        "model": {"weight": torch.arange(4096, dtype=torch.float32) * step},
        "train_state": {"step": step},
    }
    dcp.save(state, storage_writer=ChecksummedWriter(folder))


def _flip_a_byte(path, offset: int = 1000) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_save_writes_a_manifest_covering_every_file_it_wrote(tmp_path):
    _save(tmp_path)

    shards = json.loads((tmp_path / ".checksums-0.json").read_text())["files"]
    top = json.loads((tmp_path / METADATA_MANIFEST).read_text())
    assert sorted(shards) == ["__0_0.distcp"] and shards["__0_0.distcp"]["size"] > 4 * 4096
    assert list(top["files"]) == [".metadata"] and top["shards"] == ["__0_0.distcp"]
    verify_share(tmp_path, rank=0, world_size=1)  # intact: no error


def test_one_changed_byte_of_the_same_size_fails_naming_the_file(tmp_path):
    _save(tmp_path)
    _flip_a_byte(tmp_path / "__0_0.distcp")

    with pytest.raises(ChecksumError, match="__0_0.distcp does not match its checksum"):
        verify_share(tmp_path, rank=0, world_size=1)
    assert not is_intact(tmp_path)


def test_a_shortened_shard_fails_naming_its_sizes(tmp_path):
    _save(tmp_path)
    shard = tmp_path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])

    with pytest.raises(ChecksumError, match=r"__0_0.distcp has 100 bytes, \d+ when saved"):
        verify_share(tmp_path, rank=0, world_size=1)


def test_a_missing_rank_manifest_fails_rather_than_skipping_that_ranks_files(tmp_path):
    _save(tmp_path)
    (tmp_path / ".checksums-0.json").unlink()

    with pytest.raises(ChecksumError, match="__0_0.distcp has no checksum"):
        verify_share(tmp_path, rank=0, world_size=1)


def test_a_damaged_metadata_file_is_found_too(tmp_path):
    _save(tmp_path)
    _flip_a_byte(tmp_path / ".metadata", offset=10)

    with pytest.raises(ChecksumError, match=".metadata does not match"):
        verify_share(tmp_path, rank=0, world_size=1)


def test_each_rank_checks_its_own_share_of_the_files(tmp_path):
    _save(tmp_path)
    _flip_a_byte(tmp_path / "__0_0.distcp")
    # Sorted, the files are .metadata then __0_0.distcp: with two ranks, rank 1 holds the shard.
    verify_share(tmp_path, rank=0, world_size=2)
    with pytest.raises(ChecksumError):
        verify_share(tmp_path, rank=1, world_size=2)


def _manager(tmp_path, *argv: str) -> CheckpointManager:
    cfg = parse_args(["--job.dump_folder", str(tmp_path), "--checkpoint.enable", *argv], env={})
    return CheckpointManager(cfg, None, None, None, None, dp_rank=0, dp_degree=1, device=torch.device("cpu"))


def test_a_resume_from_a_damaged_checkpoint_names_the_file_the_step_and_the_newest_intact_load_step(tmp_path):
    manager = _manager(tmp_path)
    for step in (2, 4, 6):
        _save(manager.folder / f"step-{step}", step)
    _flip_a_byte(manager.folder / "step-6" / "__0_0.distcp")
    _flip_a_byte(manager.folder / "step-4" / "__0_0.distcp")

    with pytest.raises(ConfigError) as refused:
        manager.load(TrainState())

    message = str(refused.value)
    assert f"checkpoint {manager.folder / 'step-6'}: __0_0.distcp does not match its checksum" in message
    assert "The newest intact checkpoint is step 2: resume from it with checkpoint.load_step = 2" in message


def test_verify_checksums_false_loads_without_reading_the_manifests(tmp_path):
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.zeros(4096))
    argv = ["--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--checkpoint.no_verify_checksums",
            "--checkpoint.exclude_from_loading", "train_state"]  # fmt: skip
    cfg = parse_args(argv, env={})
    manager = CheckpointManager(
        cfg, model, None, None, None, dp_rank=0, dp_degree=1, device=torch.device("cpu")
    )
    _save(manager.folder / "step-2", 2)
    (manager.folder / "step-2" / METADATA_MANIFEST).write_text("not json")

    assert manager.load(TrainState())
    assert torch.equal(model.weight.detach(), torch.arange(4096, dtype=torch.float32) * 2)
