"""What `tools/activation_memory` counts as held for backward."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from torchtitan.preflight import fake_world
from torchtitan.tools.activation_memory import bytes_held_for_backward


class DoubledSine(nn.Module):
    def forward(self, x):
        return (x * 2).sin()  # sin saves its input, x * 2


def test_a_plain_tensor_counts_its_bytes():
    assert bytes_held_for_backward(DoubledSine(), torch.randn(64, 1024, requires_grad=True)) == 64 * 1024 * 4


def test_a_dtensor_counts_the_bytes_of_this_ranks_shard_not_of_the_global_tensor():
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        x = distribute_tensor(torch.randn(64, 1024), mesh, [Shard(0)]).requires_grad_()
        held = bytes_held_for_backward(DoubledSine(), x)
    assert held == 32 * 1024 * 4
