"""Resolve user paths: relative to the working directory first, then to the project."""

from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
PROJECT_ROOT = PACKAGE_ROOT.parent
BUNDLED_ASSETS = PACKAGE_ROOT / "assets"


def resolve_path(path: str) -> Path:
    """`path` if it exists as given; else the same relative path under the project root.

    So the shipped configs' `torchtitan/assets/...` paths work from any working directory
    and from an installed package. Returns the path as given when neither exists.
    """
    given = Path(path).expanduser()
    if given.exists() or given.is_absolute():
        return given
    candidate = PROJECT_ROOT / given
    return candidate if candidate.exists() else given
