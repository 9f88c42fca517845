"""Step metrics: one log line, one metrics.jsonl record, TensorBoard and W&B scalars."""

import contextlib
import json
import logging
import time
from pathlib import Path

import torch

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.tools.device_info import device_name, peak_bf16_flops, peak_memory_gib, reset_peak_memory

logger = logging.getLogger(__name__)

# TensorBoard and W&B tags as upstream torchtitan names them, so dashboards and scripts written
# for its runs read ours; metrics.jsonl keeps the short keys of the log line. Keys not listed
# (moe_imbalance, memory/num_ooms, ...) keep their own names.
SINK_TAGS = {
    "loss": "loss_metrics/global_avg_loss",
    "max_loss": "loss_metrics/global_max_loss",
    "tps": "throughput(tps)",
    "mfu_pct": "mfu(%)",
    "step_seconds": "time_metrics/end_to_end(s)",
    "data_loading_seconds": "time_metrics/data_loading(s)",
    "data_loading_pct": "time_metrics/data_loading(%)",
    "memory/max_active_gib": "memory/max_active(GiB)",
    "memory/max_active_pct": "memory/max_active(%)",
    "memory/max_reserved_gib": "memory/max_reserved(GiB)",
    "memory/max_reserved_pct": "memory/max_reserved(%)",
    "memory/max_allocated_gib": "memory/max_allocated(GiB)",
    "memory/max_rss_gib": "memory/max_rss(GiB)",
    "validation/loss": "validation_metrics/loss",
}


def sink_scalars(record: dict) -> dict[str, float]:
    """A record's numbers under their TensorBoard/W&B tags (the step and missing values left out)."""
    return {
        SINK_TAGS.get(key, key): value
        for key, value in record.items()
        if key != "step" and isinstance(value, (int, float))
    }


