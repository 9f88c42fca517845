"""torchtitan.launch: which torchrun failures end with the ranks' own exit code."""

import json
import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from torchtitan.launch import closing_report, main, nproc_problem, ranks_filter_problem

TERMINATED, KILLED = -signal.SIGTERM, -signal.SIGKILL


def _failed(tmp_path, exitcodes: dict[int, int]) -> ChildFailedError:
    """torchrun's error for global ranks (local rank = global rank) that exited with `exitcodes`;
    a rank exiting 2 has written its message to its error file, as the trainer does."""
    failures = {}
    for rank, code in exitcodes.items():
        error_file = tmp_path / f"error-{rank}.json"
        if code == 2:
            error_file.write_text(json.dumps({"message": f"error: bad key on rank {rank}", "timestamp": 1}))
        failures[rank] = ProcessFailure(
            local_rank=rank, pid=100 + rank, exitcode=code, error_file=str(error_file)
        )
    return ChildFailedError("torchtitan.train", failures)


@pytest.mark.parametrize(
    "exitcodes, expected",
    [({0: 2, 1: 2}, 2), ({1: 2, 0: TERMINATED}, 2), ({0: 143, 1: KILLED}, 143), ({0: 143, 1: 143}, 143),
     ({0: 3, 1: TERMINATED}, 3)],
    ids=["every rank 2", "2 and the rest torn down", "143 and the rest killed", "every rank 143",
         "stopped with nothing saved"],
)  # fmt: skip
def test_ranks_that_stopped_on_purpose_end_the_launch_with_their_exit_code(tmp_path, exitcodes, expected):
    assert closing_report(_failed(tmp_path, exitcodes), "0")[0] == expected


@pytest.mark.parametrize(
    "exitcodes",
    [{0: 1}, {0: 2, 1: 1}, {0: 2, 1: -signal.SIGSEGV}, {0: 2, 1: 143}],
    ids=["a crash", "2 and a crash", "2 and a segfault", "2 and 143"],
)
def test_any_other_failure_is_left_to_torchrun(tmp_path, exitcodes):
    assert closing_report(_failed(tmp_path, exitcodes), "0") is None


def test_the_message_of_a_rank_whose_output_was_shown_is_not_printed_again(tmp_path):
    assert closing_report(_failed(tmp_path, {0: 2, 1: 2}), "0") == (2, "")
    assert closing_report(_failed(tmp_path, {0: 2, 1: 2}), "") == (2, "")  # no filter: all shown


def test_the_message_of_a_hidden_rank_is_printed_naming_it(tmp_path):
    assert closing_report(_failed(tmp_path, {1: 2, 0: TERMINATED}), "0") == (
        2,
        "rank 1: error: bad key on rank 1",
    )


def test_a_stop_prints_nothing_more(tmp_path):
    assert closing_report(_failed(tmp_path, {1: 143, 0: 143}), "0") == (143, "")


@pytest.mark.parametrize("ranks_filter", ["5", "0,2", "x"])
def test_a_log_rank_that_is_no_local_rank_is_refused(ranks_filter):
    assert "its output would never be shown" in ranks_filter_problem(ranks_filter, "2")


@pytest.mark.parametrize("ranks_filter, nproc", [("0", "2"), ("0,1", "2"), ("", "2"), ("3", "gpu")])
def test_local_ranks_of_the_launch_are_accepted(ranks_filter, nproc):
    assert ranks_filter_problem(ranks_filter, nproc) is None


@pytest.mark.parametrize("nproc", ["abc", "-1", "0", "2.5"])
def test_a_bad_ngpu_is_refused_naming_ngpu_with_exit_code_2(nproc, capsys):
    """torchrun ended these with a traceback, and NGPU=0 was blamed on LOG_RANK."""
    assert main([f"--nproc_per_node={nproc}", "--local-ranks-filter", "0", "-m", "torchtitan.train"]) == 2
    err = capsys.readouterr().err
    assert f"NGPU (--nproc_per_node) = '{nproc}'" in err and "LOG_RANK" not in err


@pytest.mark.parametrize("nproc", ["1", "8", "auto", "gpu"])
def test_a_process_count_torchrun_takes_is_no_problem(nproc):
    assert nproc_problem(nproc) is None
