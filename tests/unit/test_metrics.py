"""Throughput accounting of the metrics window, on a fake clock."""

import sys
import types

import pytest
import torch

from torchtitan.components import metrics as metrics_module
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(metrics_module, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def _processor(tmp_path) -> MetricsProcessor:
    cfg = parse_args(["--job.dump_folder", str(tmp_path)], env={})
    return MetricsProcessor(cfg, torch.device("cpu"), flops_per_token=6e9, is_writer=True)


def test_tps_counts_the_tokens_over_the_training_time_of_the_window(tmp_path, clock):
    metrics = _processor(tmp_path)
    clock.now = 4.0
    metrics.count(tokens=1000, data_seconds=0.4)
    clock.now = 8.0
    metrics.count(tokens=1000, data_seconds=0.4)
    record = metrics.log(step=2, loss=1.0, grad_norm=1.0, lr=1e-3)
    assert record["tps"] == pytest.approx(250.0)
    assert record["tflops"] == pytest.approx(250.0 * 6e9 / 1e12)
    assert record["step_seconds"] == pytest.approx(4.0)
    assert record["data_loading_pct"] == pytest.approx(10.0)


def test_paused_time_is_left_out_of_tps_and_step_time(tmp_path, clock):
    metrics = _processor(tmp_path)
    clock.now = 4.0
    metrics.count(tokens=1000, data_seconds=0.0)
    with metrics.paused():  # e.g. validation
        clock.now = 34.0
    clock.now = 38.0
    metrics.count(tokens=1000, data_seconds=0.0)
    with metrics.paused():  # e.g. a checkpoint save
        clock.now = 48.0
    record = metrics.log(step=2, loss=1.0, grad_norm=1.0, lr=1e-3)
    assert record["tps"] == pytest.approx(250.0)
    assert record["step_seconds"] == pytest.approx(4.0)


def test_the_accelerators_queued_work_counts_as_training_time_not_paused(tmp_path, clock, monkeypatch):
    """The host runs ahead: when validation starts, the step's last kernels are still queued."""
    metrics = _processor(tmp_path)
    metrics.device = torch.device("cuda")

    def finish_the_steps_tail(device):
        clock.now += 2.0

    monkeypatch.setattr(metrics_module.torch.accelerator, "synchronize", finish_the_steps_tail)
    clock.now = 2.0
    metrics.count(tokens=1000, data_seconds=0.0)  # the host is done; the device needs 2 s more
    with metrics.paused():
        clock.now += 30.0
    metrics.device = torch.device("cpu")  # whose memory statistics the record reads
    record = metrics.log(step=1, loss=1.0, grad_norm=1.0, lr=1e-3)
    assert record["step_seconds"] == pytest.approx(4.0)
    assert record["tps"] == pytest.approx(250.0)


def test_a_pause_counts_only_in_the_window_it_fell_in(tmp_path, clock):
    metrics = _processor(tmp_path)
    with metrics.paused():
        clock.now = 100.0
    metrics.log(step=1, loss=1.0, grad_norm=1.0, lr=1e-3)
    clock.now = 110.0
    metrics.count(tokens=1000, data_seconds=0.0)
    record = metrics.log(step=2, loss=1.0, grad_norm=1.0, lr=1e-3)
    assert record["tps"] == pytest.approx(100.0)


def _fake_wandb_not_logged_in() -> types.ModuleType:
    """A wandb module whose init fails as the real one does without `wandb login`."""

    class Error(Exception):
        pass

    class UsageError(Error):
        pass

    def init(**kwargs):
        raise UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    fake = types.ModuleType("wandb")
    fake.errors = types.SimpleNamespace(Error=Error, UsageError=UsageError)
    fake.init = init
    return fake


def test_wandb_without_login_is_a_config_error_naming_login_and_offline_mode(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb_not_logged_in())
    cfg = parse_args(["--job.dump_folder", str(tmp_path), "--metrics.enable_wandb"], env={})
    with pytest.raises(ConfigError) as info:
        MetricsProcessor(cfg, torch.device("cpu"), flops_per_token=6e9, is_writer=True)
    message = str(info.value)
    assert "'metrics.enable_wandb' = true" in message and "api_key not configured" in message
    assert "wandb login" in message and "WANDB_MODE=offline" in message


@pytest.mark.parametrize(
    "name, peak",
    [("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA H100 80GB HBM3", 989e12),
     ("NVIDIA H100 NVL", 835e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA A100-SXM4-80GB", 312e12),
     ("NVIDIA L4", None)],
)  # fmt: skip
def test_mfu_uses_the_bf16_peak_of_the_gpu_variant_its_name_gives(name, peak, monkeypatch):
    from torchtitan.tools.device_info import peak_bf16_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    assert peak_bf16_flops(torch.device("cuda")) == peak
    assert peak_bf16_flops(torch.device("cpu")) is None


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device as the metrics see it: its name, capacity and allocator statistics."""
    gib = 1024**3
    stats = {"reserved_bytes.all.peak": 70 * gib, "allocated_bytes.all.peak": 60 * gib}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    properties = types.SimpleNamespace(total_memory=140 * gib)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: properties)
    monkeypatch.setattr(torch.accelerator, "memory_stats", lambda device=None: dict(stats))
    monkeypatch.setattr(torch.accelerator, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: None)
    return stats


def _gpu_processor(tmp_path) -> MetricsProcessor:
    cfg = parse_args(["--job.dump_folder", str(tmp_path)], env={})
    return MetricsProcessor(cfg, torch.device("cuda"), flops_per_token=6e9, is_writer=True)


def test_gpu_memory_is_logged_as_a_share_of_the_devices_capacity(tmp_path, clock, fake_gpu, caplog):
    caplog.set_level("INFO", logger="torchtitan.components.metrics")
    record = _gpu_processor(tmp_path).log(step=1, loss=1.0, grad_norm=1.0, lr=1e-3)
    assert record["memory/max_reserved_gib"] == 70.0 and record["memory/max_reserved_pct"] == 50.0
    assert "memory: 70.00GiB(50.00%)" in caplog.text


def test_allocation_retries_are_warned_about_when_their_count_grows(tmp_path, clock, fake_gpu, caplog):
    metrics = _gpu_processor(tmp_path)
    fake_gpu["num_alloc_retries"] = 3
    metrics.log(step=10, loss=1.0, grad_norm=1.0, lr=1e-3)
    metrics.log(step=20, loss=1.0, grad_norm=1.0, lr=1e-3)  # no new retry: no new warning
    fake_gpu["num_alloc_retries"] = 5
    record = metrics.log(step=30, loss=1.0, grad_norm=1.0, lr=1e-3)
    warnings = [r.getMessage() for r in caplog.records if "allocation retries" in r.getMessage()]
    assert [w.split(":")[0] for w in warnings] == [
        "3 memory allocation retries up to step 10 (3 in all)",
        "2 memory allocation retries up to step 30 (5 in all)",
    ]
    assert record["memory/num_alloc_retries"] == 5


def test_a_gpu_without_a_known_peak_says_why_mfu_is_not_reported(tmp_path, fake_gpu, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    metrics = _gpu_processor(tmp_path)
    assert metrics.peak_flops is None
    assert "MFU is not reported (mfu: n/a): the peak bf16 FLOP/s of NVIDIA L40S" in caplog.text


def test_tensorboard_and_wandb_get_upstream_torchtitans_tags(tmp_path, clock, fake_gpu):
    fake_gpu["active_bytes.all.peak"] = 35 * 1024**3
    metrics = _gpu_processor(tmp_path)
    clock.now = 4.0
    metrics.count(tokens=1000, data_seconds=0.4)
    record = metrics.log(step=1, loss=2.5, grad_norm=1.0, lr=1e-3, max_loss=2.75)
    scalars = metrics_module.sink_scalars(record)
    assert scalars["loss_metrics/global_avg_loss"] == 2.5 and scalars["loss_metrics/global_max_loss"] == 2.75
    assert scalars["throughput(tps)"] == pytest.approx(250.0)
    assert scalars["time_metrics/end_to_end(s)"] == pytest.approx(4.0)
    assert scalars["time_metrics/data_loading(s)"] == pytest.approx(0.4)
    assert scalars["time_metrics/data_loading(%)"] == pytest.approx(10.0)
    assert scalars["memory/max_reserved(GiB)"] == 70.0 and scalars["memory/max_reserved(%)"] == 50.0
    assert scalars["memory/max_active(GiB)"] == 35.0 and scalars["memory/max_active(%)"] == 25.0
    assert scalars["tflops"] == pytest.approx(250 * 6e9 / 1e12)
    assert scalars["mfu(%)"] == pytest.approx(100 * 250 * 6e9 / 989e12)  # H200: 989 dense bf16 TFLOP/s
    assert scalars["grad_norm"] == 1.0 and scalars["lr"] == 1e-3
    assert "loss" not in scalars and "step" not in scalars


def test_an_unknown_mfu_is_left_out_of_the_scalars(tmp_path, clock):
    record = _processor(tmp_path).log(step=1, loss=1.0, grad_norm=1.0, lr=1e-3)
    assert record["mfu_pct"] is None and "mfu(%)" not in metrics_module.sink_scalars(record)
