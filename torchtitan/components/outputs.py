"""The files and folders a run writes into, checked before training starts.

A folder that cannot be written would otherwise be found out where it is first written: the
checkpoint folder at the first save, `checkpoint.interval` steps in, with a traceback. Each is
tried here at startup by writing a probe file, which also finds a read-only file system, which
permission bits alone do not show.
"""

import os
from pathlib import Path

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig


def run_outputs(config: JobConfig, rank: int, is_metrics_writer: bool) -> list[tuple[str, Path, bool]]:
    """(config key, path, is_file) of each output this rank of a run writes into."""
    dump = Path(config.job.dump_folder)
    outputs = []
    c, m, p = config.checkpoint, config.metrics, config.profiling
    if c.enable and not c.load_only:
        outputs.append(("checkpoint.folder", dump / c.folder, False))
    if is_metrics_writer or m.save_for_all_ranks:
        suffix = f"_rank{rank}" if m.save_for_all_ranks else ""
        outputs.append(("job.dump_folder", dump / f"metrics{suffix}.jsonl", True))
        if m.enable_tensorboard:
            outputs.append(("metrics.save_tb_folder", dump / m.save_tb_folder, False))
    if p.enable_profiling:
        outputs.append(("profiling.save_traces_folder", dump / p.save_traces_folder, False))
    if p.enable_memory_snapshot:
        outputs.append(("profiling.save_memory_snapshot_folder", dump / p.save_memory_snapshot_folder, False))
    return outputs


def check_writable(key: str, path: Path, is_file: bool, rank: int) -> None:
    """Write and delete a probe file where `path` (a folder, or the file `is_file`) would be
    created or written: in the folder itself when it exists, else in its nearest existing
    parent. Creates nothing that stays.

    Raises:
        ConfigError: naming `key`, the path, the reason and the fix.
    """
    if is_file and path.is_dir():
        raise ConfigError(
            f"{path} is a folder, where the run writes its file (under '{key}'); move the folder "
            "away, or choose another job.dump_folder."
        )
    folder = path.parent if is_file else path
    # os.path.exists: Path.exists raises where a parent cannot be entered.
    existing = next(p for p in (folder, *folder.parents) if os.path.exists(p))
    if not existing.is_dir():
        raise ConfigError(
            f"{existing} is a file, where the run needs a folder for {path} (under '{key}'); move "
            f"it away, or point '{key}' elsewhere."
        )
    probe = existing / f".write-check-rank{rank}-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
        if is_file and path.exists():
            with open(path, "a"):
                pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        where = "" if existing == folder else f" (its folder {existing} is where it would be created)"
        raise ConfigError(
            f"{path} cannot be written{where}: {reason}; the run writes there (under '{key}'). Make it "
            f"writable for this user, or point '{key}' elsewhere."
        ) from None


def check_run_outputs(config: JobConfig, rank: int, is_metrics_writer: bool) -> None:
    """`check_writable` for every output of `run_outputs`.

    Raises:
        ConfigError: for the first output that cannot be written.
    """
    for key, path, is_file in run_outputs(config, rank, is_metrics_writer):
        check_writable(key, path, is_file, rank)
