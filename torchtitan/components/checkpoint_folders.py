"""The checkpoint folder's layout on disk: which `step-N` folders are complete, resumable or
Hugging Face exports, how a finished save replaces one and old ones are pruned, and reading a
checkpoint's metadata and state with an error that says what to do when it is damaged.

A save writes `step-N.partial` and renames it to `step-N` once every rank is done, so a complete
checkpoint is a `step-N` folder holding DCP's `.metadata` (which DCP writes last). Folders with
any other suffix (`.partial`, `.superseded`, `.incomplete`, `.unreadable`, `.deleting-*`) are
never resumed from. A `step-N` folder without `.metadata` (a save copied or damaged by hand) is
never deleted: it is renamed `step-N.incomplete` and kept for a person to look at.
"""

import logging
import pickle
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from torchtitan.config.errors import ConfigError

logger = logging.getLogger(__name__)

STEP_FOLDER = re.compile(r"^step-(\d+)$")
HF_EXPORT_FOLDER = re.compile(r"^step-(\d+)-hf$")  # last_save_in_hf's final export
PARTIAL_SUFFIX = ".partial"
SUPERSEDED_SUFFIX = ".superseded"
DELETING_SUFFIX = ".deleting"  # `step-N.deleting-<ns>`: set aside for a background thread to delete
INCOMPLETE_SUFFIX = ".incomplete"  # a `step-N` without `.metadata`, kept, never deleted
UNREADABLE_SUFFIX = ".unreadable"  # a `step-N` whose `.metadata` pruning could not read, kept
RESUME_KEY = "checkpoint.folder"  # the setting a resume reads from; others: initial_load_path


def step_folder(folder: Path, step: int, hf: bool = False) -> Path:
    """The checkpoint of `step` in `folder`: `step-N`, or `step-N-hf` for a Hugging Face export
    (the names `STEP_FOLDER` and `HF_EXPORT_FOLDER` parse)."""
    return folder / (f"step-{step}-hf" if hf else f"step-{step}")


def step_of(path: Path) -> int:
    """The step a `step-N` or `step-N-hf` folder holds."""
    match = STEP_FOLDER.match(path.name) or HF_EXPORT_FOLDER.match(path.name)
    if match is None:
        raise ValueError(f"{path} is not a step-N checkpoint folder")
    return int(match.group(1))


def complete_steps(folder: Path) -> list[int]:
    """Steps with a complete (visible) checkpoint in `folder`, ascending: `step-N` folders that
    hold DCP's metadata, which it writes last."""
    if not folder.is_dir():
        return []
    steps = [int(m.group(1)) for p in folder.iterdir() if (m := STEP_FOLDER.match(p.name)) and is_dcp(p)]
    return sorted(steps)


def is_dcp(folder: Path) -> bool:
    return (folder / ".metadata").is_file()


def replace_folder(final: Path, new: Path) -> list[Path]:
    """Rename `new` to `final`. A folder already there is renamed aside first (`set_aside`) and
    returned for the caller to delete: deleting it in place (minutes for a large checkpoint)
    would leave no `final` at all until the rename, which a kill in between made permanent.
    A `step-N` there without `.metadata` is kept instead (`keep_aside`), never deleted."""
    old = []
    if final.exists() and STEP_FOLDER.match(final.name) and not is_dcp(final):
        keep_aside(final, INCOMPLETE_SUFFIX, "it has no .metadata")
    elif final.exists():
        old = [set_aside(final)]
    new.rename(final)
    return old


def keep_aside(path: Path, suffix: str, reason: str) -> Path:
    """Rename `path` to `<name><suffix>` (with a number if that is taken), never to be read or
    deleted by the trainer, and warn with `reason`; returns the new path."""
    kept = path.with_name(path.name + suffix)
    if kept.exists():
        kept = path.with_name(f"{path.name}{suffix}-{time.time_ns()}")
    path.rename(kept)
    logger.warning(
        f"Checkpoint {path} (step {step_of(path)}) is not usable: {reason}. Renamed it {kept.name}, "
        "which no run reads or deletes: look at it, then delete it or rename it back"
    )
    return kept


