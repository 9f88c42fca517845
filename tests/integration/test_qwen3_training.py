"""Qwen3 debug models end to end on the CPU: they learn. (Their layouts' parity with one process,
the qk-norms' TP gradients among them, is test_layout_parity.py's.)"""

import pytest

from tests.conftest import read_metrics, run_trainer

pytestmark = pytest.mark.integration


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
