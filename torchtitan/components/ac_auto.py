"""Mode "auto" at startup: find the run's per-block AC plan, or reuse the saved one.

Rank 0 plans with the memory estimator (`scripts/estimate_memory.py --plan`, in a process of
its own: it simulates every rank of the layout in a fake process group), then every rank gets
the same plan. The plan and its table go to `<dump_folder>/ac_plan.json`; a later run (a
resume) with the same layout, model, batch, budget, AC keys and torch takes it from there instead
of planning again (`layout_fingerprint` says what counts). A plan that cannot fit exits 2 on every
rank with the estimator's message.
"""

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan.config import ActivationCheckpoint
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig, model_compile_enabled
from torchtitan.config.toml_writer import to_toml
from torchtitan.distributed.ac_planner import BLOCK_CHOICES, BlockPlan, GiB, RecomputeRates
from torchtitan.distributed.activation_checkpoint import (
    OFFLOAD_CHOICES,
    ACFacts,
    auto_budget,
    check_offload,
    fixed_mode,
    no_planner,
)
from torchtitan.distributed.pipeline_parallel import splits_backward
from torchtitan.distributed.rank_agreement import agree_on_config_errors
from torchtitan.tools.device_info import capacity_bytes, peak_bf16_flops, peak_memory_bandwidth

logger = logging.getLogger(__name__)

PLAN_FILE = "ac_plan.json"
# How long the other ranks wait for rank 0's plan at least (`comm.init_timeout_seconds` when
# longer): planning Llama 3 70B on 64 ranks took 2 to 3 minutes on one core of an AMD EPYC.
PLANNING_TIMEOUT_SECONDS = 3600
ESTIMATOR = Path(__file__).resolve().parents[2] / "scripts" / "estimate_memory.py"
# The recompute throughput where the device's peak is unknown (the CPU, other GPUs): about 40%
# of an H100's dense bf16 peak.
DEFAULT_TFLOPS = 400.0
# Of the device's bf16 peak, what recompute is taken to reach.
RECOMPUTE_MFU = 0.4
# The element-wise throughput where the device's bandwidth is unknown, GB/s (about 60% of an
# H100's), and the share of a known peak bandwidth that element-wise kernels reach.
DEFAULT_MEMORY_GBPS = 2000.0
ELEMENTWISE_BANDWIDTH_SHARE = 0.7
# What changes a step's memory, by config section; everything else (steps, logging, checkpoint
# and data paths, the learning rate) leaves a saved plan valid.
_FINGERPRINTED = {
    "model": None,
    "parallelism": None,
    "compile": None,
    "float8": None,
    "activation_checkpoint": None,
    "optimizer": ("name", "implementation", "early_step_in_backward"),
    "training": (
        "local_batch_size", "global_batch_size", "seq_len", "loss_chunks", "dtype", "mixed_precision_param",
        "mixed_precision_reduce", "enable_cpu_offload",
    ),
}  # fmt: skip


def budget_bytes(cfg: JobConfig, device: torch.device) -> int:
    """The per-device budget (`activation_checkpoint.auto_budget`): the accelerator's memory
    counts when `auto_memory_gib` is 0."""
    return auto_budget(cfg.activation_checkpoint, capacity_bytes(device))


def recompute_rates(ac: ActivationCheckpoint, device: torch.device | None = None) -> RecomputeRates:
    """The planner's prices (`RecomputeRates`): the `auto_*` keys, with no copy price without
    `auto_offload`; where `auto_tflops` or `auto_memory_gbps` is 0, a fraction of `device`'s
    peak (`RECOMPUTE_MFU`, `ELEMENTWISE_BANDWIDTH_SHARE`), or the defaults where it is unknown
    (no device: the memory estimator, planning for any)."""
    peak_flops = peak_bf16_flops(device) if device is not None else None
    peak_bandwidth = peak_memory_bandwidth(device) if device is not None else None
    tflops = ac.auto_tflops or (RECOMPUTE_MFU * peak_flops / 1e12 if peak_flops else DEFAULT_TFLOPS)
    gbps = ac.auto_memory_gbps or (
        ELEMENTWISE_BANDWIDTH_SHARE * peak_bandwidth / 1e9 if peak_bandwidth else DEFAULT_MEMORY_GBPS
    )
    offload_gbps = ac.auto_offload_gbps if ac.auto_offload else 0.0
    return RecomputeRates(tflops, gbps, ac.auto_host_us_per_op, ac.auto_host_us_per_rerun, offload_gbps)


def with_rates_of(cfg: JobConfig, device: torch.device) -> JobConfig:
    """`cfg` with the `auto_*` prices that are 0 set to `device`'s (`recompute_rates`), and
    `auto_offload` off on the CPU (whose copies are synchronous, so nothing hides them): what the
    estimator, planning in a process without the device, is given, and what a saved plan's
    fingerprint records."""
    ac = cfg.activation_checkpoint
    rates = recompute_rates(ac, device)
    ac = dataclasses.replace(
        ac, auto_tflops=rates.tflops, auto_memory_gbps=rates.memory_gbps,
        auto_offload=ac.auto_offload and device.type != "cpu",
    )  # fmt: skip
    return dataclasses.replace(cfg, activation_checkpoint=ac)


