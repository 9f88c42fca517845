"""Observability on the CPU: profiler traces per rank that load as chrome-trace JSON, and the
CUDA-only memory snapshot refused elsewhere."""

import json

import pytest

from tests.conftest import run_trainer

pytestmark = pytest.mark.integration

SHORT = ["--config", "debug_model.toml", "--training.seq_len", "64", "--training.local_batch_size", "2",
         "--metrics.log_freq", "1"]  # fmt: skip


def test_profiler_writes_a_chrome_trace_per_rank_with_the_steps_events(tmp_path):
    profiling = ["--profiling.enable_profiling", "--profiling.profile_freq", "3",
                 "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1",
                 "--training.steps", "3"]  # fmt: skip
    proc = run_trainer(SHORT + profiling + ["--job.dump_folder", str(tmp_path)], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        trace = json.loads(
            (tmp_path / "profile_traces" / "iteration_3" / f"rank{rank}_trace.json").read_text()
        )
        names = {event.get("name", "") for event in trace["traceEvents"]}
        assert any(name.startswith("ProfilerStep#") for name in names), sorted(names)[:20]
        assert "aten::mm" in names or "aten::addmm" in names or "aten::linear" in names


def test_profile_window_longer_than_the_frequency_is_refused(tmp_path):
    argv = [
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "2",
        "--profiling.profiler_warmup",
        "3",
    ]
    proc = run_trainer(SHORT + argv + ["--job.dump_folder", str(tmp_path)])
    assert proc.returncode == 2 and "'profiling.profile_freq' = 2" in proc.stderr, proc.stderr[-2000:]


def test_memory_snapshot_without_cuda_is_refused(tmp_path):
    proc = run_trainer(SHORT + ["--profiling.enable_memory_snapshot", "--job.dump_folder", str(tmp_path)])
    assert proc.returncode == 2 and "'profiling.enable_memory_snapshot'" in proc.stderr, proc.stderr[-2000:]


def test_wandb_offline_run_records_every_logged_loss(tmp_path):
    """Weights & Biases without network: WANDB_MODE=offline writes the run under the dump folder;
    its record file holds each logged loss (as the JSON text wandb stores values in)."""
    pytest.importorskip("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    argv = SHORT + ["--training.steps", "3", "--metrics.enable_wandb", "--job.dump_folder", str(tmp_path)]
    proc = run_trainer(argv, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = record_file.read_bytes()
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(json.dumps(loss).encode() in data for loss in losses)
