"""training.deterministic and deterministic_warn_only: what an op without a deterministic kernel does."""

import pytest
import torch

from torchtitan.distributed.determinism import set_determinism


@pytest.fixture(autouse=True)
def restore_deterministic_mode():
    enabled, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn


def _put_with_repeated_index() -> torch.Tensor:
    """`put_` without accumulate has no deterministic kernel: which write lands is unordered."""
    return torch.zeros(3).put_(torch.tensor([1, 1]), torch.tensor([5.0, 5.0]))


def test_deterministic_mode_refuses_an_op_without_a_deterministic_kernel():
    set_determinism(seed=3, deterministic=True)
    with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
        _put_with_repeated_index()


def test_warn_only_runs_that_op_and_warns_naming_it():
    set_determinism(seed=3, deterministic=True, warn_only=True)
    with pytest.warns(UserWarning, match="put_ does not have a deterministic implementation"):
        out = _put_with_repeated_index()
    assert out.tolist() == [0.0, 5.0, 0.0]


def test_without_deterministic_the_seed_alone_is_set():
    torch.use_deterministic_algorithms(False)
    set_determinism(seed=3, deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.equal(torch.rand(2), torch.rand(2, generator=torch.Generator().manual_seed(3)))
