"""DeepSeek-V3 debug model end to end on the CPU: it learns, and starts from published FP8
weights. (Its layouts' parity with one process is test_layout_parity.py's.)"""

import pytest

from tests.conftest import read_metrics, run_trainer

pytestmark = pytest.mark.integration

CONFIG = ["--config", "deepseek_v3_debug_model.toml"]
SMALL = ["--training.seq_len", "64", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2",
         "--training.mixed_precision_param", "float32"]  # fmt: skip
GLOBAL_BATCH = 4


@pytest.mark.full_matrix  # a 20-step smoke run; the flex config's loss-falls runs cover the model by default
def test_debug_config_trains_and_loss_falls(tmp_path):
    dump = tmp_path / "debug"
    steps = ["--training.steps", "20", "--training.seq_len", "128", "--metrics.log_freq", "1",
             "--job.dump_folder", str(dump)]  # fmt: skip
    proc = run_trainer(CONFIG + steps)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(dump)
    first, last = records[0]["loss"], records[-1]["loss"]
    print(f"deepseek_v3_debug_model.toml, 20 steps of seq_len 128: loss {first:.3f} -> {last:.3f}")
    assert records[-1]["step"] == 20
    assert last <= 0.7 * first, (first, last)


def test_published_fp8_weights_start_expert_parallel_training_at_their_dequantized_values(tmp_path):
    """An fp8 checkpoint laid out as DeepSeek publishes V3, loaded under EP 2 (each rank keeps
    half of the dequantized experts), starts at the loss of the same weights stored in fp32."""
    import torch

    from tests.unit.test_checkpoint_loading import _model
    from tests.unit.test_fp8_hf_checkpoints import _publish_fp8
    from torchtitan.components.hf_io import save_hf

    model, adapter = _model("deepseek_v3", seed=1)
    dequantized = _publish_fp8(model, adapter, tmp_path / "hf_fp8", mtp_layer=True)
    save_hf(dequantized, adapter.hf_config(torch.float32), tmp_path / "hf_fp32")
    ep2 = ["--parallelism.expert_parallel_degree", "2"]

    def first_loss(name, nproc, load=()):
        batch = ["--training.local_batch_size", str(GLOBAL_BATCH // nproc), "--training.steps", "1"]
        dump = ["--job.dump_folder", str(tmp_path / name)]
        proc = run_trainer(
            CONFIG + SMALL + batch + dump + (ep2 if nproc == 2 else []) + list(load), nproc=nproc
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return read_metrics(tmp_path / name)[0]["loss"]

    def loading(folder):
        return [
            "--checkpoint.enable",
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_path",
            str(folder),
        ]

    from_fp8 = first_loss("from_fp8", 2, loading(tmp_path / "hf_fp8"))
    assert from_fp8 == first_loss("from_fp32", 2, loading(tmp_path / "hf_fp32"))
    assert from_fp8 != first_loss("fresh", 1)  # the weights were loaded, not initialized
