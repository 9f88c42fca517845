"""Check a training config without training: `python -m torchtitan.config.check [ARGS]`.

Takes the trainer's arguments and environment (`--config`, `$CONFIG_FILE`, `--section.key
value`), parses and validates them in this one process, and exits 2 with the message on a
mistake, 0 otherwise. Launchers run it before torchrun: there every rank would hit the same
mistake and torchrun would report it as a ChildFailedError traceback with exit code 1. It
imports no torch, so it costs a fraction of a second (unless a `job.custom_config_module`
does: the check imports that module, as every rank will, to learn its keys).

`--errors-only`, given first, hides the config's warnings (an upstream key that is renamed or
ignored) and the closing "config OK" line: launchers pass it because rank 0 logs the same
warnings when training starts. `--help` lists the trainer's arguments.
"""

import logging
import sys

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import format_help, parse_args, wants_help

USAGE = "usage: python -m torchtitan.config.check [--errors-only] [the trainer's arguments]"


def checked_config(argv: list[str], errors_only: bool) -> JobConfig:
    """The config of the trainer's arguments `argv`; with `errors_only`, its warnings hidden.

    Raises:
        ConfigError: the first mistake, as the trainer would raise it.
    """
    config_logger = logging.getLogger("torchtitan")
    level = config_logger.level
    if errors_only:
        config_logger.setLevel(logging.ERROR)
    try:
        return parse_args(argv)
    finally:
        config_logger.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    errors_only = argv[:1] == ["--errors-only"]
    if errors_only:
        argv = argv[1:]
    if wants_help(argv):
        if not errors_only:  # run by hand; a launcher leaves the help to the trainer it starts
            try:
                print(USAGE + "\n\nThe trainer's arguments:\n\n" + format_help(argv))
            except ConfigError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        return 0
    try:
        config = checked_config(argv, errors_only)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not errors_only:
        m = config.model
        print(f"config OK: {m.name} {m.flavor}, {config.training.steps} steps", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