class _TensorBoard:
    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))

    def log(self, record: dict, step: int) -> None:
        for tag, value in sink_scalars(record).items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, folder: Path, job_config: JobConfig):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "'metrics.enable_wandb' = true needs the wandb package: pip install wandb "
                "(set WANDB_MODE=offline without network), or remove the key."
            ) from None
        try:
            self.run = wandb.init(
                dir=str(folder),
                config=job_config.to_dict(),
                project="torchtitan",
                name=job_config.job.description,
            )
        except wandb.errors.Error as e:  # not logged in, or no network: the user's to fix
            raise ConfigError(
                f"'metrics.enable_wandb' = true, but wandb could not start a run: {str(e).rstrip('.')}. Run "
                "`wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to write the run "
                f"under {folder / 'wandb'} without network, or remove the key."
            ) from None

    def log(self, record: dict, step: int) -> None:
        self.run.log(sink_scalars(record), step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsProcessor:
    """Accumulates timing between log steps and writes a record at each log step.

    Args:
        job_config: for `[metrics]` and the dump folder.
        device: for peak FLOPs and memory.
        flops_per_token: training FLOPs per token of the model (for TFLOPs and MFU).
        is_writer: whether this rank writes files (rank 0 unless save_for_all_ranks).
    """

    def __init__(
        self,
        job_config: JobConfig,
        device: torch.device,
        flops_per_token: float,
        is_writer: bool,
        rank: int = 0,
    ):
        self.cfg = job_config.metrics
        self.device, self.flops_per_token = device, flops_per_token
        self.peak_flops = peak_bf16_flops(device)
        if self.peak_flops is None and device.type != "cpu" and is_writer:
            logger.warning(
                f"MFU is not reported (mfu: n/a): the peak bf16 FLOP/s of {device_name(device)} is not in "
                "torchtitan/tools/device_info.py's table; tflops is still logged."
            )
        self.alloc_retries = 0
        self.is_writer = is_writer or self.cfg.save_for_all_ranks
        dump = Path(job_config.job.dump_folder)
        suffix = f"_rank{rank}" if self.cfg.save_for_all_ranks else ""
        self.jsonl_path = dump / f"metrics{suffix}.jsonl"
        self.sinks = []
        if self.is_writer:
            dump.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(self.jsonl_path, "a")
            if self.cfg.enable_tensorboard:
                self.sinks.append(_TensorBoard(dump / self.cfg.save_tb_folder / f"rank{rank}"))
            if self.cfg.enable_wandb:
                self.sinks.append(_WandB(dump, job_config))
        self.reset_window()

    def reset_window(self) -> None:
        self.window_start = time.perf_counter()
        self.tokens, self.data_seconds, self.steps = 0, 0.0, 0
        self.paused_seconds = 0.0
        reset_peak_memory(self.device)

    @contextlib.contextmanager
    def paused(self):
        """Leave the time spent inside out of the current window.

        For validation and checkpoint saves between steps: counted, they would lower the tps,
        TFLOPs and MFU of whichever window they fall in, though no training happened. The
        accelerator first finishes the step's queued work (the host runs ahead of it), so that
        its tail counts as training time rather than as paused (one sync, where validation and
        saves sync anyway).
        """
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.paused_seconds += time.perf_counter() - start

    def count(self, tokens: int, data_seconds: float) -> None:
        """Record one step's local tokens and data-loading time."""
        self.tokens += tokens
        self.data_seconds += data_seconds
        self.steps += 1

    def log(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        eta_seconds: float | None = None,
        extra: dict | None = None,
        max_loss: float | None = None,
    ) -> dict:
        """Write one record for `step` (from every rank's own counts) and start a new window.

        `loss` is the mean over the ranks' losses, `max_loss` (when given) the largest of them:
        a gap between the two shows data-parallel ranks that see very different batches."""
        elapsed = time.perf_counter() - self.window_start - self.paused_seconds
        tps = self.tokens / elapsed if elapsed > 0 else 0.0
        tflops = self.flops_per_token * tps / 1e12
        record = {
            "step": step,
            "loss": loss,
            **({"max_loss": max_loss} if max_loss is not None else {}),
            "grad_norm": grad_norm,
            "lr": lr,
            "tps": tps,
            "tflops": tflops,
            "mfu_pct": 100 * tflops * 1e12 / self.peak_flops if self.peak_flops else None,
            "data_loading_pct": 100 * self.data_seconds / elapsed if elapsed > 0 else 0.0,
            "data_loading_seconds": self.data_seconds / max(self.steps, 1),
            "step_seconds": elapsed / max(self.steps, 1),
            **peak_memory_gib(self.device),
            **(extra or {}),
        }
        logger.info(self.format_line(record, eta_seconds, extra or {}))
        self._warn_of_alloc_retries(record.get("memory/num_alloc_retries", 0), step)
        self.write(record)
        self.reset_window()
        return record

    def _warn_of_alloc_retries(self, retries: int, step: int) -> None:
        """An allocation retry frees the allocator's whole cache and synchronizes: steps that hit
        one are much slower, with no other sign in the log."""
        if retries > self.alloc_retries:
            logger.warning(
                f"{retries - self.alloc_retries} memory allocation retries up to step {step} "
                f"({retries} in all): the caching allocator ran out of free blocks and emptied its "
                "cache, which slows those steps. Lower the peak (activation_checkpoint.mode, "
                "training.local_batch_size) or try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
            )
        self.alloc_retries = retries

    def write(self, record: dict) -> None:
        """Append a record to metrics.jsonl and every enabled sink (writer ranks only)."""
        if not self.is_writer:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for sink in self.sinks:
            sink.log(record, record["step"])

    @staticmethod
    def format_line(r: dict, eta_seconds: float | None, extra: dict | None = None) -> str:
        memory = next((f"{v:.2f}GiB" for k, v in r.items() if k.startswith("memory/max")), "n/a")
        if "memory/max_reserved_pct" in r:
            memory += f"({r['memory/max_reserved_pct']:.2f}%)"
        mfu = f"{r['mfu_pct']:.2f}%" if r["mfu_pct"] is not None else "n/a"
        eta = f"  eta: {_format_eta(eta_seconds)}" if eta_seconds is not None else ""
        eta = "".join(f"  {k}: {v:.3f}" for k, v in (extra or {}).items()) + eta
        return (
            f"step: {r['step']:>5}  loss: {r['loss']:8.4f}  grad_norm: {r['grad_norm']:7.4f}  "
            f"lr: {r['lr']:.3e}  memory: {memory}  tps: {r['tps']:,.0f}  "
            f"tflops: {r['tflops']:.2f}  mfu: {mfu}  data: {r['data_loading_pct']:.1f}%{eta}"
        )

    def close(self) -> None:
        if self.is_writer:
            self.jsonl.close()
            for sink in self.sinks:
                sink.close()


def _format_eta(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
