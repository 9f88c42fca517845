"""torchrun, as the launch scripts run it, ending a run that stopped on purpose with its own exit code.

    python -m torchtitan.launch [torchrun options] -m torchtitan.train [trainer arguments]

This is torchrun in this process (`torch.distributed.run`), with one difference. torchrun
reports any rank that exits non-zero as a failure: a ChildFailedError traceback and exit code 1.
When the ranks that failed exited on purpose (the others torn down by torchrun), that hides
what happened:

- exit 2: the rank met bad input it could only see there (a dataset path, a tokenizer file, a
  setting that needs the model). The rank has printed the one-paragraph message; this prints it
  again only when `--local-ranks-filter` hid that rank's output, and exits 2.
- exit 143: the rank stopped on the stop file or SIGTERM after saving a checkpoint; this exits
  143, so a job script can tell "resubmit to resume" from a crash.
- exit 3: the rank stopped so, but had trained steps with checkpointing off: nothing to resume.

A signal to the launcher itself (SIGTERM, or Ctrl-C's SIGINT) is passed on to the ranks by
torchrun, as always; the launcher then exits 128 + its number (143, 130) instead of torchrun's
SignalException traceback and exit 1. Any other failure (a crash, a NaN) is torchrun's, unchanged.
"""

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import parse_args, run

from torchtitan.tools.exit_codes import EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_STOPPED_UNSAVED

_ON_PURPOSE = (EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_STOPPED_UNSAVED)
TORCHRUN_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")  # --nproc_per_node's words besides counts
# How torchrun ends the other ranks once one has exited: SIGTERM, then SIGKILL after a grace time.
_TEARDOWN = {-signal.SIGTERM, -signal.SIGKILL}


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


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with `argv` (default: the command line); returns the exit code."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    nproc = str(args.nproc_per_node)
    if problem := nproc_problem(nproc) or ranks_filter_problem(args.local_ranks_filter or "", nproc):
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        run(args)
    except SignalException as error:
        # torchrun has passed the signal on and the ranks have stopped (after SIGTERM, with a
        # checkpoint saved); its traceback would say nothing more.
        print(f"torchtitan.launch: stopped by {error.sigval.name}", file=sys.stderr)
        return 128 + error.sigval
    except ChildFailedError as error:
        report = closing_report(error, args.local_ranks_filter or "")
        if report is None:
            raise
        code, message = report
        if message:
            print(message, file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
