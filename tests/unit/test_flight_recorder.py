"""Where the NCCL flight recorder writes when a collective times out: the run's dump folder."""

import os

import pytest
import torch

from torchtitan.distributed.process_group import _configure_flight_recorder, init_distributed

FR_VARIABLES = (
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
)


@pytest.fixture
def clean_env(monkeypatch):
    for name in FR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_traces_are_dumped_as_rank_files_in_the_configured_folder(clean_env, tmp_path):
    folder = tmp_path / "outputs" / "comm_traces"
    _configure_flight_recorder(500, str(folder / "trace_"))
    assert folder.is_dir()
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(folder / "trace_")
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "500"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def test_a_relative_folder_is_made_absolute_so_a_change_of_directory_cannot_move_it(clean_env, tmp_path):
    clean_env.chdir(tmp_path)
    _configure_flight_recorder(10, "out/comm_traces/rank_")
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "out" / "comm_traces" / "rank_")


def test_an_empty_file_prefix_names_the_files_by_rank_inside_the_folder(clean_env, tmp_path):
    _configure_flight_recorder(10, str(tmp_path / "comm_traces") + os.sep)
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "comm_traces") + os.sep
    assert (tmp_path / "comm_traces").is_dir()


@pytest.mark.parametrize("variable", ["TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"])
def test_a_dump_file_the_user_chose_wins(clean_env, tmp_path, variable):
    clean_env.setenv(variable, "/elsewhere/trace_")
    _configure_flight_recorder(10, str(tmp_path / "comm_traces" / "rank_"))
    assert os.environ[variable] == "/elsewhere/trace_"
    assert not (tmp_path / "comm_traces").exists()


def test_a_user_choice_to_not_dump_on_timeout_wins(clean_env, tmp_path):
    clean_env.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    _configure_flight_recorder(10, str(tmp_path / "comm_traces" / "rank_"))
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


def test_a_zero_buffer_records_nothing_and_creates_no_folder(clean_env, tmp_path):
    _configure_flight_recorder(0, str(tmp_path / "comm_traces" / "rank_"))
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "0"
    assert "TORCH_FR_DUMP_TEMP_FILE" not in os.environ
    assert not (tmp_path / "comm_traces").exists()


@pytest.mark.parametrize("device, dumps", [("cuda", True), ("cpu", False)])
def test_only_an_nccl_run_sets_up_the_dump(clean_env, tmp_path, device, dumps):
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setattr(torch.distributed, "init_process_group", lambda **kwargs: None)
    clean_env.setattr(torch.distributed, "get_world_size", lambda: 2)
    folder = tmp_path / "comm_traces"
    init_distributed(torch.device(device), 60, 100, trace_dump_prefix=str(folder / "rank_"))
    assert folder.is_dir() == dumps and ("TORCH_FR_DUMP_TEMP_FILE" in os.environ) == dumps
