"""One logger format for the whole package."""

import logging
import os

logger = logging.getLogger("torchtitan")


def init_logger() -> None:
    """Log INFO to stderr as `[titan] time - level - message`, once per process."""
    root = logging.getLogger()
    if any(getattr(h, "_titan", False) for h in root.handlers):
        return
    handler = logging.StreamHandler()
    rank = os.environ.get("RANK")
    prefix = (
        f"[titan rank{rank}]" if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else "[titan]"
    )
    handler.setFormatter(logging.Formatter(f"{prefix} %(asctime)s - %(levelname)s - %(message)s"))
    handler._titan = True
    root.addHandler(handler)
    root.setLevel(logging.INFO)
