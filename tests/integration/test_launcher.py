"""`run_train.sh` checks the config in one process before it starts torchrun, and ends with
exit code 2 when a rank stops on bad input only it could see (`torchtitan.launch`)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import PROJECT_ROOT, read_metrics, run_trainer

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
    assert "failed (exitcode: 2)" not in output  # torchrun's line; the rank has said why
    # Each rank prints its own; the launcher repeats the first failing rank's only when hidden.
    shown = "[rank0]:error" if log_rank == "0" else "[rank1]:error"
    hidden_first = re.search(r"^rank (\d): error: 'training.dataset_path'", proc.stderr, re.M)
    assert shown in output
    assert hidden_first is None or hidden_first.group(1) != log_rank


def test_a_layout_refusal_is_found_before_torchrun_starts_in_one_line_with_exit_code_2():
    """It was each rank's, under torchrun: its output, a line per rank, torchrun's failure line."""
    argv = ["./run_train.sh", "--compile.enable", "--parallelism.tensor_parallel_degree", "2",
            "--activation_checkpoint.mode", "selective",
            "--activation_checkpoint.selective_ac_option", "2"]  # fmt: skip
    env = {**os.environ, "NGPU": "2"}
    proc = subprocess.run(argv, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: 'activation_checkpoint.mode' = 'selective'"), lines


@pytest.mark.parametrize(
    "argv, named",
    [(["--parallelism.tensor_parallel_degree", "3"], "parallel degrees multiply to 3"),
     (["--training.global_batch_size", "3"], "'training.global_batch_size' = 3 is not a multiple"),
     (["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_replicate_degree", "1"],
      None)],
    ids=["degrees that do not fit", "a batch that does not divide", "a layout that fits"],
)  # fmt: skip
def test_preflight_builds_the_layout_for_the_world_size(argv, named):
    from torchtitan.preflight import main

    code = main(["--errors-only", "--world-size", "2", *argv])
    assert code == (0 if named is None else 2)


TRAIN_10_STEPS = ["--training.steps", "10", "--lr_scheduler.warmup_steps", "2", "--training.seq_len", "64",
                  "--training.local_batch_size", "2", "--metrics.log_freq", "1", "--checkpoint.enable",
                  "--checkpoint.interval", "100", "--checkpoint.no_last_save_model_only"]  # fmt: skip
SLOW_RUN = ["./run_train.sh", "--model.name", "slow_llama", "--job.custom_import",
            "tests.integration.slow_steps_model", *TRAIN_10_STEPS]  # fmt: skip


def _sigterm_during_step_2(tmp_path, env: dict) -> tuple[subprocess.Popen, str]:
    """run_train.sh of the slow model on 2 ranks, sent SIGTERM once step 1 is logged (step 2
    then sleeps `SLOW_STEP_SECONDS`); returns the process, ended, and its output."""
    env = {**os.environ, "NGPU": "2", **env}
    proc = subprocess.Popen([*SLOW_RUN, "--job.dump_folder", str(tmp_path)], cwd=PROJECT_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # run_train.sh execs the launcher: this is its process
    output, _ = proc.communicate(timeout=180)
    return proc, output


def test_sigterm_to_run_train_sh_during_a_step_longer_than_torchruns_grace_saves_that_step(tmp_path):
    """torchrun passed the SIGTERM on and killed the ranks its grace time later (30 s, here 2),
    mid-step: exit 143, which says "saved", and nothing saved."""
    grace = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2", "SLOW_STEP_SECONDS": "6"}
    proc, output = _sigterm_during_step_2(tmp_path / "stopped", grace)
    assert proc.returncode == 143, output[-3000:]
    assert "torchtitan.launch: stopped by SIGTERM" in output and "Traceback" not in output
    assert sorted(p.name for p in (tmp_path / "stopped" / "checkpoint").iterdir()) == ["step-2"]
    # The resume continues as if never stopped (the slow model is Llama 3's debug model).
    for folder in ("stopped", "uninterrupted"):
        run = run_trainer(TRAIN_10_STEPS + ["--job.dump_folder", str(tmp_path / folder)], nproc=2)
        assert run.returncode == 0, run.stderr[-3000:]
    stopped, uninterrupted = (read_metrics(tmp_path / folder) for folder in ("stopped", "uninterrupted"))
    assert [r["step"] for r in stopped] == list(range(1, 11))
    assert [r["loss"] for r in stopped] == [r["loss"] for r in uninterrupted]


def test_ranks_that_miss_the_stop_deadline_are_killed_and_the_launcher_says_nothing_was_saved(tmp_path):
    proc, output = _sigterm_during_step_2(
        tmp_path, {"TORCHTITAN_STOP_DEADLINE_SECONDS": "1", "SLOW_STEP_SECONDS": "60"}
    )
    assert proc.returncode == 4, output[-3000:]
    assert "the ranks were still running 1s after SIGTERM: killing the ranks" in output
    assert f"nothing was saved: {tmp_path / 'checkpoint'} holds no checkpoint" in output
    assert "Traceback" not in output


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
