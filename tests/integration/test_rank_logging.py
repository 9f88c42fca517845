"""Rank-aware output of `run_train.sh`: LOG_RANK picks the ranks shown, and a rank that fails is
named in torchrun's summary with its own traceback even when its output is hidden."""

import os
import re
import subprocess

import pytest

from tests.conftest import PROJECT_ROOT, python_path

pytestmark = pytest.mark.integration

ARGS = ["--training.steps", "3", "--training.seq_len", "64", "--metrics.log_freq", "1"]

# Loaded by every Python process started with this folder on PYTHONPATH; only the process of
# global rank FAIL_RANK raises, in its second step, as a rank-local failure (a bad host, a
# kernel error) would.
FAULT_INJECTION = """
import os

if os.environ.get("RANK") == os.environ.get("FAIL_RANK"):
    from torchtitan.components import training_step

    original, calls = training_step.forward_backward, []

    def fail_in_second_step(*args, **kwargs):
        calls.append(None)
        if len(calls) == 2:
            raise RuntimeError("injected failure in the second step")
        return original(*args, **kwargs)

    training_step.forward_backward = fail_in_second_step
"""


def _run_train_sh(tmp_path, env: dict) -> subprocess.CompletedProcess:
    argv = ["./run_train.sh", *ARGS, "--job.dump_folder", str(tmp_path / "run")]
    full_env = {**os.environ, "NGPU": "2", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(argv, cwd=PROJECT_ROOT, env=full_env, capture_output=True, text=True, timeout=300)


def _ranks_shown(output: str) -> set[str]:
    return set(re.findall(r"^\[rank(\d+)\]:", output, flags=re.MULTILINE))


def test_log_rank_shows_only_the_chosen_ranks_output(tmp_path):
    proc = _run_train_sh(tmp_path, {"LOG_RANK": "1"})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert _ranks_shown(output) == {"1"}
    assert re.search(r"^\[rank1\]:\[titan rank1\] .* step:\s+3 ", output, flags=re.MULTILINE), output[-3000:]


def test_a_failing_rank_is_named_with_its_error_when_its_output_is_hidden(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(FAULT_INJECTION)
    proc = _run_train_sh(tmp_path, {"FAIL_RANK": "1", "PYTHONPATH": python_path(tmp_path)})
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert _ranks_shown(output) == {"0"}, "LOG_RANK defaults to rank 0"
    root_cause = output.split("Root Cause (first observed failure):", 1)[1]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", root_cause), root_cause
    assert "RuntimeError: injected failure in the second step" in root_cause
