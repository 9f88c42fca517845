"""The tensor-parallel styles of `torchtitan.distributed.tensor_parallel`, on a fake process group."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan.distributed.tensor_parallel import PartialGradColwiseParallel


@pytest.fixture
def tp_mesh():
    """A 2-rank CPU mesh whose collectives are no-ops (this process is rank 0)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_partial_grad_colwise_registers_its_input_hook_first_and_compiles(tp_mesh):
    """Its hook must run before ColwiseParallel's. Added afterwards with `prepend=True`, torch
    2.11's dynamo guarded the wrong hook and compiled TP of DeepSeek-V3's shared experts crashed
    ("IndexError: tuple index out of range"); registered first, the hooks keep their order."""
    torch.manual_seed(0)
    linear = parallelize_module(nn.Linear(4, 8), tp_mesh, PartialGradColwiseParallel())
    hooks = list(linear._forward_pre_hooks)
    assert len(hooks) == 2 and hooks == sorted(hooks)
    x = torch.randn(3, 4)
    compiled = torch.compile(linear, backend="eager")(x)
    torch.testing.assert_close(compiled, linear(x))
    assert compiled.shape == (3, 4)  # rank 0's half of the 8 output columns
