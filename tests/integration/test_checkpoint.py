"""Distributed checkpoints on the CPU with gloo: exact resume, resharding, async save, crash
safety, SIGTERM, seed checkpoints, keep_latest_k and exclude_from_loading."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import PROJECT_ROOT, python_path, read_metrics, read_only, run_trainer
from tests.parity import PARAM_RTOL, relative_errors
from torchtitan.components.checkpoint_folders import complete_steps
from torchtitan.components.hf_io import load_hf
from torchtitan.components.lr_scheduler import build_lr_scheduler
from torchtitan.components.stop import STOP_FILE_ENV, StopRequests
from torchtitan.config.manager import parse_args
from torchtitan.train import Trainer, main

pytestmark = pytest.mark.integration

BASE = ["--config", "debug_model.toml", "--training.seq_len", "64", "--training.steps", "10",
        "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2", "--training.global_batch_size", "8",
        "--checkpoint.enable", "--checkpoint.interval", "5"]  # fmt: skip
LAYOUTS = {
    "1 process": (1, []),
    "FSDP 2": (2, []),
    "FSDP 2 x TP 2": (4, ["--parallelism.tensor_parallel_degree", "2"]),
    "PP 2": (2, ["--parallelism.pipeline_parallel_degree", "2"]),
    "PP 2 x FSDP 2": (4, ["--parallelism.pipeline_parallel_degree", "2"]),
    "CP 2 x FSDP 2": (4, ["--parallelism.context_parallel_degree", "2"]),
}


def _train(folder, layout="1 process", extra=(), env=None, expect=0):
    nproc, layout_argv = LAYOUTS[layout]
    local = ["--training.local_batch_size", str(8 // _dp(layout))]
    argv = BASE + local + layout_argv + list(extra) + ["--job.dump_folder", str(folder)]
    proc = run_trainer(argv, nproc=nproc, env=env)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


def _dp(layout: str) -> int:
    nproc, argv = LAYOUTS[layout]
    split = ("--parallelism.tensor_parallel_degree", "--parallelism.pipeline_parallel_degree",
             "--parallelism.context_parallel_degree")  # fmt: skip
    return nproc // 2 ** sum(key in argv for key in split)


def _losses(folder) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(folder)}


def _wait_for_a_logged_step(folder, timeout: float = 120) -> None:
    """Until metrics.jsonl holds a step: a stop requested earlier ends the run before step 1."""
    deadline = time.time() + timeout
    while not ((folder / "metrics.jsonl").exists() and _losses(folder)) and time.time() < deadline:
        time.sleep(0.5)


def _assert_steps_6_to_10_match(got: dict[int, float], want: dict[int, float]) -> None:
    """A run resumed from step 5 logged steps 6-10 with the losses of `want` (rtol 1e-5)."""
    assert sorted(got) == [6, 7, 8, 9, 10]
    for step in got:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got, want)


def _steps(folder) -> list[str]:
    return sorted(p.name for p in (folder / "checkpoint").iterdir())


def _resume_from_step_5(source, target, layout="1 process", extra=()):
    (target / "checkpoint").mkdir(parents=True)
    shutil.copytree(source / "checkpoint" / "step-5", target / "checkpoint" / "step-5")
    return _train(target, layout, extra)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("uninterrupted")
    _train(folder)
    return folder


@pytest.fixture(scope="module")
def saved_by_pp2_x_fsdp2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pp2_fsdp2")
    _train(folder, "PP 2 x FSDP 2")
    return folder


@pytest.fixture(scope="module")
def saved_by_cp2_x_fsdp2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cp2_fsdp2")
    _train(folder, "CP 2 x FSDP 2")
    return folder


@pytest.fixture(scope="module")
def saved_by_fsdp2_x_tp2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp2_tp2")
    _train(folder, "FSDP 2 x TP 2")
    return folder


ASYNC = ["--checkpoint.async_mode", "async"]
PINNED = ["--checkpoint.async_mode", "async_with_pinned_mem"]


@pytest.mark.parametrize(
    "layout, extra",
    # FSDP 2 x TP 2 runs under full_matrix: its checkpoint's load into other layouts stays in
    # the default run (test_checkpoint_of_fsdp2_x_tp2_loads_into_another_layout). Plain async
    # too: FSDP 2 with async_with_pinned_mem takes the same dcp.async_save path, with a stager.
    [("1 process", []), pytest.param("1 process", ASYNC, marks=pytest.mark.full_matrix),
     ("FSDP 2", PINNED),
     pytest.param("FSDP 2 x TP 2", [], marks=pytest.mark.full_matrix),
     pytest.param("FSDP 2 x TP 2", ASYNC, marks=pytest.mark.full_matrix),
     pytest.param("FSDP 2 x TP 2", PINNED, marks=pytest.mark.full_matrix),
     ("PP 2 x FSDP 2", []), pytest.param("CP 2 x FSDP 2", [], marks=pytest.mark.full_matrix)],
    ids=["1 process", "1 process, async", "FSDP 2, async_with_pinned_mem", "FSDP 2 x TP 2",
         "FSDP 2 x TP 2, async", "FSDP 2 x TP 2, async_with_pinned_mem", "PP 2 x FSDP 2", "CP 2 x FSDP 2"],
)  # fmt: skip
def test_resume_from_step_5_repeats_steps_6_to_10_bit_for_bit(
    layout, extra, uninterrupted, request, tmp_path
):
    reused = {("1 process", ()): uninterrupted}
    fixtures = {"FSDP 2 x TP 2": "saved_by_fsdp2_x_tp2", "PP 2 x FSDP 2": "saved_by_pp2_x_fsdp2",
                "CP 2 x FSDP 2": "saved_by_cp2_x_fsdp2"}  # fmt: skip
    if layout in fixtures and not extra:
        reused[(layout, ())] = request.getfixturevalue(fixtures[layout])
    full = reused.get((layout, tuple(extra)))
    if full is None:
        full = tmp_path / "full"
        _train(full, layout, extra)
    assert _steps(full) == ["step-10", "step-5"]
    proc = _resume_from_step_5(full, tmp_path / "resumed", layout, extra)
    assert "Resumed from checkpoint" in proc.stderr + proc.stdout
    resumed, original = _losses(tmp_path / "resumed"), _losses(full)
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    assert all(resumed[s] == original[s] for s in resumed), (resumed, original)


def _sharded_stream(folder: Path) -> str:
    """4 jsonl files that `training.dataset` streams as a hub dataset: 2 shards a rank under
    FSDP 2, about 12 windows of 65 tokens per shard, so each loader worker wraps to its next
    pass twice in 10 steps."""
    import json

    folder.mkdir()
    for shard in range(4):
        docs = [f"shard {shard} document {i} " * 12 for i in range(10)]
        (folder / f"part{shard}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(folder)


def test_a_stream_read_by_loader_workers_resumes_from_step_5_bit_for_bit(tmp_path):
    stream = ["--training.dataset", _sharded_stream(tmp_path / "stream"),
              "--training.dataloader_num_workers", "2"]  # fmt: skip
    _train(tmp_path / "full", "FSDP 2", stream)
    proc = _resume_from_step_5(tmp_path / "full", tmp_path / "resumed", "FSDP 2", stream)
    assert "Resumed from checkpoint" in proc.stderr + proc.stdout
    resumed, original = _losses(tmp_path / "resumed"), _losses(tmp_path / "full")
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    assert all(resumed[s] == original[s] for s in resumed), (resumed, original)


@pytest.mark.parametrize(
    "target", ["1 process", pytest.param("PP 2", marks=pytest.mark.full_matrix)], ids=["1 process", "PP 2"]
)
def test_checkpoint_of_pp2_x_fsdp2_continues_in_another_layout_with_the_uninterrupted_losses(
    target, saved_by_pp2_x_fsdp2, uninterrupted, tmp_path
):
    proc = _resume_from_step_5(saved_by_pp2_x_fsdp2, tmp_path, target)
    assert "loaded model, optimizer, lr_scheduler, train_state, dataloader" in proc.stderr
    _assert_steps_6_to_10_match(_losses(tmp_path), _losses(uninterrupted))


@pytest.mark.full_matrix
def test_a_checkpoint_of_one_process_continues_under_pp2_x_fsdp2(uninterrupted, tmp_path):
    _resume_from_step_5(uninterrupted, tmp_path, "PP 2 x FSDP 2")
    _assert_steps_6_to_10_match(_losses(tmp_path), _losses(uninterrupted))


@pytest.mark.full_matrix
def test_checkpoint_of_cp2_x_fsdp2_continues_without_context_parallelism(
    saved_by_cp2_x_fsdp2, uninterrupted, tmp_path
):
    proc = _resume_from_step_5(saved_by_cp2_x_fsdp2, tmp_path, "1 process")
    assert "loaded model, optimizer, lr_scheduler, train_state, dataloader" in proc.stderr
    _assert_steps_6_to_10_match(_losses(tmp_path), _losses(uninterrupted))


@pytest.mark.parametrize("target", ["1 process", "FSDP 2"])
def test_checkpoint_of_fsdp2_x_tp2_loads_into_another_layout(
    target, saved_by_fsdp2_x_tp2, uninterrupted, tmp_path
):
    proc = _resume_from_step_5(saved_by_fsdp2_x_tp2, tmp_path, target)
    assert "loaded model, optimizer, lr_scheduler, train_state, dataloader" in proc.stderr
    _assert_steps_6_to_10_match(_losses(tmp_path), _losses(uninterrupted))


def test_a_save_killed_midway_leaves_the_previous_checkpoint_in_use(uninterrupted, tmp_path):
    crash = {**os.environ, "CRASH_DURING_SAVE_STEP": "10"}  # exit code 17 (crash_during_save.py)
    fault = ["--job.custom_import", "tests.integration.crash_during_save"]
    _train(tmp_path, extra=["--checkpoint.no_last_save_model_only", *fault], env=crash, expect=17)
    assert _steps(tmp_path) == ["step-10.partial", "step-5"]
    proc = _train(tmp_path, extra=["--checkpoint.no_last_save_model_only"])
    assert "Resumed from checkpoint" in proc.stderr and "step-5 (step 5)" in proc.stderr
    assert _losses(tmp_path)[10] == _losses(uninterrupted)[10]
    assert _steps(tmp_path) == ["step-10", "step-5"]


def test_keep_latest_k_keeps_the_newest_complete_checkpoints(tmp_path):
    _train(
        tmp_path,
        extra=["--training.steps", "6", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2"],
    )
    assert _steps(tmp_path) == ["step-4", "step-6"]


def test_excluded_dataloader_restarts_the_data_but_keeps_the_weights(uninterrupted, tmp_path):
    proc = _resume_from_step_5(
        uninterrupted, tmp_path, extra=["--checkpoint.exclude_from_loading", "dataloader"]
    )
    assert "loaded model, optimizer, lr_scheduler, train_state; excluded dataloader" in proc.stderr
    resumed, original = _losses(tmp_path), _losses(uninterrupted)
    assert resumed[6] != original[6]  # step 6 now sees the first batch again
    assert resumed[6] < 0.95 * original[1]  # ... with the trained weights, not fresh ones


def test_an_initial_load_that_is_not_model_only_continues_the_run_it_was_saved_by(uninterrupted, tmp_path):
    """As upstream: initial_load_model_only = false reads a training checkpoint whole (step, lr
    schedule, data position, optimizer), so the new folder's steps 6-10 are the source's."""
    step_5 = uninterrupted / "checkpoint" / "step-5"
    proc = _train(tmp_path, extra=["--checkpoint.initial_load_path", str(step_5),
                                   "--checkpoint.no_initial_load_model_only"])  # fmt: skip
    assert "loaded model, optimizer, lr_scheduler, train_state, dataloader" in proc.stderr
    resumed, original = _losses(tmp_path), _losses(uninterrupted)
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    assert all(resumed[s] == original[s] for s in resumed), (resumed, original)


def test_a_load_that_restarts_the_step_count_on_two_ranks_sets_the_loaded_step_aside_at_its_first_save(
    uninterrupted, tmp_path
):
    (tmp_path / "checkpoint").mkdir(parents=True)
    shutil.copytree(uninterrupted / "checkpoint" / "step-5", tmp_path / "checkpoint" / "step-5")
    extra = [
        "--checkpoint.exclude_from_loading",
        "train_state",
        "--training.steps",
        "4",
        "--checkpoint.interval",
        "2",
    ]
    proc = _train(tmp_path, "FSDP 2", extra)
    assert "Set aside the checkpoints of steps [5], newer than step 2 of this run" in proc.stderr
    assert _steps(tmp_path) == ["step-2", "step-4", "step-5.superseded"]
    assert sorted(_losses(tmp_path)) == [1, 2, 3, 4]


def test_load_only_rolls_back_like_load_step_but_writes_and_renames_nothing(uninterrupted, tmp_path):
    """Without load_only, loading step 5 below step-10 sets step-10 aside and saves 10 again."""
    shutil.copytree(uninterrupted / "checkpoint", tmp_path / "checkpoint")
    before = {p.relative_to(tmp_path): p.stat().st_mtime_ns for p in (tmp_path / "checkpoint").rglob("*")}
    proc = _train(tmp_path, extra=["--checkpoint.load_only", "--checkpoint.load_step", "5"])
    assert "Resumed from checkpoint" in proc.stderr and "saving none (load_only)" in proc.stderr
    resumed, original = _losses(tmp_path), _losses(uninterrupted)
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    assert all(resumed[s] == original[s] for s in resumed), (resumed, original)
    after = {p.relative_to(tmp_path): p.stat().st_mtime_ns for p in (tmp_path / "checkpoint").rglob("*")}
    assert after == before


def test_a_resume_with_more_steps_runs_its_first_step_at_the_new_schedules_lr(uninterrupted, tmp_path):
    """The checkpoint holds the 10-step schedule's lr for step 6; a 20-step run decays later."""
    _resume_from_step_5(uninterrupted, tmp_path, extra=["--training.steps", "20"])
    logged = _lrs(tmp_path)
    cfg = parse_args(BASE + ["--training.steps", "20"], env={})
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.optimizer.lr)
    scheduler = build_lr_scheduler(optimizer, cfg)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    assert logged[6] == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-6)
    assert logged[6] != pytest.approx(_lrs(uninterrupted)[6], rel=1e-3)


def test_a_resume_with_another_peak_lr_and_weight_decay_uses_them(uninterrupted, tmp_path):
    """As after a loss spike: the checkpoint's optimizer and scheduler brought back the old
    peak lr (and weight decay), and the run kept training at them without a word."""
    extra = ["--optimizer.lr", "1e-3", "--optimizer.weight_decay", "0.05"]
    proc = _resume_from_step_5(uninterrupted, tmp_path, extra=extra)
    cfg = parse_args(BASE + extra, env={})
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.optimizer.lr)
    scheduler = build_lr_scheduler(optimizer, cfg)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    assert _lrs(tmp_path)[6] == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-6)
    assert "[optimizer] of this run replaces the checkpoint's: lr 0.003 -> 0.001, weight_decay" in proc.stderr


def _lrs(folder) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_metrics(folder)}


def test_a_resumed_run_logs_its_own_first_step_and_counts_only_its_own_steps(uninterrupted, tmp_path):
    proc = _resume_from_step_5(uninterrupted, tmp_path, extra=["--metrics.log_freq", "4"])
    assert sorted(_losses(tmp_path)) == [6, 8, 10]  # first of this run, every 4th, last
    assert "Training finished at step 10: 5 steps in" in proc.stderr


def test_unknown_exclude_entry_is_refused_with_exit_code_2(tmp_path):
    proc = run_trainer(
        BASE + ["--checkpoint.exclude_from_loading", "optimiser", "--job.dump_folder", str(tmp_path)]
    )
    assert proc.returncode == 2
    assert "'checkpoint.exclude_from_loading'" in proc.stderr and "Traceback" not in proc.stderr


