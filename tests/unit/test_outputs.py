"""The run's outputs (checkpoint folder, metrics file, TensorBoard and profiler folders) are
checked for writing at startup, not where they are first written."""

import pytest

from tests.conftest import read_only
from torchtitan.components.outputs import check_run_outputs, run_outputs
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args


def _config(tmp_path, *argv):
    return parse_args(["--job.dump_folder", str(tmp_path), *argv], env={})


def test_a_read_only_checkpoint_folder_is_refused_naming_it_and_the_key(tmp_path):
    config = _config(tmp_path, "--checkpoint.enable")
    with read_only(tmp_path / "checkpoint"), pytest.raises(ConfigError) as refused:
        check_run_outputs(config, rank=1, is_metrics_writer=False)
    assert f"{tmp_path / 'checkpoint'} cannot be written" in str(refused.value)
    assert "point 'checkpoint.folder' elsewhere" in str(refused.value)


def test_a_checkpoint_folder_to_be_made_in_a_read_only_dump_folder_is_refused(tmp_path):
    config = _config(tmp_path / "dump", "--checkpoint.enable")
    with read_only(tmp_path / "dump"), pytest.raises(ConfigError, match="where it would be created"):
        check_run_outputs(config, rank=1, is_metrics_writer=False)


def test_metrics_jsonl_that_is_a_folder_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(ConfigError, match=r"metrics.jsonl is a folder, where the run writes its file"):
        check_run_outputs(_config(tmp_path), rank=0, is_metrics_writer=True)


def test_a_file_where_the_tensorboard_folder_goes_is_refused(tmp_path):
    (tmp_path / "tb").write_text("")
    config = _config(tmp_path, "--metrics.enable_tensorboard")
    with pytest.raises(
        ConfigError, match=r"tb is a file, where the run needs a folder .*'metrics.save_tb_folder'"
    ):
        check_run_outputs(config, rank=0, is_metrics_writer=True)


def test_the_check_leaves_nothing_behind(tmp_path):
    config = _config(tmp_path / "dump", "--checkpoint.enable", "--profiling.enable_profiling")
    (tmp_path / "dump").mkdir()
    check_run_outputs(config, rank=0, is_metrics_writer=True)
    assert list((tmp_path / "dump").iterdir()) == []


def test_each_rank_checks_what_it_writes(tmp_path):
    config = _config(tmp_path, "--checkpoint.enable", "--metrics.enable_tensorboard")
    assert [key for key, _, _ in run_outputs(config, 0, True)] == [
        "checkpoint.folder",
        "job.dump_folder",
        "metrics.save_tb_folder",
    ]
    assert [key for key, _, _ in run_outputs(config, 1, False)] == ["checkpoint.folder"]
    assert run_outputs(_config(tmp_path, "--checkpoint.enable", "--checkpoint.load_only"), 1, False) == []
