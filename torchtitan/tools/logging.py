"""One logger format for the whole package."""

import logging
import os
import sys

logger = logging.getLogger("torchtitan")


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at emit time (it may be replaced after setup)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def init_logger() -> None:
    """Log INFO to stderr as `[titan] time - level - message`, once per process.

    Under a multi-process launch the prefix names the rank, so errors say where they came from.
    """
    root = logging.getLogger()
    if any(isinstance(h, _CurrentStderrHandler) for h in root.handlers):
        return
    handler = _CurrentStderrHandler()
    multi_process = os.environ.get("WORLD_SIZE", "1") != "1"
    prefix = f"[titan rank{os.environ.get('RANK', 0)}]" if multi_process else "[titan]"
    handler.setFormatter(logging.Formatter(f"{prefix} %(asctime)s - %(levelname)s - %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
