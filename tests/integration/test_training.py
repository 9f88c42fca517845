"""End-to-end runs on the CPU: default launch, validation, signals. (Data-parallel parity and
gradient accumulation are test_layout_parity.py's.)"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import PROJECT_ROOT, read_metrics, run_trainer

pytestmark = pytest.mark.integration

# Small and quick, fp32 so that parity holds to rounding.
SMALL = [
    "--training.seq_len",
    "64",
    "--training.steps",
    "5",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    "--training.mixed_precision_param",
    "float32",
]


def _losses(dump) -> list[float]:
    return [r["loss"] for r in read_metrics(dump)]


def test_run_train_sh_with_the_default_config_trains_debug_model_and_loss_falls():
    # The quick start's command, shortened from the config's 100 steps to keep the suite fast.
    metrics = PROJECT_ROOT / "outputs" / "metrics.jsonl"
    already = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    start = time.perf_counter()
    proc = subprocess.run(["./run_train.sh", "--training.steps", "20"], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Model llama3 debugmodel" in proc.stderr
    # The config goes to its file; the log shows it only with job.print_args, as upstream does.
    assert "Resolved config written to outputs/config.toml" in proc.stderr
    assert "local_batch_size = " not in proc.stderr
    records = read_metrics(PROJECT_ROOT / "outputs")[already:]
    first, last = records[0]["loss"], records[-1]["loss"]
    print(f"run_train.sh: {elapsed:.0f}s, loss {first:.3f} -> {last:.3f}")
    assert records[-1]["step"] == 20
    assert last <= 0.6 * first  # 0.46 seen


def _validation_losses(tmp_path, name, nproc, local_batch, extra=()) -> list[float]:
    """validation/loss after step 1 of a 1-step run: two validation batches, global batch 4."""
    dump = tmp_path / name
    args = ["--training.steps", "1", "--training.local_batch_size", str(local_batch),
            "--validation.enable", "--validation.freq", "1", "--validation.seq_len", "64",
            "--validation.steps", "2", "--validation.local_batch_size", str(local_batch),
            "--job.dump_folder", str(dump), *extra]  # fmt: skip
    proc = run_trainer(SMALL + args, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())
    return [r["validation/loss"] for r in records if "validation/loss" in r]


def test_a_hub_dataset_with_too_few_documents_for_the_ranks_ends_every_rank_with_its_error(tmp_path):
    """Only rank 1's share of the stream is empty. Raised there alone, in step 1, the error ended
    rank 1 while rank 0 waited in the step's collectives until the connection closed (exit 1
    and a traceback), or on NCCL until the timeout."""
    args = [*SMALL, "--training.dataset", "some/hub-set", "--job.dump_folder", str(tmp_path)]
    proc = run_trainer(args, nproc=2, uneven="hub-with-one-document")
    assert proc.returncode == 1, proc.stderr[-3000:]  # torchrun's code for a failed rank
    error = "error: 'training.dataset' = 'some/hub-set' gives data-parallel rank 1 of 2 no document"
    assert proc.stderr.count(error) == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Connection closed" not in proc.stderr


def test_validation_loss_is_the_same_on_one_process_fsdp_tensor_pipeline_and_context_parallel(tmp_path):
    """The mean over every data-parallel rank's batches (FSDP 2 splits the global batch), the
    loss-parallel loss (TP 2), the pipeline's last stage (PP 2, 4 microbatches) and whole
    sequences on CP ranks that trained on halves (CP 2) give the single process's value."""
    single = _validation_losses(tmp_path, "single", 1, 4)
    fsdp = _validation_losses(tmp_path, "fsdp", 2, 2)
    tp = _validation_losses(tmp_path, "tp", 2, 4, ["--parallelism.tensor_parallel_degree", "2"])
    pp = _validation_losses(tmp_path, "pp", 2, 4, ["--parallelism.pipeline_parallel_degree", "2"])
    cp = _validation_losses(tmp_path, "cp", 2, 4, ["--parallelism.context_parallel_degree", "2"])
    assert len(single) == 1 and 7 < single[0] < 9, single  # one step from the initial 8.1
    for layout in (fsdp, tp, pp, cp):
        assert layout == pytest.approx(single, rel=1e-5)