def planned_choices(cfg: JobConfig) -> tuple[str, ...]:
    """What mode "auto" chooses among for `cfg`: every choice, less the offloading ones where
    `auto_offload` is off or the layout cannot offload (`activation_checkpoint.check_offload`
    refuses it: compiled blocks, a zero-bubble schedule)."""
    ac = cfg.activation_checkpoint
    facts = ACFacts(compile_enabled=model_compile_enabled(cfg), split_backward=splits_backward(cfg))
    try:
        check_offload(fixed_mode(ac, "op_offload"), facts)
    except ConfigError:
        return tuple(c for c in BLOCK_CHOICES if c not in OFFLOAD_CHOICES)
    return tuple(c for c in BLOCK_CHOICES if ac.auto_offload or c not in OFFLOAD_CHOICES)


def layout_fingerprint(cfg: JobConfig, world_size: int, budget: int) -> str:
    """A hash of what a plan depends on: the world size, the budget, the torch release and the
    config keys in `_FINGERPRINTED` (the plan itself, `auto_plan`, left out)."""
    parts = {"world_size": world_size, "budget": budget, "torch": torch.__version__}
    for section, keys in _FINGERPRINTED.items():
        values = dataclasses.asdict(getattr(cfg, section))
        if section == "activation_checkpoint":
            values.pop("auto_plan")
        parts[section] = values if keys is None else {k: values[k] for k in keys}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def resolve_auto_plan(cfg: JobConfig, world_size: int, rank: int, device: torch.device) -> JobConfig:
    """`cfg` with `auto_plan` filled, for mode "auto" without one; `cfg` itself otherwise.

    Collective: every rank calls it. Rank 0 reads the saved plan or makes one; every rank
    gets the same, and rank 0 logs its table.

    Raises:
        ConfigError: on every rank, for a missing budget or a plan that cannot fit.
    """
    ac = cfg.activation_checkpoint
    if ac.mode != "auto" or ac.auto_plan.strip():
        return cfg
    budget = agree_on_config_errors(lambda: budget_bytes(cfg, device))
    cfg = with_rates_of(cfg, device)
    fingerprint = layout_fingerprint(cfg, world_size, budget)
    path = Path(cfg.job.dump_folder) / PLAN_FILE
    group = _planning_group(cfg)
    made = agree_on_config_errors(
        lambda: _saved_or_new_plan(cfg, path, fingerprint, world_size, budget) if rank == 0 else None, group
    )
    shared = [made]
    if group is not None:
        dist.broadcast_object_list(shared, src=0, group=group)
        dist.destroy_process_group(group)
    plan, reused = shared[0]
    if rank == 0:
        how = f"taken from {path} (same layout)" if reused else f"planned and saved to {path}"
        logger.info(f"Activation checkpointing plan (mode auto), {how}:\n{plan.table()}")
    return dataclasses.replace(
        cfg, activation_checkpoint=dataclasses.replace(cfg.activation_checkpoint, auto_plan=plan.spec)
    )


def _planning_group(cfg: JobConfig) -> dist.ProcessGroup | None:
    """A gloo group of every rank, to wait in for rank 0's plan; None when not distributed.

    Why its own: the world's timeout is `comm.init_timeout_seconds` (300 s by default), shorter
    than a large model's planning."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    seconds = max(cfg.comm.init_timeout_seconds, PLANNING_TIMEOUT_SECONDS)
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))


def _saved_or_new_plan(
    cfg: JobConfig, path: Path, fingerprint: str, world_size: int, budget: int
) -> tuple[BlockPlan, bool]:  # fmt: skip
    """(the plan, whether it was the saved one)."""
    if path.is_file():
        try:
            saved = BlockPlan.from_json(path.read_text())
        except (ValueError, KeyError) as e:
            logger.warning(f"{path} is not a readable plan ({e}); planning again")
        else:
            if saved.fingerprint == fingerprint:
                return saved, True
            logger.info(f"{path} was planned for another layout, budget or AC setting; planning again")
    plan = plan_with_estimator(cfg, world_size, budget)
    plan.fingerprint = fingerprint
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(plan.to_json())
    os.replace(partial, path)  # a crash never leaves half a plan to be taken as a whole one
    return plan, False


def plan_with_estimator(cfg: JobConfig, world_size: int, budget: int) -> BlockPlan:
    """Run `scripts/estimate_memory.py --plan` for `cfg` on `world_size` ranks within `budget`
    bytes, in a new process; its plan.

    Raises:
        ConfigError: the estimator's message when it exits 2 (nothing fits, a bad layout), or
            when this install has no estimator.
    """
    if not ESTIMATOR.is_file():
        raise no_planner(str(ESTIMATOR))
    logger.info(f"Activation checkpointing mode auto: planning within {budget / GiB:.2f} GiB per rank")
    with tempfile.TemporaryDirectory() as folder:
        config, out = Path(folder) / "config.toml", Path(folder) / "plan.json"
        config.write_text(to_toml(cfg))
        command = [
            sys.executable, str(ESTIMATOR), "--config", str(config), "--ngpu", str(world_size), "--plan",
            "--budget-gib", repr(budget / GiB), "--plan-out", str(out),
        ]  # fmt: skip
        # The estimator builds its own fake process group (a FakeStore): torchrun's variables do
        # not reach it.
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode == 2:
            raise ConfigError(done.stderr.strip().removeprefix("error: "))
        if done.returncode != 0:
            raise RuntimeError(f"planning mode auto failed:\n{done.stderr[-3000:]}")
        return BlockPlan.from_json(out.read_text())
