"""torchrun, as the launch scripts run it, ending a run that stopped on purpose with its own exit code.

    python -m torchtitan.launch [torchrun options] -m torchtitan.train [trainer arguments]

This is torchrun in this process (`torch.distributed.run`), with two differences. First, torchrun
reports any rank that exits non-zero as a failure: a ChildFailedError traceback and exit code 1.
When the ranks that failed exited on purpose (the others torn down by torchrun), that hides
what happened, so the launcher ends with the ranks' own code:

- exit 2: the rank met bad input it could only see there (a dataset path, a tokenizer file, a
  setting that needs the model). The rank has printed the one-paragraph message; this prints it
  again only when `--local-ranks-filter` hid that rank's output, and exits 2.
- exit 143: the rank stopped on the stop file or SIGTERM after saving a checkpoint; this exits
  143, so a job script can tell "resubmit to resume" from a crash.
- exit 3: the rank stopped so, but had trained steps with checkpointing off: nothing to resume.

Second, SIGTERM to the launcher is a graceful stop, however long a step takes. torchrun would
pass it on and kill the ranks 30 s later, mid-step; the launcher instead touches the stop file
(`$TORCHTITAN_STOP_FILE`, or one of its own that it hands to the ranks), so the ranks finish
their step, save and exit 143, as with the SLURM script's stop file. If they are still running
`$TORCHTITAN_STOP_DEADLINE_SECONDS` (default 900) after the SIGTERM, or a second SIGTERM comes,
the launcher kills them and exits 4 (`EXIT_KILLED_UNSAVED`), naming the step of the newest
checkpoint: nothing after it was saved.

Ctrl-C's SIGINT is passed on to the ranks by torchrun, as always; the launcher then exits 130
instead of torchrun's SignalException traceback and exit 1. Any other failure (a crash, a NaN)
is torchrun's, unchanged.
"""

import logging
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import parse_args, run

from torchtitan.components.stop import LAUNCHER_STOP_FILE_ENV, STOP_FILE_ENV
from torchtitan.tools.exit_codes import (
    EXIT_BAD_INPUT,
    EXIT_KILLED_UNSAVED,
    EXIT_STOPPED,
    EXIT_STOPPED_UNSAVED,
)

_ON_PURPOSE = (EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_STOPPED_UNSAVED)
TORCHRUN_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")  # --nproc_per_node's words besides counts
# How torchrun ends the other ranks once one has exited: SIGTERM, then SIGKILL after a grace time.
_TEARDOWN = {-signal.SIGTERM, -signal.SIGKILL}


class _HideFailuresOnPurpose(logging.Filter):
    """Drops torchrun's "failed (exitcode: N) local_rank: ..." line for the codes above: the
    rank has said why, and the launcher ends with its code."""

    _LINE = re.compile(r"failed \(exitcode: (-?\d+)\)")

    def filter(self, record: logging.LogRecord) -> bool:
        match = self._LINE.match(record.getMessage())
        return not (match and int(match.group(1)) in _ON_PURPOSE)


def _output_shown(local_rank: int, local_ranks_filter: str) -> bool:
    """Whether torchrun showed this local rank's output (`--local-ranks-filter`, empty: all)."""
    return not local_ranks_filter or str(local_rank) in local_ranks_filter.split(",")


def closing_report(error: ChildFailedError, local_ranks_filter: str) -> tuple[int, str] | None:
    """(exit code, message to print) when the ranks that failed exited on purpose, else None.

    On purpose: every failure exited with one of the codes above, or was killed by the signal
    torchrun tears the other ranks down with once one has exited. The message is empty when
    the rank's own output already showed it."""
    codes = {failure.exitcode for failure in error.failures.values()}
    on_purpose = codes & set(_ON_PURPOSE)
    if len(on_purpose) != 1 or not codes - on_purpose <= _TEARDOWN:
        return None
    code = on_purpose.pop()
    rank = min(r for r, f in error.failures.items() if f.exitcode == code)
    failure = error.failures[rank]
    if code != EXIT_BAD_INPUT or _output_shown(failure.local_rank, local_ranks_filter):
        return code, ""
    return code, f"rank {rank}: {_message(failure)}"


def _message(failure: ProcessFailure) -> str:
    message = failure.message
    return message.get("message", str(message)) if isinstance(message, dict) else str(message)


def ranks_filter_problem(local_ranks_filter: str, nproc_per_node: str) -> str | None:
    """Why `--local-ranks-filter` (run_train.sh's LOG_RANK) would hide output it means to show:
    a rank that is not a local rank of this launch. None when it is fine."""
    if not local_ranks_filter or not nproc_per_node.isdecimal():
        return None
    wanted = local_ranks_filter.split(",")
    missing = [r for r in wanted if not r.isdecimal() or int(r) >= int(nproc_per_node)]
    if not missing:
        return None
    return (
        f"LOG_RANK (--local-ranks-filter) = '{local_ranks_filter}' names {', '.join(missing)}, not a "
        f"local rank of the {nproc_per_node} processes per node (0 to {int(nproc_per_node) - 1}); "
        "its output would never be shown. Give local ranks in that range, comma-separated."
    )


def nproc_problem(nproc_per_node: str) -> str | None:
    """Why `--nproc_per_node` (run_train.sh's NGPU) is no process count torchrun takes (it
    ends such a value with a traceback); None when it is fine."""
    if nproc_per_node in TORCHRUN_NPROC_WORDS or (nproc_per_node.isdecimal() and int(nproc_per_node) > 0):
        return None
    return (
        f"NGPU (--nproc_per_node) = '{nproc_per_node}' is no number of processes per node; give a "
        f"positive whole number (or one of {', '.join(TORCHRUN_NPROC_WORDS)})."
    )


