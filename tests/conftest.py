"""Shared test setup: a private token cache per session, and helpers to run the trainer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan.components.compile import compiles_checkpointed_scalars

PROJECT_ROOT = Path(__file__).resolve().parents[1]


# torch < 2.12 refuses compile.capture_scalar_outputs with AC on MoE blocks (inductor fails there).
needs_checkpointed_scalar_capture = pytest.mark.skipif(
    not compiles_checkpointed_scalars(), reason="this torch refuses capture_scalar_outputs with AC on MoE"
)


def python_path(*first: str | Path) -> str:
    """PYTHONPATH for a child process: `first`, the repo, then whatever the caller already had
    (on a node without network the dependencies may come from PYTHONPATH alone)."""
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return os.pathsep.join([*map(str, first), str(PROJECT_ROOT), *inherited])


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
    full_env = {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else "2", "PYTHONPATH": python_path(),
                **(env or {})}  # fmt: skip
    return subprocess.run(
        cmd + args, cwd=PROJECT_ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )
