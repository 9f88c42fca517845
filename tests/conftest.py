"""Shared test setup: a private token cache per session, and helpers to run the trainer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def _private_token_cache(tmp_path_factory):
    os.environ["TORCHTITAN_CACHE_DIR"] = str(tmp_path_factory.mktemp("token_cache"))


def read_metrics(dump_folder: Path) -> list[dict]:
    """The training records of metrics.jsonl (validation-only records left out)."""
    lines = (Path(dump_folder) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def run_trainer(args: list[str], nproc: int = 1, timeout: int = 600, env: dict | None = None):
    """Run `python -m torchtitan.train` (under torchrun when nproc > 1); returns the process."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "torchtitan.train"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            "localhost:0",
            "-m",
            "torchtitan.train",
        ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else "2", "PYTHONPATH": str(PROJECT_ROOT),
                **(env or {})}  # fmt: skip
    return subprocess.run(
        cmd + args, cwd=PROJECT_ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )
