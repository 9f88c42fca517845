"""`optimizer.early_step_in_backward` through the trainer, on the CPU with gloo: FSDP2 calls the
step hooks on the sharded parameters after reduce-scatter, and the run logs the same losses and
grad norms as stepping after backward. Checkpoints of either way resume the other way.

Tolerance: rtol 1e-5 on losses and grad norms (the two ways run the same kernels in the same
order per parameter; on this machine they agree to the last printed digit).
"""

import shutil

import pytest

from tests.conftest import read_metrics, run_trainer

pytestmark = pytest.mark.integration

STEPS = 6
BASE = ["--training.seq_len", "64", "--training.steps", str(STEPS), "--metrics.log_freq", "1",
        "--lr_scheduler.warmup_steps", "2", "--training.mixed_precision_param", "float32",
        "--training.max_norm", "0", "--checkpoint.enable", "--checkpoint.interval", "3"]  # fmt: skip
EARLY = ["--optimizer.early_step_in_backward"]
GLOBAL_BATCH = 4


def _train(folder, nproc=2, dp=2, extra=()) -> dict[int, dict]:
    local = ["--training.local_batch_size", str(GLOBAL_BATCH // dp)]
    argv = BASE + local + [*extra, "--job.dump_folder", str(folder)]
    proc = run_trainer(argv, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["step"]: r for r in read_metrics(folder)}


def _assert_matches(got: dict[int, dict], want: dict[int, dict], steps) -> None:
    assert sorted(got) == list(steps)
    for step in steps:
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5), (key, step)


@pytest.fixture(scope="module")
def stepping_after_backward(tmp_path_factory):
    folder = tmp_path_factory.mktemp("after")
    return folder, _train(folder)


def test_fsdp2_stepping_in_backward_logs_the_usual_losses_and_grad_norms(stepping_after_backward, tmp_path):
    _, want = stepping_after_backward
    _assert_matches(_train(tmp_path, extra=EARLY), want, range(1, STEPS + 1))


def test_a_checkpoint_of_the_usual_optimizer_resumes_stepping_in_backward(stepping_after_backward, tmp_path):
    source, want = stepping_after_backward
    shutil.copytree(source / "checkpoint" / "step-3", tmp_path / "checkpoint" / "step-3")
    _assert_matches(_train(tmp_path, extra=EARLY), want, range(4, STEPS + 1))


LAYOUTS = {
    "tp2": (2, 1, ["--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2_tp2": (4, 2, ["--parallelism.tensor_parallel_degree", "2"]),
    "hsdp2x2": (4, 4, ["--parallelism.data_parallel_replicate_degree", "2"]),
    "fsdp2_compiled_op_sac": (2, 2, ["--compile.enable", "--activation_checkpoint.mode", "selective",
                                     "--activation_checkpoint.selective_ac_option", "op"]),
}  # fmt: skip


@pytest.mark.full_matrix
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_other_layouts_stepping_in_backward_log_the_usual_numbers(layout, stepping_after_backward, tmp_path):
    nproc, dp, extra = LAYOUTS[layout]
    _, want = stepping_after_backward
    _assert_matches(_train(tmp_path, nproc, dp, [*extra, *EARLY]), want, range(1, STEPS + 1))


@pytest.mark.full_matrix
def test_expert_parallel_moe_stepping_in_backward_logs_the_usual_numbers(tmp_path):
    moe = ["--config", "qwen3_debug_model_moe.toml", "--parallelism.expert_parallel_degree", "2"]
    want = _train(tmp_path / "after", extra=moe)
    _assert_matches(_train(tmp_path / "early", extra=[*moe, *EARLY]), want, range(1, STEPS + 1))
