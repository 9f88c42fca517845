"""Tokenize a local dataset once into a memory-mapped token file, shared by every rank and run.

The file is keyed by the dataset files (path, size, modification time), the tokenizer's
fingerprint and its BOS/EOS ids, so editing any of them makes a new cache. Writes go to a
temporary file renamed into place, so concurrent ranks and crashed runs never leave a partial
cache behind (the next build deletes a killed build's temporary file). An exclusive lock on
`<cache>.lock` makes the processes sharing a cache folder (the ranks of a node, or of a job on a
shared filesystem) tokenize once: the first builds while the others wait for its file.
"""

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import secrets
from pathlib import Path

import numpy as np

from torchtitan.config.errors import ConfigError

logger = logging.getLogger(__name__)

TOKEN_DTYPE = np.uint32
_DOCS_PER_BATCH = 1024
# Bump when the same files and tokenizer would tokenize differently (how documents are read or
# wrapped), so caches written by older code are not reused.
# 2: a .txt file is one document, no longer one per line; 3: special-token text is text;
# 4: local files are read directly, so no cache holds text from datasets' stale Arrow copy.
CACHE_FORMAT = 4


def cache_dir() -> Path:
    """`$TORCHTITAN_CACHE_DIR`, else ~/.cache/torchtitan/tokens."""
    default = Path.home() / ".cache" / "torchtitan" / "tokens"
    return Path(os.environ.get("TORCHTITAN_CACHE_DIR", default))


def cache_key(files: list[Path], tokenizer) -> str:
    """A hex key that changes when any file, the tokenizer or the cache format changes.

    A file counts as changed when its size, modification time, or first or last MiB does: the
    bytes catch a same-size rewrite whose time was carried over (`cp -p`, `rsync -t`) wherever
    it touches either end; a change confined to the middle of such a rewrite is not seen.
    """
    # BOS/EOS come from tokenizer_config.json, which the tokenizer.json fingerprint misses.
    h = hashlib.sha256(
        f"{CACHE_FORMAT}|{tokenizer.fingerprint}|{tokenizer.bos_id}|{tokenizer.eos_id}".encode()
    )
    for f in sorted(files):
        stat = f.stat()
        h.update(f"{f.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
        h.update(_ends(f, stat.st_size))
    return h.hexdigest()[:24]


def _ends(path: Path, size: int, span: int = 2**20) -> bytes:
    """The first and last `span` bytes of the file (all of it when shorter than two spans)."""
    with open(path, "rb") as f:
        head = f.read(span)
        if size <= 2 * span:
            return head + f.read()
        f.seek(size - span)
        return head + f.read(span)


def _write_tokens(path: Path, documents, tokenizer) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(8)}.tmp")
    # Not mkstemp: its 0600 would make a shared TORCHTITAN_CACHE_DIR unreadable to other users.
    # Mode 0666 here gets the umask applied by the kernel, as any file the user creates does.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as out:
            batch = []
            for text in documents:
                batch.append(text)
                if len(batch) == _DOCS_PER_BATCH:
                    _flush(out, batch, tokenizer)
                    batch = []
            _flush(out, batch, tokenizer)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _flush(out, texts: list[str], tokenizer) -> None:
    if texts:
        ids = [t for doc in tokenizer.encode_batch(texts, bos=True, eos=True) for t in doc]
        np.asarray(ids, dtype=TOKEN_DTYPE).tofile(out)


def load_or_build(files: list[Path], tokenizer, read_documents) -> np.memmap:
    """The token stream of `files` as a read-only memmap, tokenizing on first use.

    Args:
        files: the dataset's files (they key the cache).
        tokenizer: has `fingerprint`, `bos_id`, `eos_id` and `encode_batch(texts, bos, eos)`.
        read_documents: zero-argument callable yielding document strings in order; called
            only when the cache is missing.

    Pitfall: a filesystem without `flock` (some network mounts) gets no lock; each process
    then tokenizes on its own, which is slower but still correct.
    """
    path = cache_dir() / f"{cache_key(files, tokenizer)}.bin"
    try:
        if not path.exists():
            with _build_lock(path) as locked:
                if not path.exists():
                    if locked:  # without the lock, another live build may be writing its file
                        _remove_orphans(path)
                    _write_tokens(path, read_documents(), tokenizer)
        if path.stat().st_size == 0:  # documents without text, by a tokenizer adding no BOS/EOS
            return np.zeros(0, dtype=TOKEN_DTYPE)  # the caller's "too few tokens" names the key
        return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
    except OSError as error:  # reading the data files raises ConfigError, so this is the cache
        raise ConfigError(
            f"the token cache '{path}' cannot be written or read ({error.strerror or error}). Set "
            "$TORCHTITAN_CACHE_DIR to a writable folder with room for the tokens (4 bytes each)."
        ) from None


def _remove_orphans(path: Path) -> None:
    """Delete the temporary files of builds of `path` whose process was killed (SIGKILL, or a
    crash) before it could: the caller holds the build lock, so no live build writes one."""
    for orphan in path.parent.glob(f"{path.name}.*.tmp"):
        logger.warning(f"Removing {orphan}, left by a tokenization that was killed")
        orphan.unlink(missing_ok=True)


@contextlib.contextmanager
def _build_lock(path: Path):
    """Hold an exclusive flock on `<path>.lock` while inside, yielding whether it is held (not
    where the filesystem has no flock); the kernel drops it if the holder dies. The lock file
    stays: removing it would let a late process lock a new file while another still holds the
    old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        yield _lock_exclusive(fd, path)
    finally:
        os.close(fd)


def _lock_exclusive(fd: int, path: Path) -> bool:
    """Block until `fd` is locked and return True; False where the filesystem has no flock."""
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info(f"Waiting for another process to finish tokenizing into {path}")
            fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        return False
    return True
