"""Every AC mode composes with FSDP: 2 processes give the 1-process no-AC loss and gradients."""

import pytest

from tests.integration.workers import AC_MODES, run_worker

pytestmark = pytest.mark.integration


def test_each_ac_mode_under_fsdp_matches_single_process_without_ac():
    report = run_worker("ac_fsdp_worker")
    assert set(report) == set(AC_MODES)
    for mode, diffs in report.items():
        assert diffs["n_grads"] == 57, mode
        assert diffs["equals_fsdp_without_ac"], mode
        # FSDP sums two half-batch gradients in another order than one full batch: rounding only.
        assert diffs["loss_rel_diff"] <= 1e-6, (mode, diffs)
        assert diffs["grad_diff"] <= 1e-6, (mode, diffs)