@pytest.mark.full_matrix
def test_validation_under_context_and_pipeline_parallelism_gives_the_single_process_loss(tmp_path):
    """Each CP rank's pipeline stages run its half of each sequence, as in training (their
    shapes are fixed at the first step)."""
    single = _validation_losses(tmp_path, "single", 1, 4)
    cp_pp = ["--parallelism.context_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2"]
    assert _validation_losses(tmp_path, "cp-pp", 4, 4, cp_pp) == pytest.approx(single, rel=1e-5)


def test_validation_loss_and_tensorboard_scalars_are_recorded(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dump = tmp_path / "val"
    proc = run_trainer(
        SMALL
        + [
            "--job.dump_folder",
            str(dump),
            "--validation.enable",
            "--validation.freq",
            "5",
            "--validation.seq_len",
            "64",
            "--validation.steps",
            "2",
            "--metrics.enable_tensorboard",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (dump / "metrics.jsonl").read_text()
    assert '"validation/loss"' in lines
    assert re.search(r"validate step:  5  loss:  \d\.\d{4}\n", proc.stderr)  # upstream's line, spaces too
    events = EventAccumulator(str(dump / "tb" / "rank0"))
    events.Reload()
    logged = [e.value for e in events.Scalars("loss_metrics/global_avg_loss")]  # upstream's tag
    assert len(logged) == 5 and logged == pytest.approx(_losses(dump))
    assert [e.step for e in events.Scalars("validation_metrics/loss")] == [1, 5]  # step 1 as upstream
    assert (dump / "config.toml").is_file()
    # Each record's lr is the one its step used: debug config lr 3e-3, 2 warmup steps, then the
    # 3 steps after warmup decay (decay_ratio 0.8 of 5, cut to 3) towards min_lr_factor 0.1 at
    # a virtual step 6.
    lrs = [r["lr"] for r in read_metrics(dump)]
    assert lrs == pytest.approx([1.5e-3, 3e-3, 3e-3, 2.1e-3, 1.2e-3])


def test_sigterm_stops_after_the_current_step_and_cleans_up(tmp_path):
    dump = tmp_path / "term"
    cmd = [
        sys.executable,
        "-m",
        "torchtitan.train",
        *SMALL,
        "--training.steps",
        "1000",
        "--job.dump_folder",
        str(dump),
    ]
    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    deadline = time.time() + 120
    while time.time() < deadline and not ((dump / "metrics.jsonl").exists() and read_metrics(dump)):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3  # stopped with checkpointing off: nothing to resume (143 with)
    assert "Traceback" not in err
    stopped_at = int(re.search(r"Stopped on request \(SIGTERM\) after step (\d+)", err).group(1))
    steps = [r["step"] for r in read_metrics(dump)]
    assert steps[0] == 1 and steps[-1] == stopped_at  # that step finished and was logged


def test_a_run_with_activation_offload_logs_the_bytes_each_step_sends_to_the_host(tmp_path):
    argv = ["--config", "debug_model.toml", "--training.steps", "3", "--metrics.log_freq", "1",
            "--training.seq_len", "128", "--activation_checkpoint.offload", "saved",
            "--activation_checkpoint.offload_min_bytes", "4096",
            "--job.dump_folder", str(tmp_path)]  # fmt: skip
    proc = run_trainer(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sent = [record["offload_gib"] for record in read_metrics(tmp_path)]
    # op-SAC's saved outputs and block inputs: the same bytes every step, and more than the
    # blocks' inputs alone (6 blocks x 8 x 128 tokens x 256 x 4 bytes = 6 MiB).
    assert len(sent) == 3 and len(set(sent)) == 1 and sent[0] * 2**30 > 6 * 2**20, sent
    assert "offload_gib:" in proc.stderr