def incomplete_steps(folder: Path) -> list[int]:
    """Steps of `step-N` folders in `folder` that lack DCP's `.metadata`, ascending: never a
    finished save (saves become `step-N` only when whole), but a copy cut short or a damaged one."""
    if not folder.is_dir():
        return []
    return sorted(
        int(m.group(1))
        for p in folder.iterdir()
        if (m := STEP_FOLDER.match(p.name)) and p.is_dir() and not is_dcp(p)
    )


def keep_incomplete_aside(folder: Path) -> list[int]:
    """`keep_aside` every incomplete `step-N` folder in `folder` (see `incomplete_steps`);
    returns their steps. Rank 0 only, before choosing the step to resume: left in place, the
    next save of that step would replace (delete) it."""
    steps = incomplete_steps(folder)
    for step in steps:
        keep_aside(
            step_folder(folder, step), INCOMPLETE_SUFFIX, "it has no .metadata, which a save writes last"
        )
    return steps


# What reading a damaged DCP checkpoint raises: a shard missing or truncated, metadata emptied.
UNREADABLE_CHECKPOINT = (OSError, EOFError, pickle.UnpicklingError, dcp.api.CheckpointException)


def unreadable_checkpoint_error(folder: Path, error: Exception, key: str = RESUME_KEY) -> ConfigError:
    """The error for a complete-looking checkpoint that cannot be read, naming what to do; `key`
    is the setting that chose `folder`."""
    detail = f"{type(error).__name__}: {error}"
    if isinstance(error, dcp.api.CheckpointException) and error.failures:
        rank, (cause, _) = min(error.failures.items())
        detail = f"rank {rank}: {type(cause).__name__}: {cause}"
    detail = detail.strip().splitlines()[0]
    if key == RESUME_KEY:
        earlier = [s for s in complete_steps(folder.parent) if step_folder(folder.parent, s) != folder]
        instead = f" (complete: {', '.join(map(str, earlier))})" if earlier else ""
        fix = f"Resume from an earlier step with checkpoint.load_step{instead}, or move the folder aside."
    else:
        fix = f"Point {key} at another checkpoint."
    return ConfigError(
        f"checkpoint {folder} cannot be read ({detail}; a shard file missing or truncated?). {fix}"
    )


def read_metadata(folder: Path, key: str = RESUME_KEY) -> Metadata:
    """DCP's metadata of the checkpoint in `folder`.

    Raises:
        ConfigError: the metadata cannot be read (see `unreadable_checkpoint_error`).
    """
    try:
        return dcp.FileSystemReader(str(folder)).read_metadata()
    except UNREADABLE_CHECKPOINT as error:
        raise unreadable_checkpoint_error(folder, error, key) from None


def load_from(folder: Path, state: dict, key: str = RESUME_KEY, **load_kwargs) -> None:
    """`dcp.load` of `state` from the checkpoint in `folder`, in place.

    Raises:
        ConfigError: a shard or the metadata cannot be read (see `unreadable_checkpoint_error`).
    """
    try:
        dcp.load(state, checkpoint_id=str(folder), **load_kwargs)
    except UNREADABLE_CHECKPOINT as error:
        raise unreadable_checkpoint_error(folder, error, key) from None


def saved_keys(folder: Path, key: str = RESUME_KEY) -> set[str]:
    """The top-level state keys (model, optimizer, ...) a DCP checkpoint folder holds.

    Raises:
        ConfigError: when the folder's metadata cannot be read.
    """
    return {name.split(".")[0] for name in read_metadata(folder, key).state_dict_metadata}


def saved_shapes(folder: Path, state_key: str = "model", key: str = RESUME_KEY) -> dict[str, torch.Size]:
    """{FQN: shape} of the tensors the checkpoint in `folder` holds under `state_key`.

    Raises:
        ConfigError: when the folder's metadata cannot be read.
    """
    prefix = f"{state_key}."
    return {
        name.removeprefix(prefix): meta.size
        for name, meta in read_metadata(folder, key).state_dict_metadata.items()
        if name.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }


def hf_export_steps(folder: Path) -> list[int]:
    """Steps with a Hugging Face export (`step-N-hf`, model weights only) in `folder`, ascending."""
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := HF_EXPORT_FOLDER.match(p.name)))


