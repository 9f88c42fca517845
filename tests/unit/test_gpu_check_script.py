"""scripts/gpu_check.sh, on a machine without a GPU: it parses, and it stops at once with the
dry-run advice instead of failing step after step. (The dry run itself takes minutes; the
runs are recorded in docs/gpu_check.md and docs/performance.md.)"""

import os
import subprocess
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the script itself")
def test_without_a_gpu_it_exits_100_and_points_to_the_dry_run(tmp_path):
    env = {**os.environ, "GPU_CHECK_DIR": str(tmp_path)}
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)

    assert done.returncode == 100  # not a count of failed steps
    assert "needs a CUDA GPU" in done.stderr and "scripts/gpu_check.sh --cpu-dry-run" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing ran


@pytest.mark.parametrize("argument", ["--help", "--quik"])
def test_an_unknown_argument_is_refused_rather_than_running_the_whole_check(tmp_path, argument):
    env = {**os.environ, "GPU_CHECK_DIR": str(tmp_path)}
    done = subprocess.run(
        ["bash", str(SCRIPT), argument], capture_output=True, text=True, env=env, timeout=60
    )

    assert done.returncode == 64 and f"(got '{argument}')" in done.stderr
    assert not list(tmp_path.iterdir())


def test_a_missing_dependency_of_the_trainer_stops_the_check_at_the_pre_flight(tmp_path):
    """safetensors is imported by the trainer only: a pre-flight that imported a fixed list of
    packages passed without it, and then every training step of the check failed."""
    stub = tmp_path / "stub" / "safetensors"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('No module named safetensors (stub)')\n")
    logs = tmp_path / "logs"
    env = {
        **os.environ,
        "GPU_CHECK_DIR": str(logs),
        "PYTHONPATH": f"{stub.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), "--cpu-dry-run"], capture_output=True, text=True, env=env, timeout=300
    )

    assert done.returncode == 99, done.stdout[-2000:]  # not "1 failed step"
    assert "No module named safetensors (stub)" in done.stdout and "pre-flight failed" in done.stderr
    assert sorted(p.name for p in logs.iterdir()) == ["preflight.log"]  # nothing else ran
