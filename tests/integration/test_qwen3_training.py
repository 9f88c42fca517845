"""Qwen3 debug model end to end on the CPU: FSDP and TP parity with one process, and learning.

Run as a script under torchrun (2 processes), this file is also the worker that compares
every gradient of the TP-2 model with the plain model's (`run_worker` launches it).
"""

import json

import pytest
import torch
import torch.distributed as dist

from tests.conftest import MOE_METRICS, assert_metrics_match, read_metrics, run_trainer
from tests.integration.workers import run_worker, shut_down
from tests.model_testing import init_on_cpu, next_token_loss_and_grads
from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import loss_context
from torchtitan.models.qwen3 import qwen3_flavors
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.parallelize import parallelize_qwen3

pytestmark = pytest.mark.integration

CONFIG = ["--config", "qwen3_debug_model.toml"]
# Small and quick, fp32 so that parity holds to rounding. The config's lr (3e-3) drives these
# 5 steps through a loss spike (grad norm 5.6, clipped) on some torch versions, and Adam blows
# the layouts' 1e-7 rounding differences up to 1e-4 there; at 3e-4 they stay at 1e-7.
SMALL = ["--training.seq_len", "64", "--training.steps", "5", "--metrics.log_freq", "1",
         "--lr_scheduler.warmup_steps", "2", "--training.mixed_precision_param", "float32",
         "--optimizer.lr", "3e-4"]  # fmt: skip
GLOBAL_BATCH = 4


def _run(tmp_path, name, nproc, dp, extra=()) -> list[dict]:
    local = ["--training.local_batch_size", str(GLOBAL_BATCH // dp)]
    dump = ["--job.dump_folder", str(tmp_path / name)]
    proc = run_trainer(CONFIG + SMALL + local + list(extra) + dump, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(tmp_path / name)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("qwen3_single"), "single", 1, 1)


@pytest.mark.full_matrix  # FSDP parity is model-independent: test_training checks it on Llama 3 by default
def test_fsdp_on_two_processes_matches_one_process_with_the_same_global_batch(single_process, tmp_path):
    assert_metrics_match(_run(tmp_path, "fsdp2", 2, 2), single_process)


def test_tensor_parallel_2_matches_one_process(single_process, tmp_path):
    tp2 = ["--parallelism.tensor_parallel_degree", "2"]
    assert_metrics_match(_run(tmp_path, "tp2", 2, 1, tp2), single_process)


def test_tensor_parallel_2_gives_every_gradient_of_one_process():
    # The qk-norms run on each rank's local heads; their weight gradients must still be the
    # sum over all heads. A plan that got this wrong moves the 5-step grad norm by ~1e-4
    # only, so each gradient is compared directly.
    errors = run_worker("test_qwen3_training")
    assert {"layers.0.attention.q_norm.weight", "layers.5.attention.k_norm.weight"} <= errors.keys()
    # Written so that a NaN error (which max() may pass over) fails too.
    bad = {name: error for name, error in errors.items() if not error < 1e-5}
    assert not bad, bad


@pytest.mark.full_matrix  # a 20-step smoke run; the flex configs' loss-falls runs cover the models by default
@pytest.mark.parametrize("config", ["qwen3_debug_model.toml", "qwen3_debug_model_moe.toml"])
def test_debug_config_trains_and_loss_falls(config, tmp_path):
    dump = tmp_path / "debug"
    steps = ["--training.steps", "20", "--training.seq_len", "128", "--metrics.log_freq", "1"]
    proc = run_trainer(["--config", config] + steps + ["--job.dump_folder", str(dump)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(dump)
    first, last = records[0]["loss"], records[-1]["loss"]
    print(f"{config}, 20 steps of 8 x 128 tokens: loss {first:.3f} -> {last:.3f}")
    assert records[-1]["step"] == 20
    assert last <= 0.7 * first, (first, last)


def _gradients(parallel_dims: ParallelDims | None, cfg) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = Qwen3Model(qwen3_flavors["debugmodel"].update_from_config(cfg))
    if parallel_dims is not None:
        parallelize_qwen3(model, parallel_dims, cfg, torch.device("cpu"))
    init_on_cpu(model)
    tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(0))
    context = loss_context(parallel_dims or ParallelDims(1, 1, 1, 1), cfg)
    return next_token_loss_and_grads(model, tokens, context)[1]


def _worker() -> None:
    """Under torchrun with 2 processes: rank 0 prints {parameter: relative gradient error}."""
    dist.init_process_group("gloo")
    parallel_dims = ParallelDims(1, 1, 2, dist.get_world_size())
    parallel_dims.build_mesh("cpu")
    cfg = parse_args(
        CONFIG + ["--training.seq_len", "64", "--parallelism.tensor_parallel_degree", "2"], env={}
    )
    plain, tp = _gradients(None, cfg), _gradients(parallel_dims, cfg)
    assert plain.keys() == tp.keys()
    errors = {n: ((tp[n] - g).norm() / g.norm()).item() for n, g in plain.items()}
    if dist.get_rank() == 0:
        print(json.dumps(errors))
    shut_down()


if __name__ == "__main__":
    _worker()


def test_moe_debug_model_fsdp_on_two_processes_matches_one_process(tmp_path):
    moe = ["--model.flavor", "debugmodel_moe", "--training.steps", "3"]
    single = _run(tmp_path, "moe_single", 1, 1, moe)
    fsdp = _run(tmp_path, "moe_fsdp", 2, 2, moe)
    assert_metrics_match(fsdp, single, steps=3, keys=MOE_METRICS)
