"""Writing a folder so that a failure never leaves it half-written."""

import contextlib
import shutil
from pathlib import Path


def check_new_folder(out: str | Path) -> Path:
    """`out` as a Path, refused if it is a file or a folder that is not empty.

    Raises:
        FileExistsError: naming `out` and what to do.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output folder '{out}' is a file; choose a new folder")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output folder '{out}' is not empty; choose a new one")
    return out


@contextlib.contextmanager
def written_whole(out: str | Path):
    """Yield `<out>.partial`, a fresh sibling folder to write into; it becomes `out` when the
    block ends, and is removed when the block raises, so `out` appears complete or not at all.

    Pitfall: `out` must not exist or be empty (`check_new_folder`).
    """
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()
    partial.rename(out)