def hf_export_named_by(path: Path) -> Path:
    """The Hugging Face export that `path` names: `path` itself when it holds safetensors (or
    names nothing else), else the `step-N-hf` export beside a `step-N` path.

    Why: upstream torchtitan names its final export `step-N`, so its users load it with
    `initial_load_path = <folder>/step-N`. Here the export keeps its `-hf` suffix, because in a
    checkpoint folder a `step-N` without DCP metadata is an interrupted save, set aside on resume.
    """
    match = STEP_FOLDER.match(path.name)
    if match is None or any(path.glob("*.safetensors")):
        return path
    export = step_folder(path.parent, int(match.group(1)), hf=True)
    return export if export.is_dir() else path


def resumable_steps(folder: Path) -> list[int]:
    """Complete checkpoints that hold a training state (not model-only exports), ascending."""
    return [s for s in complete_steps(folder) if "train_state" in saved_keys(step_folder(folder, s))]


def prune_checkpoints(folder: Path, keep: int) -> list[Path]:
    """Set aside all but the `keep` newest complete checkpoints (`keep <= 0` keeps all), and the
    saves a crash interrupted, for deletion.

    Each is renamed to a `.deleting` name, which no scan of the folder reads: quick, and a kill
    at any point leaves every checkpoint whole or invisible. Deleting them is the caller's
    (`delete_folders`): minutes for a large checkpoint on a parallel file system, which the
    trainer spends in a background thread rather than with the other ranks waiting.

    The newest resumable checkpoint always stays, even when `keep` newer model-only exports
    (`last_save_model_only`) would push it out: a run extended later resumes from it.

    Returns:
        The folders to delete: those set aside now, and any an earlier run left undeleted.
    """
    if keep <= 0:
        return []
    left_undeleted = list(folder.glob(f"*{DELETING_SUFFIX}-*"))
    steps = complete_steps(folder)
    readable = []
    for step in steps:
        try:
            keys = saved_keys(step_folder(folder, step))
        except ConfigError:
            # Not counted, and not deleted either: what is wrong with it is for a person to see.
            keep_aside(step_folder(folder, step), UNREADABLE_SUFFIX, "its .metadata cannot be read")
            continue
        readable.append((step, "train_state" in keys))
    resumable = [step for step, has_train_state in readable if has_train_state]
    steps = [step for step, _ in readable]
    kept = set(steps[-keep:]) | set(resumable[-1:])
    pruned = [step_folder(folder, step) for step in steps if step not in kept]
    return left_undeleted + [set_aside(path) for path in pruned + _abandoned_partials(folder, steps)]


def delete_folders(folders: list[Path]) -> None:
    for path in folders:
        shutil.rmtree(path, ignore_errors=True)


def set_aside(path: Path) -> Path:
    """Rename `path` to `<name>.deleting-<ns>`, which no scan of the folder reads, and return
    the new path: instant, where deleting it may take minutes."""
    aside = path.with_name(f"{path.name}{DELETING_SUFFIX}-{time.time_ns()}")
    path.rename(aside)
    return aside


class BackgroundFileWork:
    """Runs file work (deleting old checkpoints, pruning) in order on one daemon thread, so that
    neither rank 0 nor the ranks waiting for it in a collective spend minutes on it.

    `wait()` blocks until all submitted work is done (a run that ends normally waits). A process
    that exits without waiting (a stop, with little time left) drops the rest: the folders were
    renamed aside first, so what is left undeleted is never read and the next pruning deletes it.
    """

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, work: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="checkpoint-files", daemon=True)
            self._thread.start()
        self._queue.put(work)

    def delete(self, folders: list[Path]) -> None:
        if folders:
            self.submit(lambda: delete_folders(folders))

    def wait(self) -> None:
        self._queue.join()

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            try:
                work()
            except Exception as e:  # an old checkpoint left undeleted must not stop training
                logger.warning(f"Checkpoint folder work in the background failed: {type(e).__name__}: {e}")
            finally:
                self._queue.task_done()


def _abandoned_partials(folder: Path, steps: list[int]) -> list[Path]:
    """`step-N.partial` folders older than the newest complete checkpoint: saves that a crash
    interrupted (a save in flight is always of a newer step)."""
    abandoned = []
    for path in folder.glob(f"step-*{PARTIAL_SUFFIX}"):
        step = path.name.removesuffix(PARTIAL_SUFFIX).removeprefix("step-")
        if steps and step.isdecimal() and int(step) < steps[-1]:
            abandoned.append(path)
    return abandoned
