"""Float8 training (torchao's Float8Linear) through the trainer on the CPU with gloo: the parallel
layouts give one process's numbers, and AC changes none of them.

torch's CPU `_scaled_mm` is a slow reference kernel (0.5 s for one 256 x 512 x 256 product on
an Intel Xeon with AMX), so the parity runs emulate the float8 matmuls (`float8.emulate`):
torchao casts both operands to float8 with the same dynamic scales as the real kernel, and
multiplies the float8 values in float32. One tiny run keeps the real kernel.

Float8's dynamic scales come from each matmul's own inputs, so a data-parallel rank, which sees
only its share of the batch, scales differently from one process that sees all of it. The
reference is therefore one process taking the same micro-batches (two of 2 sequences, by
gradient accumulation).

Why FSDP matches to the last bit but for the logged mean (the tolerance below): every rank
runs, on its micro-batch, the same kernels on the same weights as the reference does on that
micro-batch, as long as both use the same number of threads (a CPU matmul's summation order
depends on it, and a float8 cast turns a last-bit difference into a whole float8 step: with 2
threads in the reference the loss parted by 1.7e-5 at step 2 on an Intel Xeon). The gradients
of the two micro-batches are then summed once, a + b, on both sides: the same rounding. What
differs is the logged loss, the mean of the two ranks' float32 losses formed in float64 on one
side and accumulated in float32 on the other, and the gradient norm, summed over shards in
float64: at most one float32 rounding apart, 2^-23 relative, allowed twice.
"""

import pytest

from tests.conftest import assert_metrics_match, read_metrics, run_trainer

pytestmark = pytest.mark.integration

FLOAT8 = ["--model.converters", "float8", "--training.seq_len", "64", "--training.steps", "5",
          "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2", "--float8.emulate",
          "--training.mixed_precision_param", "float32", "--training.global_batch_size", "4"]  # fmt: skip
OP_SAC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
NO_AC = ["--activation_checkpoint.mode", "none"]
CONVERTED = "Float8 training (tensorwise, emulated): 42 Linear layers converted, 1 kept in high precision"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # as each rank of a multi-process run
SAME_KERNELS_RTOL = 2 * 2**-23


def _train(folder, nproc: int, local_batch: int, extra=(), converted: bool = True, env=None) -> list[dict]:
    argv = FLOAT8 + ["--training.local_batch_size", str(local_batch), *extra]
    argv += ["--job.dump_folder", str(folder)]
    proc = run_trainer(argv, nproc=nproc, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (CONVERTED if converted else "Float8 training (tensorwise, emulated)") in proc.stderr
    return read_metrics(folder)


def _assert_close(records, reference, loss_rtol: float, grad_norm_rtol: float, steps: int = 5) -> None:
    """The first `steps` steps' losses and grad norms of `records` within the rtols of `reference`'s."""
    assert len(records) == len(reference) == 5
    rtol = {"loss": loss_rtol, "grad_norm": grad_norm_rtol}
    assert_metrics_match(records[:steps], reference[:steps], steps=steps, rtol=rtol)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("one_process"), 1, 2, NO_AC, env=ONE_THREAD)


def test_fsdp2_float8_with_op_sac_gives_one_process_taking_the_same_micro_batches(one_process, tmp_path):
    fsdp = _train(tmp_path, 2, 2, OP_SAC)
    _assert_close(fsdp, one_process, SAME_KERNELS_RTOL, SAME_KERNELS_RTOL)
    # It learns: the loss ends at 0.76 of the first step's.
    assert fsdp[-1]["loss"] < 0.9 * fsdp[0]["loss"]


def test_float8_runs_torchs_own_scaled_mm_on_the_cpu(tmp_path):
    """The real kernel, on 16 tokens a step (its CPU time grows with the product's size)."""
    argv = ["--model.converters", "float8", "--training.seq_len", "16", "--training.local_batch_size", "1",
            "--training.steps", "2", "--metrics.log_freq", "1",
            "--job.dump_folder", str(tmp_path)]  # fmt: skip
    proc = run_trainer(argv, nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Float8 training (tensorwise): 42 Linear layers converted" in proc.stderr
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


@pytest.mark.full_matrix
def test_tp2_float8_with_full_ac_matches_one_process(one_process, tmp_path):
    tp = _train(tmp_path, 2, 2, ["--parallelism.tensor_parallel_degree", "2",
                                 "--activation_checkpoint.mode", "full"])  # fmt: skip
    # TP's row-wise partial sums round differently before the next casts, and a float8 cast
    # turns that into whole float8 steps: a bound from the arithmetic would be as wide as float8
    # on against off. Measured (emulated, Intel Xeon): 3.6e-5 in loss at step 3, 3.9e-4 in gradient
    # norm at step 4; float8 on and off differ by 1.4e-3 in loss and 4.8e-3 in gradient norm.
    _assert_close(tp, one_process, 5e-4, 3e-3)


@pytest.mark.full_matrix
def test_compiled_float8_with_op_sac_matches_eager(tmp_path):
    eager = _train(tmp_path / "eager", 1, 4, OP_SAC)
    compiled = _train(tmp_path / "compiled", 1, 4, OP_SAC + ["--compile.enable"])
    # Inductor's fused amax and casts round differently; by step 5 the gradient norm is 2e-3 off.
    # float8 on and off differ by 1.4e-3 in loss.
    _assert_close(compiled, eager, 5e-4, 5e-3)


@pytest.mark.full_matrix
@pytest.mark.parametrize("config", ["qwen3_debug_model_moe.toml", "deepseek_v3_debug_model.toml"])
def test_moe_tp2_float8_matches_one_process(config, tmp_path):
    moe = ["--config", config]
    reference = _train(tmp_path / "one_process", 1, 2, moe, converted=False, env=ONE_THREAD)
    tp = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "2"]
    records = _train(tmp_path / "tp2", 2, 2, moe + tp, converted=False)
    # A float8 rounding flip can flip an expert choice, after which the two runs part by as much
    # as float8 on and off do. Up to step 3 the bound is 1e-4 in loss; after it, only the loss is
    # compared, loosely (float8 off differs by 1.4e-4 in loss for Qwen3 MoE at step 2, 5.9e-4 for
    # DeepSeek-V3 at step 3).
    _assert_close(records, reference, 1e-4, 1e-3, steps=3)
    _assert_close(records, reference, 2e-3, float("inf"))


def test_print_after_conversion_logs_the_model_with_its_float8_layers(tmp_path):
    argv = FLOAT8 + ["--training.steps", "1", "--training.local_batch_size", "1"]
    argv += ["--model.print_after_conversion"]
    proc = run_trainer(argv + ["--job.dump_folder", str(tmp_path)], nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stderr.split("Model after its converters (['float8']):\n", 1)[1]
    assert "(wq): Float8Linear(in_features=256" in printed and "(output): Linear(in_features=256" in printed
