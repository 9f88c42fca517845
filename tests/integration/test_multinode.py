"""Multi-node launch without SLURM: two `torchrun --nnodes 2` launches on this host, joined by
c10d rendezvous, train together exactly as one 2-process launch does, with global ranks where they matter."""

import os
import subprocess
import sys

import pytest

from tests.conftest import PROJECT_ROOT, python_path, read_metrics, run_trainer
from tests.forked_launcher import free_port

pytestmark = pytest.mark.integration

ARGS = ["--config", "debug_model.toml", "--training.seq_len", "64", "--training.local_batch_size", "4",
        "--training.steps", "5", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2"]  # fmt: skip


CHECKPOINT_AT_3 = ["--checkpoint.enable", "--checkpoint.interval", "3"]


def _node(node_rank: int, port: int, dump) -> subprocess.Popen:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                "--node_rank", str(node_rank), "--rdzv_id", "twonodes", "--rdzv_backend", "c10d",
                "--rdzv_endpoint", f"localhost:{port}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path()}
    cmd = launcher + ["-m", "torchtitan.train", *ARGS, *CHECKPOINT_AT_3, "--job.dump_folder", str(dump)]
    return subprocess.Popen(
        cmd, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_two_nodes_joined_by_c10d_rendezvous_train_like_one_two_process_node(tmp_path):
    port = free_port()
    nodes = [_node(rank, port, tmp_path / "two_nodes") for rank in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    one_node = run_trainer(ARGS + ["--job.dump_folder", str(tmp_path / "one_node")], nproc=2)
    assert one_node.returncode == 0, one_node.stderr[-2000:]
    got, want = read_metrics(tmp_path / "two_nodes"), read_metrics(tmp_path / "one_node")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]  # one writer: global rank 0, not each node's rank 0
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert "[titan rank1]" in outputs[1] and "[titan rank0]" not in outputs[1]  # global rank in logs
    step_3 = tmp_path / "two_nodes" / "checkpoint" / "step-3"
    assert sorted(p.name for p in step_3.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not list(step_3.parent.glob("*.partial"))