def test_an_hf_export_of_a_mask_hf_cannot_run_is_refused_before_training(tmp_path):
    # The trainer builds the adapter from this run's attention keys, not the flavor's.
    argv = ["--model.attn_backend", "flex", "--model.attn_mask_type", "sliding_window",
            "--checkpoint.last_save_in_hf", "--job.dump_folder", str(tmp_path)]  # fmt: skip
    proc = run_trainer(BASE + argv)
    assert proc.returncode == 2 and "'checkpoint.last_save_in_hf' = true" in proc.stderr, proc.stderr[-2000:]
    assert "sliding_window" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "checkpoint").exists()


def test_load_step_without_that_checkpoint_is_refused(uninterrupted, tmp_path):
    shutil.copytree(uninterrupted / "checkpoint", tmp_path / "checkpoint")
    proc = run_trainer(BASE + ["--checkpoint.load_step", "7", "--job.dump_folder", str(tmp_path)])
    assert proc.returncode == 2 and "'checkpoint.load_step' = 7" in proc.stderr, proc.stderr[-2000:]


def test_sigterm_saves_a_checkpoint_before_exiting(tmp_path):
    argv = BASE + [
        "--training.steps",
        "100000",
        "--checkpoint.interval",
        "100000",
        "--job.dump_folder",
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": python_path()}
    proc = subprocess.Popen([sys.executable, "-m", "torchtitan.train", *argv], cwd=PROJECT_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    _wait_for_a_logged_step(tmp_path)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, output[-2000:]
    stopped_at = max(_losses(tmp_path))
    assert _steps(tmp_path) == [f"step-{stopped_at}"], output[-2000:]


def test_sigterm_to_every_process_with_loader_workers_saves_a_checkpoint_before_exiting(tmp_path):
    """As SLURM signals every process of a job step: the loader workers get the SIGTERM too."""
    argv = BASE + ["--training.steps", "100000", "--checkpoint.interval", "100000",
                   "--training.dataset", _sharded_stream(tmp_path / "stream"),
                   "--training.dataloader_num_workers", "2", "--job.dump_folder", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": python_path()}
    proc = subprocess.Popen([sys.executable, "-m", "torchtitan.train", *argv], cwd=PROJECT_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    _wait_for_a_logged_step(tmp_path)
    os.killpg(proc.pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, output[-2000:]
    stopped_at = max(_losses(tmp_path))
    assert _steps(tmp_path) == [f"step-{stopped_at}"], output[-2000:]
    assert "Traceback" not in output


def _worker_pid(launcher_pid: int, local_rank: int) -> int | None:
    """The pid of torchrun's worker with LOCAL_RANK `local_rank`, once it has started."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"LOCAL_RANK={local_rank}".encode() in environ:
            return int(pid)
    return None


@pytest.mark.parametrize(
    "layout",
    [["--training.local_batch_size", "4"],
     pytest.param(["--parallelism.pipeline_parallel_degree", "2"], marks=pytest.mark.full_matrix)],
    ids=["FSDP 2", "PP 2"],
)  # fmt: skip
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step_with_a_checkpoint(layout, tmp_path):
    argv = BASE + [*layout, "--training.steps", "100000", "--checkpoint.interval", "100000",
                   "--job.dump_folder", str(tmp_path)]  # fmt: skip
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend",
                "c10d", "--rdzv_endpoint", "localhost:0", "-m", "torchtitan.train"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(launcher + argv, cwd=PROJECT_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    _wait_for_a_logged_step(tmp_path)
    os.kill(_worker_pid(proc.pid, local_rank=1), signal.SIGTERM)  # rank 0 gets no signal
    output, _ = proc.communicate(timeout=120)
    stopped_at = max(_losses(tmp_path))
    assert f"Stopped on request (SIGTERM) after step {stopped_at}" in output, output[-3000:]
    assert f"Stopped on request (another rank's request) after step {stopped_at}" in output
    assert _steps(tmp_path) == [f"step-{stopped_at}"], output[-3000:]
    assert "exitcode  : 143" in output  # torchrun's summary of the workers


def test_the_stop_file_stops_every_rank_at_the_same_step_even_without_checkpointing(tmp_path):
    # Only local rank 0 looks for the file; rank 1 must learn of it through the agreement, or it
    # would wait in the next step's collectives for a rank that has left.
    stop_file = tmp_path / "stop"
    argv = BASE + ["--training.local_batch_size", "4", "--training.steps", "100000", "--checkpoint.no_enable",
                   "--job.dump_folder", str(tmp_path)]  # fmt: skip
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend",
                "c10d", "--rdzv_endpoint", "localhost:0", "-m", "torchtitan.train"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1", STOP_FILE_ENV: str(stop_file)}
    proc = subprocess.Popen(launcher + argv, cwd=PROJECT_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    _wait_for_a_logged_step(tmp_path)
    stop_file.touch()
    output, _ = proc.communicate(timeout=120)
    stopped_at = max(_losses(tmp_path))
    assert f"Stopped on request (stop file {stop_file}) after step {stopped_at}" in output, output[-3000:]
    assert f"Stopped on request (another rank's request) after step {stopped_at}" in output
    # torchrun tears down the workers once the first exits, so the summary may list one of
    # them with 3 (stopped, nothing saved) and the other with -15; the two log lines above show
    # both ranks stopped.
    assert "exitcode  : 3" in output and proc.returncode != 0
    assert not (tmp_path / "checkpoint").exists()


def test_seed_checkpoint_gives_any_layout_the_same_start(tmp_path):
    seed = tmp_path / "seed"
    seed_argv = ["--checkpoint.create_seed_checkpoint", "--training.seed", "1"]
    run = run_trainer(BASE + seed_argv + ["--job.dump_folder", str(seed)])
    assert run.returncode == 0, run.stderr[-2000:]
    assert _steps(seed) == ["step-0"]
    reference = tmp_path / "reference"
    _train(reference, extra=["--training.seed", "1", "--training.steps", "2", "--checkpoint.no_enable"])
    from_seed = tmp_path / "from_seed"
    (from_seed / "checkpoint").mkdir(parents=True)
    shutil.copytree(seed / "checkpoint" / "step-0", from_seed / "checkpoint" / "step-0")
    _train(from_seed, "FSDP 2", ["--training.steps", "2"])  # seed 0, but the weights come from step-0
    got, want = _losses(from_seed)[1], _losses(reference)[1]
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def _uneven_ranks(how: str, folder, *argv: str):
    """Train on 2 ranks, one made slower or different (see tests/integration/uneven_ranks_worker.py)."""
    argv = [*BASE, "--training.local_batch_size", "4", *argv, "--job.dump_folder", str(folder)]
    return run_trainer(argv, nproc=2, uneven=how)


SLOW_FILE_WORK = {
    # Rank 0 alone writes the export while the others wait in a barrier.
    "rank 0's hf export": ("slow-export", ["--training.steps", "2", "--checkpoint.last_save_in_hf"]),
    # DCP's ranks wait for the slowest rank's shards before rank 0 writes the metadata.
    "rank 1's shard writes": ("slow-write", ["--training.steps", "3", "--checkpoint.interval", "2"]),
    # keep_latest_k's deletions on rank 0, while in async mode the others train on.
    "rank 0's pruning": ("slow-delete", ["--training.steps", "6", "--checkpoint.interval", "2",
                                         "--checkpoint.keep_latest_k", "1",
                                         "--checkpoint.async_mode", "async"]),
}  # fmt: skip


# Each case sleeps 12 s or more on purpose; the default run keeps one (the HF export, which
# every rank writes a part of), to stay within its time.
SLOW_CASES = [pytest.param(case, marks=() if case == "rank 0's hf export" else pytest.mark.full_matrix)
              for case in SLOW_FILE_WORK]  # fmt: skip


@pytest.mark.parametrize("case", SLOW_CASES)
def test_one_ranks_slow_checkpoint_file_work_does_not_time_out_the_others(tmp_path, case):
    """After step 1 the training collectives time out after comm.train_timeout_seconds (100 s by
    default, 5 s here); one rank's file work 12 s slower than the others' (as writing or
    deleting a large model is) killed the run (gloo: 'Timed out waiting 5000ms')."""
    how, argv = SLOW_FILE_WORK[case]
    proc = _uneven_ranks(how, tmp_path, *argv, "--comm.train_timeout_seconds", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = tmp_path / "checkpoint"
    if how == "slow-export":
        assert (folder / "step-2-hf" / "config.json").is_file()
    elif how == "slow-write":
        assert complete_steps(folder) == [2, 3]
    else:  # the final export (step 6, model only) and the newest resumable one; none left aside
        assert complete_steps(folder) == [4, 6] and not list(folder.glob("*.deleting-*"))


def test_last_save_in_hf_then_initial_load_in_hf_gives_the_dcp_weights(tmp_path):
    """The final weights exported as HF safetensors and read back through `initial_load_in_hf`
    train on like the same weights read from the DCP model-only save."""
    five = ["--training.steps", "5"]
    _train(tmp_path / "hf_export", extra=five + ["--checkpoint.last_save_in_hf"])
    exported = tmp_path / "hf_export" / "checkpoint" / "step-5-hf"
    assert (exported / "config.json").is_file() and (exported / "model.safetensors.index.json").is_file()
    _train(tmp_path / "dcp_export", extra=five)
    one = ["--training.steps", "1", "--checkpoint.folder", "fresh"]
    _train(tmp_path / "from_hf", extra=one + ["--checkpoint.initial_load_path", str(exported),
                                              "--checkpoint.initial_load_in_hf"])  # fmt: skip
    dcp_model = tmp_path / "dcp_export" / "checkpoint" / "step-5"
    _train(tmp_path / "from_dcp", extra=one + ["--checkpoint.initial_load_path", str(dcp_model)])
    got, want = _losses(tmp_path / "from_hf")[1], _losses(tmp_path / "from_dcp")[1]
    assert got == want, (got, want)
    assert want < _losses(tmp_path / "dcp_export")[1]  # trained weights, not a fresh init


# Upstream torchtitan's sequence: export at the end, then start from <folder>/step-N/ in HF.
EXPORT = ["--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf"]
LOAD_EXPORT = ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_model_only"]


def test_torchtitans_export_then_load_sequence_runs_as_written(tmp_path):
    """`initial_load_path = <folder>/step-10/` (upstream's name for its export) finds the export,
    which is `step-10-hf` here, and the new run starts from the trained weights."""
    first = tmp_path / "first"
    _train(first, extra=EXPORT)
    folder = first / "checkpoint"
    assert (folder / "step-10-hf" / "model.safetensors.index.json").is_file()
    second = tmp_path / "second"
    proc = _train(second, extra=["--checkpoint.initial_load_path", f"{folder}/step-10/", *LOAD_EXPORT])
    assert f"names the Hugging Face export {folder / 'step-10-hf'}" in proc.stderr, proc.stderr[-2000:]
    assert "Initialized the model from Hugging Face safetensors" in proc.stderr
    assert _losses(second)[1] < _losses(first)[1]  # the same first batch, on trained weights


@pytest.mark.full_matrix
def test_the_sequence_in_the_same_dump_folder_starts_from_the_export_it_names(tmp_path):
    """A folder holding only exports is no run to resume; with initial_load_path set, the run
    starts from it instead of refusing."""
    two = ["--training.steps", "2"]
    _train(tmp_path, extra=two + EXPORT)
    folder = tmp_path / "checkpoint"
    load = ["--checkpoint.initial_load_path", f"{folder}/step-2/", *LOAD_EXPORT]
    proc = _train(tmp_path, extra=two + load)
    assert "holds only exports" in proc.stderr and "Initialized the model from Hugging Face" in proc.stderr
    assert complete_steps(folder) == [2] and (folder / "step-2-hf").is_dir()


@pytest.mark.full_matrix
def test_an_hf_export_under_pp2_x_fsdp2_is_one_processs_and_loads_back_under_pp2(tmp_path):
    """Each stage's weights reach the export (float32, so that it matches to rounding: 3e-6 at
    worst after 5 steps), and an HF load under PP 2 reads each rank's layers only and trains on
    as one process does."""
    five = ["--training.steps", "5", "--checkpoint.last_save_in_hf", "--checkpoint.export_dtype", "float32"]
    _train(tmp_path / "pp", "PP 2 x FSDP 2", extra=five)
    _train(tmp_path / "one", extra=five)
    got = load_hf(tmp_path / "pp" / "checkpoint" / "step-5-hf")
    want = load_hf(tmp_path / "one" / "checkpoint" / "step-5-hf")
    # Per tensor, as the parity tests compare parameters after some steps (tests/parity.py).
    worst = max(relative_errors(got, want).items(), key=lambda item: item[1])
    assert worst[1] <= PARAM_RTOL, worst
    load = ["--training.steps", "1", "--checkpoint.folder", "fresh", "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_path", str(tmp_path / "pp" / "checkpoint" / "step-5-hf")]  # fmt: skip
    _train(tmp_path / "pp_from_hf", "PP 2", extra=load)
    _train(tmp_path / "one_from_hf", extra=load)
    got_loss, want_loss = _losses(tmp_path / "pp_from_hf")[1], _losses(tmp_path / "one_from_hf")[1]
    assert abs(got_loss - want_loss) <= 1e-5 * abs(want_loss), (got_loss, want_loss)


@pytest.mark.full_matrix
def test_a_deepseek_v3_pp2_run_whose_first_stage_has_no_moe_block_resumes_bit_for_bit(tmp_path):
    """Rank 0's stage holds one dense block: one optimizer param group fewer than rank 1's (the
    saved scheduler and groups are one rank's), and rank 1's expert biases, once loaded, must
    survive the shape-inference forward of the first step."""
    parts = "tok_embeddings,layers.0;layers.1,layers.2,layers.3,layers.4,layers.5,norm,output"
    argv = ["--config", "deepseek_v3_debug_model.toml", "--training.seq_len", "64",
            "--training.steps", "4", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1",
            "--training.local_batch_size", "4", "--checkpoint.enable", "--checkpoint.interval", "2",
            "--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.module_fqns_per_model_part", parts]  # fmt: skip
    for name in ("full", "resumed"):
        if name == "resumed":
            (tmp_path / name / "checkpoint").mkdir(parents=True)
            shutil.copytree(tmp_path / "full/checkpoint/step-2", tmp_path / "resumed/checkpoint/step-2")
        proc = run_trainer([*argv, "--job.dump_folder", str(tmp_path / name)], nproc=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
    resumed, original = _losses(tmp_path / "resumed"), _losses(tmp_path / "full")
    assert sorted(resumed) == [3, 4]
    assert all(resumed[s] == original[s] for s in resumed), (resumed, original)


# Expert parallelism: Qwen3 MoE debug model, fp32 so that other layouts match to rounding.
MOE = ["--config", "qwen3_debug_model_moe.toml", "--training.seq_len", "64", "--training.steps", "10",
       "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2", "--training.global_batch_size", "8",
       "--training.mixed_precision_param", "float32",
       "--checkpoint.enable", "--checkpoint.interval", "5"]  # fmt: skip
EP_LAYOUTS = {  # name: (processes, data-parallel degree, argv)
    # experts split over "ep", each FSDP-sharded over the 2 ranks holding it (DTensor slices)
    "FSDP 4 x EP 2": (4, 4, ["--parallelism.expert_parallel_degree", "2"]),
    # experts split over "ep", nothing else holds them (plain local slices)
    "EP 2": (2, 2, ["--parallelism.expert_parallel_degree", "2"]),
    # experts split over "ep", each slice sharded over its TP pair's hidden units (DTensors on "tp")
    "EP 2 x TP 2": (4, 2, ["--parallelism.expert_parallel_degree", "2",
                           "--parallelism.tensor_parallel_degree", "2",
                           "--parallelism.expert_tensor_parallel_degree", "2"]),
    # experts split over an EP group of 2 FSDP ranks x the TP pair (a flattened mesh), each
    # FSDP-sharded over the 2 ranks holding it
    "FSDP 2 x TP 2, EP 4 over TP": (4, 2, ["--parallelism.expert_parallel_degree", "4",
                                           "--parallelism.tensor_parallel_degree", "2"]),
    "1 process": (1, 1, []),
}  # fmt: skip


def _train_moe(folder, layout, extra=()):
    nproc, dp, argv = EP_LAYOUTS[layout]
    local = ["--training.local_batch_size", str(8 // dp)]
    proc = run_trainer(MOE + argv + local + list(extra) + ["--job.dump_folder", str(folder)], nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def saved_by_fsdp4_x_ep2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp4_ep2")
    _train_moe(folder, "FSDP 4 x EP 2")
    return folder


# Under full_matrix: the loads into other layouts below, to 1e-5, stay in the default run.
@pytest.mark.full_matrix
def test_expert_parallel_resume_from_step_5_repeats_steps_6_to_10_bit_for_bit(saved_by_fsdp4_x_ep2, tmp_path):
    (tmp_path / "checkpoint").mkdir()
    shutil.copytree(saved_by_fsdp4_x_ep2 / "checkpoint" / "step-5", tmp_path / "checkpoint" / "step-5")
    _train_moe(tmp_path, "FSDP 4 x EP 2")
    resumed, original = _losses(tmp_path), _losses(saved_by_fsdp4_x_ep2)
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    assert all(resumed[s] == original[s] for s in resumed), (resumed, original)


# EP 2 and EP 2 x TP 2 run under full_matrix: the load into experts split over EP across the TP
# ranks and FSDP-sharded reshards into a DTensor over a 2-D mesh, as EP 2 x TP 2's does; EP 2 x
# TP 2's experts are saved in the default run (test_hf_export_under_expert_parallelism...).
@pytest.mark.parametrize(
    "target",
    ["1 process", pytest.param("EP 2", marks=pytest.mark.full_matrix),
     pytest.param("EP 2 x TP 2", marks=pytest.mark.full_matrix), "FSDP 2 x TP 2, EP 4 over TP"],
)  # fmt: skip
def test_expert_parallel_checkpoint_loads_into_another_layout(target, saved_by_fsdp4_x_ep2, tmp_path):
    """Saved with the experts split over EP and FSDP-sharded: the whole expert weights and
    their optimizer moments load into one process, into another expert split, into experts
    split over EP and sharded over TP, and into experts split over EP across the TP ranks."""
    (tmp_path / "checkpoint").mkdir()
    shutil.copytree(saved_by_fsdp4_x_ep2 / "checkpoint" / "step-5", tmp_path / "checkpoint" / "step-5")
    proc = _train_moe(tmp_path, target)
    assert "loaded model, optimizer, lr_scheduler, train_state, dataloader" in proc.stderr
    _assert_steps_6_to_10_match(_losses(tmp_path), _losses(saved_by_fsdp4_x_ep2))


@pytest.mark.full_matrix
@pytest.mark.parametrize("layout", ["EP 2 x TP 2", "FSDP 2 x TP 2, EP 4 over TP"])
def test_checkpoint_saved_under_ep_and_tp_loads_into_one_process(layout, tmp_path):
    """The expert weights saved as (EP, TP) or (EP over TP, FSDP) views of the whole tensors
    load whole."""
    _train_moe(tmp_path / "saved", layout)
    step_5 = Path("checkpoint") / "step-5"
    shutil.copytree(tmp_path / "saved" / step_5, tmp_path / "resumed" / step_5)
    _train_moe(tmp_path / "resumed", "1 process")
    got, want = _losses(tmp_path / "resumed"), _losses(tmp_path / "saved")
    assert sorted(got) == [6, 7, 8, 9, 10]
    for step in got:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got, want)


# Seed 1 and a vanishing learning rate: the export holds (to ~1e-12) the seed-1 initial weights,
# which differ from the default seed's, and every layout exports the same numbers.
HF_EXPORT = ["--training.seed", "1", "--optimizer.lr", "1e-12", "--training.steps", "2",
             "--checkpoint.interval", "100", "--checkpoint.last_save_in_hf"]  # fmt: skip


@pytest.fixture(scope="module")
def moe_hf_export_of_one_process(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe_hf_one_process")
    _train_moe(folder, "1 process", HF_EXPORT)
    return folder


# FSDP 4 x EP 2 runs under full_matrix: EP 2 x TP 2 gathers DTensor slices the same way.
@pytest.mark.parametrize(
    "layout",
    [pytest.param("FSDP 4 x EP 2", marks=pytest.mark.full_matrix), "EP 2 x TP 2",
     "FSDP 2 x TP 2, EP 4 over TP"],
)  # fmt: skip
def test_hf_export_under_expert_parallelism_holds_every_expert(
    layout, moe_hf_export_of_one_process, tmp_path
):
    _train_moe(tmp_path, layout, HF_EXPORT)
    got = load_hf(tmp_path / "checkpoint" / "step-2-hf")
    want = load_hf(moe_hf_export_of_one_process / "checkpoint" / "step-2-hf")
    assert got.keys() == want.keys() and any(".experts.7." in k for k in got)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-9, msg=key)


@pytest.mark.parametrize(
    "layout",
    ["EP 2", "FSDP 4 x EP 2", *(pytest.param(layout, marks=pytest.mark.full_matrix)
                                for layout in ("EP 2 x TP 2", "FSDP 2 x TP 2, EP 4 over TP"))],
)  # fmt: skip
def test_initial_load_in_hf_under_expert_parallelism_starts_from_those_weights(
    layout, moe_hf_export_of_one_process, tmp_path
):
    """Default seed, weights from the seed-1 export: the first loss is the seed-1 run's. Each
    rank reads only the experts it holds."""
    exported = moe_hf_export_of_one_process / "checkpoint" / "step-2-hf"
    start = ["--training.steps", "1", "--checkpoint.folder", "fresh", "--checkpoint.initial_load_in_hf",
             "--checkpoint.initial_load_path", str(exported)]  # fmt: skip
    proc = _train_moe(tmp_path, layout, start)
    _, _, argv = EP_LAYOUTS[layout]
    ep = int(argv[argv.index("--parallelism.expert_parallel_degree") + 1])
    assert f"Reading only this rank's {8 // ep} of 8 experts per MoE layer" in proc.stdout + proc.stderr
    got, want = _losses(tmp_path)[1], _losses(moe_hf_export_of_one_process)[1]
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def test_a_step_that_makes_the_gradients_non_finite_is_never_checkpointed(tmp_path):
    # An lr of 1e30 makes step 1's weights huge and step 2's gradient norm NaN. Step 2 is no
    # log step (log_freq 10): the check before its save stops the run.
    diverging = ["--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0", "--metrics.log_freq", "10",
                 "--checkpoint.interval", "1", "--training.steps", "4"]  # fmt: skip
    proc = _train(tmp_path, "FSDP 2", diverging, expect=1)
    assert "is nan at step 2, so the weights are no longer finite" in proc.stderr, proc.stderr[-3000:]
    assert _steps(tmp_path) == ["step-1"]


def _stop_before_the_first_step(monkeypatch) -> None:
    """A stop asked for during startup: the trainer finds it when it first looks, before step 1."""

    def stop(requests):
        requests.requested, requests.reason = True, "the test"

    monkeypatch.setattr(StopRequests, "check_stop_file", stop)


def _train_in_process(folder, *extra) -> int:
    """One process, in this interpreter (so a test can patch the trainer); the exit code."""
    argv = BASE + ["--training.local_batch_size", "8", *extra, "--job.dump_folder", str(folder)]
    try:
        main(argv)
    except SystemExit as e:
        return e.code
    return 0


def test_a_stop_right_after_resuming_does_not_rewrite_the_checkpoint_it_resumed_from(tmp_path, monkeypatch):
    _train(tmp_path, extra=["--training.steps", "5", "--checkpoint.no_last_save_model_only"])
    written = (tmp_path / "checkpoint" / "step-5" / ".metadata").stat().st_mtime_ns
    _stop_before_the_first_step(monkeypatch)

    assert _train_in_process(tmp_path, "--training.steps", "10") == 143

    assert _steps(tmp_path) == ["step-5"]
    assert (tmp_path / "checkpoint" / "step-5" / ".metadata").stat().st_mtime_ns == written


def test_a_stop_before_a_fresh_runs_first_step_writes_no_checkpoint(tmp_path, monkeypatch):
    """Nothing is trained yet: a step-0 checkpoint would only make the next run resume at 0."""
    _stop_before_the_first_step(monkeypatch)
    assert _train_in_process(tmp_path, "--training.steps", "10") == 143
    assert not (tmp_path / "checkpoint").exists() or _steps(tmp_path) == []


@pytest.mark.parametrize(
    "flag, named", [("--checkpoint.no_enable", "'checkpoint.enable' = false"),
                    ("--checkpoint.load_only", "'checkpoint.load_only' = true")],
)  # fmt: skip
def test_a_stop_after_steps_with_saving_off_exits_3_not_resumable_143(
    tmp_path, monkeypatch, caplog, flag, named
):
    """143 tells a job script to resubmit and resume; with nothing saved there is nothing to resume."""

    looks = []

    def stop_after_step_2(requests):  # the third look comes before step 3
        looks.append(1)
        requests.requested = requests.requested or len(looks) == 3

    monkeypatch.setattr(StopRequests, "check_stop_file", stop_after_step_2)
    assert _train_in_process(tmp_path, flag) == 3
    assert sorted(_losses(tmp_path)) == [1, 2]
    assert f"Nothing was saved ({named}): steps 1 to 2 are lost" in caplog.text
    assert not (tmp_path / "checkpoint").exists() or _steps(tmp_path) == []


def test_a_sigterm_while_the_trainer_is_built_stops_it_with_143(tmp_path, monkeypatch):
    """By default SIGTERM killed the rank there (exit -15, a torchrun traceback, and a token
    cache half written)."""
    build_validator = Trainer._build_validator

    def signalled_while_building(trainer, *args):
        os.kill(os.getpid(), signal.SIGTERM)
        return build_validator(trainer, *args)

    monkeypatch.setattr(Trainer, "_build_validator", signalled_while_building)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert _train_in_process(tmp_path) == 143
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoint").exists()


SAVING_EVERY_2 = ["--checkpoint.interval", "2", "--checkpoint.no_last_save_model_only"]


def test_resuming_from_a_checkpoint_whose_metadata_was_emptied_names_it_and_the_earlier_ones(
    tmp_path, capsys
):
    assert _train_in_process(tmp_path, "--training.steps", "4", *SAVING_EVERY_2) == 0
    step_4 = tmp_path / "checkpoint" / "step-4"
    (step_4 / ".metadata").write_bytes(b"")

    assert _train_in_process(tmp_path, "--training.steps", "6", *SAVING_EVERY_2) == 2

    err = capsys.readouterr().err
    assert f"checkpoint {step_4} cannot be read" in err and "checkpoint.load_step (complete: 2)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("damage", ["4 KiB overwritten", "truncated"])
def test_a_resume_from_a_damaged_shard_exits_2_naming_the_file_the_step_and_the_newest_intact_one(
    tmp_path, capsys, damage
):
    """Without checksums, 4 KiB overwritten inside a shard loaded silently and the run went NaN
    two steps later, with a traceback that blamed the learning rate."""
    assert _train_in_process(tmp_path, "--training.steps", "4", *SAVING_EVERY_2) == 0
    shard = tmp_path / "checkpoint" / "step-4" / "__0_0.distcp"
    data = shard.read_bytes()
    middle = len(data) // 2
    damaged = (
        data[:middle] + bytes(4096) + data[middle + 4096 :] if damage == "4 KiB overwritten" else data[:100]
    )
    shard.write_bytes(damaged)

    assert _train_in_process(tmp_path, "--training.steps", "6", *SAVING_EVERY_2) == 2

    err = capsys.readouterr().err
    problem = "does not match its checksum" if damage == "4 KiB overwritten" else "has 100 bytes"
    assert f"checkpoint {shard.parent}: __0_0.distcp {problem}" in err, err[-2000:]
    assert "The newest intact checkpoint is step 2: resume from it with checkpoint.load_step = 2" in err
    assert "Traceback" not in err


def test_a_checkpoint_folder_without_metadata_is_kept_with_its_shards_and_the_run_resumes_before_it(
    tmp_path, caplog
):
    """It was skipped without a word, and the resumed run's save of step 4 deleted it."""
    assert _train_in_process(tmp_path, "--training.steps", "4", *SAVING_EVERY_2) == 0
    step_4 = tmp_path / "checkpoint" / "step-4"
    (step_4 / ".metadata").unlink()
    shards = {p.name: p.read_bytes() for p in step_4.glob("*.distcp")}

    assert _train_in_process(tmp_path, "--training.steps", "6", *SAVING_EVERY_2) == 0

    kept = tmp_path / "checkpoint" / "step-4.incomplete"
    assert {p.name: p.read_bytes() for p in kept.glob("*.distcp")} == shards
    assert _steps(tmp_path) == ["step-2", "step-4", "step-4.incomplete", "step-6"]
    assert "step-4 (step 4) is not usable: it has no .metadata" in caplog.text
    assert f"Resumed from checkpoint {tmp_path / 'checkpoint' / 'step-2'} (step 2)" in caplog.text


def test_a_damaged_shard_that_another_rank_checks_is_refused_by_every_rank(tmp_path):
    _train(tmp_path, layout="FSDP 2", extra=["--training.steps", "5", "--checkpoint.no_last_save_model_only"])
    step_5 = tmp_path / "checkpoint" / "step-5"
    shard = step_5 / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    proc = _train(tmp_path, layout="FSDP 2", extra=["--training.steps", "6"], expect=1)  # torchrun's 1

    assert proc.stderr.count(f"error: checkpoint {step_5}: __1_0.distcp does not match") == 2, proc.stderr[
        -3000:
    ]
    assert "Traceback" not in proc.stderr


def test_every_rank_refuses_a_damaged_checkpoint_that_rank_0_chose(tmp_path):
    """Rank 0 chooses the step to resume; raised there alone, its error left rank 1 waiting for
    the choice until the connection closed (exit 1, a traceback), or on NCCL until a timeout."""
    _train(tmp_path, layout="FSDP 2", extra=["--training.steps", "5"])
    metadata = tmp_path / "checkpoint" / "step-5" / ".metadata"
    metadata.write_bytes(b"")
    proc = _train(tmp_path, layout="FSDP 2", extra=["--training.steps", "6"], expect=1)
    assert proc.stderr.count(f"error: checkpoint {metadata.parent} cannot be read") == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Connection closed" not in proc.stderr


def test_a_stop_that_reaches_one_rank_stops_every_rank_after_the_same_step_without_checkpointing(tmp_path):
    """With checkpointing off the ranks did not agree on a stop: rank 1 stopped alone (exit 3)
    and rank 0 failed in the next step's collectives (exit 1, a traceback)."""
    proc = _uneven_ranks("rank-1-stops", tmp_path, "--checkpoint.no_enable")
    # "[titan rank1] <time> - WARNING - Stopped on request (SIGTERM) after step 2"
    lines = [line for line in proc.stderr.splitlines() if "Stopped on request" in line]
    stops = {line.split("]")[0]: line.split(" - ")[-1] for line in lines}
    assert stops == {"[titan rank0": "Stopped on request (another rank's request) after step 2",
                     "[titan rank1": "Stopped on request (SIGTERM) after step 2"}, lines  # fmt: skip
    assert "Traceback" not in proc.stderr and "Connection closed" not in proc.stderr


def test_a_stop_file_left_from_before_the_run_is_ignored_until_touched(tmp_path, monkeypatch):
    stop_file = tmp_path / "stop"
    stop_file.touch()  # an earlier run's stop
    monkeypatch.setenv(STOP_FILE_ENV, str(stop_file))
    assert _train_in_process(tmp_path, "--training.steps", "2", "--checkpoint.no_enable") == 0
    assert sorted(_losses(tmp_path)) == [1, 2]


def test_a_read_only_checkpoint_folder_is_refused_before_the_first_step(tmp_path, capsys):
    """It was found out at the first save, `interval` steps in, inside dcp.save (a traceback)."""
    with read_only(tmp_path / "checkpoint"):
        assert _train_in_process(tmp_path, "--training.steps", "2", "--checkpoint.interval", "1") == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'checkpoint'} cannot be written" in err and "Traceback" not in err
    assert not (tmp_path / "metrics.jsonl").exists() or _losses(tmp_path) == {}


def test_metrics_jsonl_that_is_a_folder_is_refused_with_exit_code_2(tmp_path, capsys):
    """It crashed with IsADirectoryError."""
    (tmp_path / "metrics.jsonl").mkdir()
    assert _train_in_process(tmp_path, "--training.steps", "1") == 2
    assert "metrics.jsonl is a folder, where the run writes its file" in capsys.readouterr().err
