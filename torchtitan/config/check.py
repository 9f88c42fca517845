"""Check a training config without training: `python -m torchtitan.config.check [ARGS]`.

Takes the trainer's arguments and environment (`--config`, `$CONFIG_FILE`, `--section.key
value`), parses and validates them in this one process, and exits 2 with the message on a
mistake, 0 otherwise. Launchers run it before torchrun: there every rank would hit the same
mistake and torchrun would report it as a ChildFailedError traceback with exit code 1. It
imports no torch, so it costs a fraction of a second.

`--errors-only`, given first, hides the config's warnings (an upstream key that is renamed or
ignored): launchers pass it because rank 0 logs the same warnings when training starts.
"""

import logging
import sys

from torchtitan.config.manager import ConfigError, parse_args, wants_help


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    errors_only = argv[:1] == ["--errors-only"]
    if errors_only:
        argv = argv[1:]
    if wants_help(argv):
        return 0  # the trainer prints the help
    config_logger = logging.getLogger("torchtitan")
    level = config_logger.level
    if errors_only:
        config_logger.setLevel(logging.ERROR)
    try:
        parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        config_logger.setLevel(level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