STOP_DEADLINE_ENV = "TORCHTITAN_STOP_DEADLINE_SECONDS"
DEFAULT_STOP_DEADLINE_SECONDS = 900


def stop_deadline_seconds(environ=os.environ) -> int:
    """`$TORCHTITAN_STOP_DEADLINE_SECONDS`, or the default.

    Raises:
        ValueError: naming the variable, when it is no positive whole number.
    """
    text = environ.get(STOP_DEADLINE_ENV, str(DEFAULT_STOP_DEADLINE_SECONDS))
    if not (text.isdecimal() and int(text) > 0):
        raise ValueError(
            f"${STOP_DEADLINE_ENV} = '{text}' is no number of seconds; give a positive whole number "
            f"(default {DEFAULT_STOP_DEADLINE_SECONDS})."
        )
    return int(text)


class GracefulStop:
    """The launcher's SIGTERM handling (see the module's docstring).

    Args:
        stop_file: the file the ranks watch between steps.
        deadline_seconds: how long the ranks have, after the SIGTERM, to save and exit.

    Pitfall: install it in the main thread, and keep SIGTERM out of torchrun's own handlers
    (`--signals_to_handle`), which would replace it.
    """

    def __init__(self, stop_file: Path, deadline_seconds: int):
        self.stop_file, self.deadline_seconds = stop_file, deadline_seconds
        self.requested = False
        self.killed = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGALRM, self._on_deadline)

    def _on_sigterm(self, signum, frame) -> None:
        if self.requested:
            self._kill("a second SIGTERM came")
        self.requested = True
        self.stop_file.parent.mkdir(parents=True, exist_ok=True)
        self.stop_file.touch()
        signal.alarm(self.deadline_seconds)
        _say(
            f"SIGTERM: the ranks stop after their current step and save (stop file {self.stop_file}); "
            f"still running in {self.deadline_seconds}s (${STOP_DEADLINE_ENV}), or at a second "
            "SIGTERM, they are killed"
        )

    def _on_deadline(self, signum, frame) -> None:
        self._kill(f"the ranks were still running {self.deadline_seconds}s after SIGTERM")

    def _kill(self, why: str):
        """Raise into torchrun's agent, which kills the ranks (SIGKILL) and raises it on."""
        self.killed = True
        _say(f"{why}: killing the ranks")
        raise SignalException(why, sigval=signal.SIGKILL)


def _say(line: str) -> None:
    print(f"torchtitan.launch: {line}", file=sys.stderr, flush=True)


def unsaved_since(trainer_argv: list[str]) -> str:
    """What a killed run lost, for the launcher's last line: the step of the newest checkpoint
    in the run's checkpoint folder."""
    from torchtitan.components.checkpoint_folders import resumable_steps
    from torchtitan.config.errors import ConfigError
    from torchtitan.config.manager import parse_args as parse_trainer_args

    try:
        config = parse_trainer_args(trainer_argv)
    except ConfigError:
        return "nothing was saved on the way out"
    if not config.checkpoint.enable:
        return "nothing was saved (checkpoint.enable = false)"
    folder = Path(config.job.dump_folder) / config.checkpoint.folder
    try:
        steps = resumable_steps(folder)
    except ConfigError:
        steps = []
    if not steps:
        return f"nothing was saved: {folder} holds no checkpoint, and the same command starts over"
    return (
        f"nothing was saved since step {steps[-1]}, the newest checkpoint in {folder}, where a resume starts"
    )


def _own_stop_file() -> Path | None:
    """Hand the ranks a stop file of the launcher's own, unless `$TORCHTITAN_STOP_FILE` names
    one; returns the folder made for it (None when the caller's is used)."""
    if os.environ.get(STOP_FILE_ENV):
        return None
    folder = Path(tempfile.mkdtemp(prefix="torchtitan-stop-"))
    os.environ[STOP_FILE_ENV] = str(folder / "stop")
    os.environ[LAUNCHER_STOP_FILE_ENV] = "1"
    return folder


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with `argv` (default: the command line); returns the exit code."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    nproc = str(args.nproc_per_node)
    try:
        deadline = stop_deadline_seconds()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if problem := nproc_problem(nproc) or ranks_filter_problem(args.local_ranks_filter or "", nproc):
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_HideFailuresOnPurpose())
    own_stop_folder = _own_stop_file()
    stop = GracefulStop(Path(os.environ[STOP_FILE_ENV]), deadline)
    if hasattr(args, "signals_to_handle"):  # torch >= 2.9; before it, torchrun's handler wins
        args.signals_to_handle = ",".join(
            s for s in args.signals_to_handle.split(",") if s.strip() != "SIGTERM"
        )
        stop.install()
    try:
        run(args)
    except SignalException as error:
        if stop.killed:
            _say(unsaved_since(args.training_script_args))
            return EXIT_KILLED_UNSAVED
        # torchrun has passed the signal on and the ranks have stopped; its traceback would say
        # nothing more.
        _say(f"stopped by {error.sigval.name}")
        return 128 + error.sigval
    except ChildFailedError as error:
        report = closing_report(error, args.local_ranks_filter or "")
        if report is None:
            raise
        code, message = report
        if message:
            print(message, file=sys.stderr)
        if stop.requested and code == EXIT_STOPPED:
            _say("stopped by SIGTERM; the ranks saved what they had trained")
        return code
    finally:
        signal.alarm(0)
        if own_stop_folder is not None:
            shutil.rmtree(own_stop_folder, ignore_errors=True)
    if stop.requested:
        _say("the ranks finished training before they saw the stop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
