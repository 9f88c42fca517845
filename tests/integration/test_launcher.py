"""`run_train.sh` checks the config in one process before it starts torchrun, and ends with
exit code 2 when a rank stops on bad input only it could see (`torchtitan.launch`)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import PROJECT_ROOT

pytestmark = pytest.mark.integration


def test_run_train_sh_reports_a_config_mistake_in_one_line_with_exit_code_2():
    env = {**os.environ, "NGPU": "2"}
    proc = subprocess.run(
        ["./run_train.sh", "--training.steps", "abc"],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "'training.steps' = 'abc'" in proc.stderr and "expected int" in proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr


@pytest.mark.parametrize("log_rank", ["0", "1"])
def test_run_train_sh_ends_a_mistake_the_ranks_find_with_exit_code_2_and_no_traceback(log_rank):
    """A dataset path is checked where the data is read, on each rank; with LOG_RANK hiding
    the rank whose error comes first, the launcher prints it."""
    env = {**os.environ, "NGPU": "2", "LOG_RANK": log_rank}
    proc = subprocess.run(
        ["./run_train.sh", "--training.dataset_path", "/no/such/corpus", "--training.steps", "1"],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "'training.dataset_path' = '/no/such/corpus' does not exist" in output
    assert "Traceback" not in output and "ChildFailedError" not in output
    # Each rank prints its own; the launcher repeats the first failing rank's only when hidden.
    shown = "[rank0]:error" if log_rank == "0" else "[rank1]:error"
    hidden_first = re.search(r"^rank (\d): error: 'training.dataset_path'", proc.stderr, re.M)
    assert shown in output
    assert hidden_first is None or hidden_first.group(1) != log_rank


def test_sigterm_to_run_train_sh_saves_and_ends_with_143_and_no_traceback(tmp_path):
    env = {**os.environ, "NGPU": "2"}
    argv = ["./run_train.sh", "--training.steps", "100000", "--training.seq_len", "64",
            "--metrics.log_freq", "1", "--checkpoint.enable", "--checkpoint.interval", "100000",
            "--job.dump_folder", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    # The trainer opens metrics.jsonl while it is being built, when a SIGTERM stops it before
    # training with nothing to save: wait for the first step's record.
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)  # run_train.sh execs the launcher: this is torchrun's process
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, output[-3000:]
    assert "Traceback" not in output and "torchtitan.launch: stopped by SIGTERM" in output
    assert [p.name for p in (tmp_path / "checkpoint").iterdir()] != []


def test_config_check_reads_config_file_from_the_environment_as_the_trainer_does():
    env = {**os.environ, "CONFIG_FILE": "no_such_config.toml"}
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan.config.check"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "config file 'no_such_config.toml' (from $CONFIG_FILE) does not exist" in proc.stderr


def test_config_check_passes_a_good_config_without_importing_torch():
    code = (
        "import sys; from torchtitan.config import check; "
        "rc = check.main(['--config', 'llama3_8b.toml']); print(rc, 'torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["0", "False"], proc.stderr


def test_config_check_run_by_hand_says_the_config_is_ok_and_lists_the_arguments_on_help():
    check = [sys.executable, "-m", "torchtitan.config.check"]
    ok = subprocess.run([*check, "--config", "llama3_8b.toml"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "config OK: llama3 8B, 1000 steps" in ok.stderr, ok.stderr
    helped = subprocess.run([*check, "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "--training.steps" in helped.stdout
    quiet = subprocess.run([*check, "--errors-only", "--help"], capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0 and quiet.stdout == quiet.stderr == ""  # the trainer prints it


def _check_stderr(tmp_path, *check_args: str) -> str:
    config = tmp_path / "upstream.toml"
    config.write_text("[training]\nbatch_size = 2\n")
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan.config.check", *check_args, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_config_check_shows_an_upstream_key_warning_when_run_by_hand(tmp_path):
    assert "'training.batch_size'" in _check_stderr(tmp_path)


def test_config_check_for_a_launcher_leaves_the_warnings_to_rank_0(tmp_path):
    assert "'training.batch_size'" not in _check_stderr(tmp_path, "--errors-only")
