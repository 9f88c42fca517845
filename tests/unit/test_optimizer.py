"""`[optimizer]`: which kernel Adam/AdamW runs with."""

import pytest
import torch

from tests.model_testing import tiny_llama3
from torchtitan.components.optimizer import build_optimizer
from torchtitan.config.manager import parse_args


@pytest.mark.parametrize(
    "implementation, fused, foreach",
    [("fused", True, False), ("foreach", False, True), ("for-loop", False, False)],
)
def test_the_implementation_asked_for_is_the_one_built_on_the_cpu(implementation, fused, foreach):
    """torch has a fused Adam for the CPU too: "fused" there once fell back to foreach, 8x slower."""
    cfg = parse_args(["--optimizer.implementation", implementation], env={})
    model = tiny_llama3()
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    assert (optimizer.defaults["fused"], optimizer.defaults["foreach"]) == (fused, foreach)
