"""Gradient clipping: the global 2-norm, accumulated in float64. (Sharded gradients: the layout
parity tests compare every layout's grad_norm with one process's.)"""

import os
import subprocess
import sys

import pytest
import torch

import torchtitan.distributed.grad_norm as grad_norm_module
from tests.conftest import python_path
from torchtitan.components.training_step import finite_or_raise
from torchtitan.distributed.grad_norm import GradSquareSums, clip_grad_norm_


def _params_with_grads(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in [(64, 32), (32,), (7, 5, 3)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    return params


def _float64_norm(params) -> float:
    return torch.cat([p.grad.double().flatten() for p in params]).norm().item()


def test_returns_the_global_norm_before_clipping_and_clips_to_max_norm():
    params = _params_with_grads()
    want = _float64_norm(params)
    norm = clip_grad_norm_(params, max_norm=1.0)
    assert norm.dtype == torch.float32
    assert norm.item() == pytest.approx(want, rel=1e-6)
    assert _float64_norm(params) == pytest.approx(1.0, rel=1e-5)


def test_max_norm_zero_only_measures():
    params = _params_with_grads()
    before = [p.grad.clone() for p in params]
    clip_grad_norm_(params, max_norm=0.0)
    for p, grad in zip(params, before):
        assert torch.equal(p.grad, grad)


@pytest.mark.parametrize(
    "loss, grad_norm, named",
    [(float("inf"), 1.0, "loss is inf at step 3"), (2.0, float("nan"), "gradient norm is nan at step 3")],
)
def test_a_non_finite_loss_or_gradient_norm_stops_the_run_naming_the_step(loss, grad_norm, named):
    with pytest.raises(FloatingPointError, match=named):
        finite_or_raise(3, loss, grad_norm)


def test_finite_loss_and_gradient_norm_pass():
    finite_or_raise(3, 2.0, 1e30)


def test_a_partial_gradient_is_reduced_once_so_the_optimizer_step_issues_no_collective():
    """Under TP without FSDP a sequence-parallel norm's weight gradient is left a pending sum
    (Partial); the norm reduces it and stores it back, or every optimizer op on it (AdamW's
    foreach ops) all-reduced it again."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        weight = torch.nn.Parameter(DTensor.from_local(torch.ones(8), mesh, [Replicate()]))
        weight.grad = DTensor.from_local(torch.full((8,), 0.5), mesh, [Partial()])
        optimizer = torch.optim.AdamW([weight], lr=1e-3, foreach=True)
        with CommDebugMode() as clipping:
            clip_grad_norm_([weight], max_norm=1.0)
        with CommDebugMode() as stepping:
            optimizer.step()
    finally:
        dist.destroy_process_group()
    assert weight.grad.placements == (Replicate(),)
    assert clipping.get_total_counts() == 1  # the one reduction of the pending sum
    assert stepping.get_total_counts() == 0


def test_a_cpu_gradient_larger_than_a_piece_has_its_float64_norm(monkeypatch):
    monkeypatch.setattr(grad_norm_module, "CPU_NORM_PIECE", 100)
    params = _params_with_grads()  # 2048, 32 and 105 elements: pieces of 100 and the rest
    sums = GradSquareSums()
    sums.add(params)
    assert sums.global_norm().item() == pytest.approx(_float64_norm(params), rel=1e-12)


def test_a_cpu_gradients_norm_holds_no_float64_copy_of_it():
    """torch converts a CPU tensor to float64 whole for a float64 norm: 2x the gradient."""
    script = """
import resource, torch
from torchtitan.distributed.grad_norm import clip_grad_norm_
p = torch.nn.Parameter(torch.zeros(16_000_000)); p.grad = torch.randn(16_000_000)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
clip_grad_norm_([p], max_norm=0.0)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""
    env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert float(out.stdout) < 61  # MiB: the gradient's size; a float64 copy is 122, a piece 32
