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


def test_sbatch_of_the_slurm_script_trains_and_the_job_completes(slurm, tmp_path):
    env = "ALL,GPUS_PER_NODE=2,OMP_NUM_THREADS=1"
    submit = ["sbatch", "--parsable", "--nodes", "1", "--export", env, "--output", str(tmp_path / "job.out")]
    train = ["--config", "debug_model.toml", "--training.steps", "10", "--training.seq_len", "64",
             "--training.local_batch_size", "4", "--metrics.log_freq", "1",
             "--job.dump_folder", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run([*submit, "multinode_trainer.slurm", *train], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    job = _wait_for_job(proc.stdout.strip().split(";")[0])
    output = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert "JobState=COMPLETED" in job and "ExitCode=0:0" in job, job + output[-3000:]
    assert "2 process(es) each, rendezvous" in output
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 11))
    assert records[-1]["loss"] <= 0.8 * records[0]["loss"], records
