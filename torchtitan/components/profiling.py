"""`[profiling]`: torch.profiler chrome traces per rank, and CUDA memory snapshots.

Traces: every `profile_freq` steps the profiler records `profiler_active` steps after
`profiler_warmup` warm-up steps and writes
`<dump_folder>/<save_traces_folder>/iteration_<step>/rank<rank>_trace.json` (chrome trace
format; open it in Perfetto or chrome://tracing).

Memory snapshots (CUDA only): the allocator's history is recorded from the start, and a
snapshot pickle is written to `<dump_folder>/<save_memory_snapshot_folder>/iteration_<step>/`
every `profile_freq` steps, and to `.../oom/` when the run runs out of memory (open it at
https://pytorch.org/memory_viz).
"""

import contextlib
import logging
import pickle
from pathlib import Path

import torch

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig

logger = logging.getLogger(__name__)

MEMORY_HISTORY_ENTRIES = 100_000


class _NoProfiler:
    def step(self) -> None:
        pass


@contextlib.contextmanager
def maybe_profile(job_config: JobConfig, rank: int, first_step: int = 0):
    """A context whose value has `.step()`, called once per training step; records traces when
    `profiling.enable_profiling`, else does nothing.

    Pitfall: `profile_freq` must be at least `profiler_warmup + profiler_active`, the steps each
    profiling window needs (the config's `validate` refuses less).
    """
    p = job_config.profiling
    if not p.enable_profiling:
        yield _NoProfiler()
        return
    wait = p.profile_freq - p.profiler_warmup - p.profiler_active
    folder = Path(job_config.job.dump_folder) / p.save_traces_folder
    step = {"value": first_step}

    def write_trace(profiler) -> None:
        out = folder / f"iteration_{step['value']}"
        out.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(out / f"rank{rank}_trace.json"))
        logger.info(f"Wrote profiler trace {out / f'rank{rank}_trace.json'}")

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=wait, warmup=p.profiler_warmup, active=p.profiler_active)
    profiler = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=write_trace)
    # A resumed run keeps its traces on the profile_freq grid (iteration_10, 20, ...). Set before
    # entering, which acts on the first step's action: set after, a resume right before a traced
    # step lost that trace.
    profiler.step_num = first_step
    profiler.current_action = schedule(first_step)
    with profiler:
        yield _CountingProfiler(profiler, step)


class _CountingProfiler:
    """Steps the torch profiler and keeps the training step for the trace folder's name."""

    def __init__(self, profiler, step: dict):
        self.profiler, self.step_box = profiler, step

    def step(self) -> None:
        self.step_box["value"] += 1
        self.profiler.step()


class MemorySnapshotter:
    """Records the CUDA allocator's history and dumps snapshots (`enable_memory_snapshot`)."""

    def __init__(self, job_config: JobConfig, rank: int, device: torch.device):
        p = job_config.profiling
        self.enabled = p.enable_memory_snapshot
        if not self.enabled:
            return
        if device.type != "cuda":
            raise ConfigError(
                "'profiling.enable_memory_snapshot' = true records the CUDA caching allocator, but this "
                f"run is on {device.type}; remove the key."
            )
        self.folder = Path(job_config.job.dump_folder) / p.save_memory_snapshot_folder
        self.freq, self.rank = p.profile_freq, rank
        # Python frames only: symbolizing C++ frames (addr2line) can take minutes per snapshot.
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=MEMORY_HISTORY_ENTRIES)

    def after_step(self, step: int) -> None:
        if self.enabled and step % self.freq == 0:
            self.dump(f"iteration_{step}")

    def dump(self, name: str) -> None:
        out = self.folder / name
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"rank{self.rank}_memory_snapshot.pickle", "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        logger.info(f"Wrote CUDA memory snapshot {out}")

    def on_oom(self) -> None:
        if self.enabled:
            self.dump("oom")
