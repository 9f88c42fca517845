"""The test session's own setup (tests/conftest.py): which device the default suite runs on."""

import os

import pytest
import torch

from tests.conftest import selects_gpu_tests


@pytest.mark.parametrize(
    "markexpr, selects",
    [
        ("gpu", True),
        ("gpu and not slow", True),
        ("not full_matrix", False),
        ("not gpu", False),
        ("", False),
        ("not (gpu or integration)", False),
        ("not(gpu)", False),
        ("gpu or integration", False),
        ("not gpu and integration", False),
    ],  # fmt: skip
)
def test_only_a_mark_expression_that_asks_for_gpu_tests_keeps_the_gpu(markexpr, selects):
    assert selects_gpu_tests(markexpr) is selects


def test_the_default_suite_hides_the_gpu_so_a_gpu_machine_runs_it_as_ci_does():
    # Set by pytest_configure for every session not run with `-m gpu` (this test is not gpu-marked).
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert not torch.cuda.is_available()
