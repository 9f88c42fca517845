"""`multinode_trainer.slurm` under a real SLURM: a one-node cluster on this host (started by
`scripts/slurm/start_local_slurm.sh`, as `.ci/run` does), the debug config on 2 CPU processes."""

import re
import shutil
import subprocess
import time

import pytest

from tests.conftest import PROJECT_ROOT, read_metrics

pytestmark = pytest.mark.integration

ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


def _slurm_ready() -> bool:
    if shutil.which("sbatch") is None:
        return False
    states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True).stdout
    return bool(re.search(r"idle|mixed", states))


@pytest.fixture(scope="module")
def slurm():
    if not _slurm_ready() and shutil.which("slurmctld"):
        subprocess.run(
            [str(PROJECT_ROOT / "scripts" / "slurm" / "start_local_slurm.sh")], capture_output=True
        )
    if not _slurm_ready():
        pytest.skip(
            "no SLURM here: .ci/run installs slurmctld, slurmd, slurm-client and munge and starts them"
        )


def _wait_for_job(job_id: str, timeout: float = 600) -> str:
    """`scontrol show job` once the job has ended. (`sbatch --wait` polls with a backoff that
    made this test take 40 s for a 10 s job.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
        state = re.search(r"JobState=(\w+)", job)
        if state and state.group(1) not in ACTIVE_STATES:
            return job
        time.sleep(0.5)
    raise TimeoutError(f"SLURM job {job_id} still running after {timeout} s")


TRAIN = ["--config", "debug_model.toml", "--training.seq_len", "64", "--training.local_batch_size", "4",
         "--metrics.log_freq", "1"]  # fmt: skip


def _submit(tmp_path, train_args: list[str], env: str = "ALL,GPUS_PER_NODE=2,OMP_NUM_THREADS=1") -> str:
    """sbatch the script on one node with 2 processes; returns the job id."""
    submit = ["sbatch", "--parsable", "--nodes", "1", "--export", env, "--output", str(tmp_path / "job.out")]
    train = TRAIN + train_args + ["--job.dump_folder", str(tmp_path / "run")]
    proc = subprocess.run([*submit, "multinode_trainer.slurm", *train], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def test_sbatch_of_the_slurm_script_trains_and_the_job_completes(slurm, tmp_path):
    job = _wait_for_job(_submit(tmp_path, ["--training.steps", "10"]))
    output = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert "JobState=COMPLETED" in job and "ExitCode=0:0" in job, job + output[-3000:]
    assert "2 process(es) each, rendezvous" in output
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 11))
    assert records[-1]["loss"] <= 0.8 * records[0]["loss"], records


def test_the_time_limit_signal_makes_the_trainers_save_and_stop(slurm, tmp_path):
    # What --signal=B:USR1@120 does before the time limit: signal the batch script alone.
    job_id = _submit(tmp_path, ["--training.steps", "100000", "--checkpoint.enable",
                                "--checkpoint.interval", "100000"])  # fmt: skip
    deadline, metrics = time.monotonic() + 300, tmp_path / "run" / "metrics.jsonl"
    while not (metrics.exists() and read_metrics(tmp_path / "run")) and time.monotonic() < deadline:
        time.sleep(0.5)  # until a step has been logged
    subprocess.run(["scancel", "--batch", "--signal", "USR1", job_id], check=True)
    job = _wait_for_job(job_id, timeout=300)
    output = (tmp_path / "job.out").read_text()
    stopped_at = read_metrics(tmp_path / "run")[-1]["step"]
    assert "asking the trainers to save and stop" in output, job + output[-3000:]
    assert (
        f"Stopped on request (stop file {PROJECT_ROOT}/.torchtitan-stop-{job_id}) after step {stopped_at}"
        in output
    )
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoint").iterdir())
    assert checkpoints == [f"step-{stopped_at}"], checkpoints
    assert "stopped before the time limit (exit 143)" in output and "resubmit the same command" in output
    assert "ExitCode=143:0" in job and "Traceback" not in output, job
    assert not (PROJECT_ROOT / f".torchtitan-stop-{job_id}").exists()  # the script cleans up


def test_a_config_mistake_ends_the_job_with_exit_code_2_before_any_torchrun(slurm, tmp_path):
    job = _wait_for_job(_submit(tmp_path, ["--training.steps", "abc"]))
    output = (tmp_path / "job.out").read_text()
    assert "ExitCode=2:0" in job, job + output[-3000:]
    assert "error: 'training.steps' = 'abc'" in output
    assert "torchrun" not in output and "Traceback" not in output


def test_a_mistake_only_the_ranks_can_find_ends_the_job_with_exit_code_2_and_no_traceback(slurm, tmp_path):
    job = _wait_for_job(_submit(tmp_path, ["--training.dataset_path", "/no/such/corpus"]))
    output = (tmp_path / "job.out").read_text()
    assert "ExitCode=2:0" in job, job + output[-3000:]
    assert "'training.dataset_path' = '/no/such/corpus' does not exist" in output
    assert "Traceback" not in output and "ChildFailedError" not in output
