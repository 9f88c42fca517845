"""Checksums of a DCP checkpoint's files, written at save and verified before a load.

A damaged shard (a bad disk block, a copy cut short then padded, a stray write) loads without
any error from DCP: its tensors are just wrong, and the run goes NaN some steps later, far from
the cause. So every save also writes small manifests beside `.metadata`:

    .checksums-<rank>.json     the xxh3-128 digest and size of each file that rank wrote
    .checksums-metadata.json   the digest of `.metadata`, and every shard file the checkpoint has

A rank hashes its own files right after writing them, inside DCP's write step: under an async
save that is DCP's background thread, not the training thread, and the files are still in the
page cache. A load verifies the whole folder first, each rank a share of the files.

Pitfall: a folder without manifests (written before checksums existed, or by another tool) is
loaded unverified, with a log line saying so.
"""

import json
import logging
import time
from pathlib import Path

import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.futures import Future

from torchtitan.components.checkpoint_folders import RESUME_KEY, complete_steps, step_folder, step_of
from torchtitan.config.errors import ConfigError
from torchtitan.distributed.rank_agreement import agree_on_config_errors

logger = logging.getLogger(__name__)

ALGORITHM = "xxh3_128"
MANIFEST_PREFIX = ".checksums-"
METADATA_MANIFEST = f"{MANIFEST_PREFIX}metadata.json"
_READ_BYTES = 16 << 20  # hashing reads in blocks of this size, so memory stays flat


def file_digest(path: Path) -> str:
    """The xxh3-128 digest of the file at `path`, as hex."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(_READ_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _entry(path: Path) -> dict:
    return {"size": path.stat().st_size, ALGORITHM: file_digest(path)}


def _write_manifest(path: Path, files: dict[str, dict], **extra) -> None:
    path.write_text(json.dumps({"algorithm": ALGORITHM, "files": files, **extra}, indent=1, sort_keys=True))


class ChecksummedWriter(FileSystemWriter):
    """DCP's `FileSystemWriter`, which also writes the manifests described in this module.

    Args: those of `FileSystemWriter`; pass it to `dcp.save` or `dcp.async_save` as
    `storage_writer`.
    """

    def write_data(self, plan, planner) -> Future:
        written = super().write_data(plan, planner).wait()
        # Every file this rank created, empty ones included: they all start with its prefix.
        prefix = plan.storage_data.prefix
        own = sorted(Path(self.path).glob(f"{prefix}*.distcp"))
        rank = self.rank if self.rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        _write_manifest(Path(self.path) / f"{MANIFEST_PREFIX}{rank}.json", {p.name: _entry(p) for p in own})
        done = Future()
        done.set_result(written)
        return done

    def finish(self, metadata: Metadata, results) -> None:
        super().finish(metadata, results)
        folder = Path(self.path)
        shards = sorted({r.storage_data.relative_path for rank_results in results for r in rank_results})
        _write_manifest(
            folder / METADATA_MANIFEST, {".metadata": _entry(folder / ".metadata")}, shards=shards
        )


def has_checksums(folder: Path) -> bool:
    return (folder / METADATA_MANIFEST).is_file()


def expected_digests(folder: Path) -> dict[str, dict]:
    """{file name: {"size", digest}} for every file the manifests of `folder` cover.

    Raises:
        ConfigError: a manifest is unreadable, or a shard the checkpoint has is in no manifest
            (a rank's manifest is missing).
    """
    try:
        top = json.loads((folder / METADATA_MANIFEST).read_text())
        expected = dict(top["files"])
        for manifest in sorted(folder.glob(f"{MANIFEST_PREFIX}*.json")):
            if manifest.name != METADATA_MANIFEST:
                expected.update(json.loads(manifest.read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ChecksumError(
            folder, f"its checksum manifests cannot be read ({type(error).__name__})"
        ) from None
    unlisted = [name for name in top.get("shards", []) if name not in expected]
    if unlisted:
        raise ChecksumError(
            folder, f"{unlisted[0]} has no checksum (a rank's {MANIFEST_PREFIX}<rank>.json is missing)"
        )
    return expected


def first_mismatch(folder: Path, expected: dict[str, dict]) -> str | None:
    """What is wrong with the first file in `expected` whose size or digest differs on disk;
    None when all match."""
    for name, want in expected.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["size"]:
            return f"{name} has {path.stat().st_size} bytes, {want['size']} when saved"
        if file_digest(path) != want[ALGORITHM]:
            return f"{name} does not match its checksum: its bytes changed after the save"
    return None


class ChecksumError(ConfigError):
    """A checkpoint whose files do not match the checksums written with it."""

    def __init__(self, folder: Path, problem: str):
        self.folder, self.problem = folder, problem
        super().__init__(f"checkpoint {folder}: {problem}")


def verify_share(folder: Path, rank: int, world_size: int) -> None:
    """Check this rank's share of `folder`'s files (every `world_size`-th, from `rank`).

    Raises:
        ChecksumError: naming the first file that differs.
    """
    expected = expected_digests(folder)
    share = dict(sorted(expected.items())[rank::world_size])
    if problem := first_mismatch(folder, share):
        raise ChecksumError(folder, problem)


def is_intact(folder: Path) -> bool:
    """Whether every file of `folder` matches its checksum (True when it has none)."""
    if not has_checksums(folder):
        return True
    try:
        return first_mismatch(folder, expected_digests(folder)) is None
    except ChecksumError:
        return False


def verify_before_load(folder: Path, key: str) -> None:
    """Check every file of the checkpoint in `folder` against the checksums its save wrote, each
    rank a share, before anything is loaded (`checkpoint.verify_checksums`). A checkpoint
    written without checksums loads unverified. Collective: every rank calls it.

    Args:
        key: the setting the checkpoint was named by (`RESUME_KEY` for a resume), for messages.

    Raises:
        ConfigError: on every rank, naming the damaged file, the step and, for a resume, the
            newest intact step to load instead.
    """
    if not has_checksums(folder):
        logger.info(f"Checkpoint {folder} has no checksums (written without them): loading it unverified")
        return
    start = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    agree_on_config_errors(lambda: _verify_share(folder, key, rank, world))
    logger.info(f"Checked the checksums of {folder} in {time.perf_counter() - start:.1f}s")


def _verify_share(folder: Path, key: str, rank: int, world: int) -> None:
    try:
        verify_share(folder, rank, world)
    except ChecksumError as error:
        raise ConfigError(f"{error} {_damaged_checkpoint_fix(folder, key)}") from None


def _damaged_checkpoint_fix(folder: Path, key: str) -> str:
    """What to do about the damaged checkpoint in `folder`: for a resume, the newest older step
    whose files all match their checksums."""
    if key != RESUME_KEY:
        return f"Point {key} at another checkpoint."
    older = [s for s in complete_steps(folder.parent) if s < step_of(folder)]
    intact = next((s for s in reversed(older) if is_intact(step_folder(folder.parent, s))), None)
    if intact is None:
        return (
            f"No older checkpoint in {folder.parent} is intact: move {folder.name} aside to start "
            "over, or set checkpoint.verify_checksums = false to load it anyway."
        )
    return (
        f"The newest intact checkpoint is step {intact}: resume from it with checkpoint.load_step = "
        f"{intact}, or move {folder.name} aside; checkpoint.verify_checksums = false loads it anyway."
    )
