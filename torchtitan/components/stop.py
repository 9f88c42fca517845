"""Stopping a run on request, between steps: SIGTERM to a rank, or the stop file.

The stop file (`$TORCHTITAN_STOP_FILE`) stops a run like SIGTERM does. `torchtitan.launch`
touches it when it gets SIGTERM, and the SLURM script shortly before the time limit: unlike a
signal passed on by torchrun, which kills its workers 30 s later, it gives the ranks all the
time a step and a save take.
"""

import datetime
import logging
import os
import signal

import torch
import torch.distributed as dist

from torchtitan.tools.exit_codes import EXIT_STOPPED, EXIT_STOPPED_UNSAVED

logger = logging.getLogger(__name__)

STOP_FILE_ENV = "TORCHTITAN_STOP_FILE"
LAUNCHER_STOP_FILE_ENV = "TORCHTITAN_STOP_FILE_IS_THE_LAUNCHERS"  # set by torchtitan.launch for its own


class StopRequested(Exception):
    """Raised between steps once the ranks agree to stop, so the run ends through the normal
    cleanup."""


class StopRequests:
    """Collects a request to stop and has the ranks agree on it between steps.

    Args:
        timeout_seconds: the timeout of the small gloo group the agreement runs on.

    Pitfall: `agreed` is collective; every rank calls it once before each step.
    """

    def __init__(self, timeout_seconds: int):
        self.requested = False
        self.reason = "another rank's request"
        self.stop_file = os.environ.get(STOP_FILE_ENV) or None
        self.stop_file_is_users = self.stop_file is not None and not os.environ.get(LAUNCHER_STOP_FILE_ENV)
        self.stale_mtime = self._stale_stop_file()
        self.group = None
        if dist.is_initialized():
            timeout = datetime.timedelta(seconds=timeout_seconds)
            self.group = dist.new_group(backend="gloo", timeout=timeout)

    def stop_between_steps_on_sigterm(self) -> None:
        """From now on, a SIGTERM to this rank is a request that stops the run after its step."""
        signal.signal(signal.SIGTERM, self.on_signal)

    def on_signal(self, signum, frame) -> None:
        """A signal handler (SIGTERM): stop after the current step."""
        logger.warning(f"Received signal {signum}: stopping after the current step")
        self.requested, self.reason = True, signal.Signals(signum).name

    def agreed(self) -> bool:
        """Whether to stop now. Every rank must stop at the same step, to save it and to exit with
        the same code (one stopping alone left the others waiting in the next step's collectives
        until they failed), so the ranks agree: one tiny all-reduce per step.

        The flag is a CPU tensor on a gloo group: on the accelerator, reading the result back
        would wait for the whole previous step to finish every step, stalling the host's run-ahead.
        """
        self.check_stop_file()
        if self.group is None:
            return self.requested
        flag = torch.tensor(float(self.requested))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def check_stop_file(self) -> None:
        if self.requested or not self._watches_stop_file():
            return
        mtime = self._stop_file_mtime()
        if mtime is not None and mtime != self.stale_mtime:
            logger.warning(f"Found the stop file {self.stop_file}: stopping after the current step")
            self.requested, self.reason = True, f"stop file {self.stop_file}"

    def _watches_stop_file(self) -> bool:
        # The first rank of each node looks (one stat per node and step): the launcher's own stop
        # file is on its node only. The others learn of it through the agreement.
        return self.stop_file is not None and int(os.environ.get("LOCAL_RANK", "0")) == 0

    def _stop_file_mtime(self) -> int | None:
        try:
            return os.stat(self.stop_file).st_mtime_ns
        except FileNotFoundError:
            return None

    def _stale_stop_file(self) -> int | None:
        """The modification time of a stop file that is there before the run starts, left by an
        earlier stop: it is ignored, so that the next run does not stop before its first step.
        Comparing times the file system itself stamped needs no agreement between clocks."""
        if not self._watches_stop_file():
            return None
        mtime = self._stop_file_mtime()
        if mtime is not None:
            logger.warning(
                f"The stop file {self.stop_file} is there from before this run (an earlier stop?); "
                "ignoring it. Touch it (or delete and create it) to stop this run; delete it to "
                "silence this warning."
            )
        return mtime


def _stop_while_building(signum, frame) -> None:
    logger.warning(f"Received signal {signum} while starting: stopping before training")
    raise StopRequested


def stop_building_on_sigterm() -> None:
    """Until the trainer exists nothing is trained, so a SIGTERM raises StopRequested at once
    (token caches being written clean up as on Ctrl-C), where by default it killed the rank.
    `StopRequests.stop_between_steps_on_sigterm` takes over once training can start."""
    signal.signal(signal.SIGTERM, _stop_while_building)


def exit_code_of_stop(
    requests: StopRequests | None, first_step: int = 0, step: int = 0, unsaved: str | None = None
) -> int:
    """Log a requested stop and return the run's exit code: 143 (`EXIT_STOPPED`), resumable,
    unless steps `first_step`..`step` were trained while nothing is saved (`unsaved` says why:
    checkpointing off, or load_only), then 3 (`EXIT_STOPPED_UNSAVED`).

    Args:
        requests: the run's `StopRequests`; None when the stop came before the trainer existed.
    """
    if requests is None:
        logger.warning("Stopped on request (SIGTERM) before training")
        return EXIT_STOPPED
    logger.warning(f"Stopped on request ({requests.reason}) after step {step}")
    if step >= first_step and unsaved:
        logger.warning(
            f"Nothing was saved ({unsaved}): steps {first_step} to {step} are lost, and the same "
            "command starts over."
        )
        return EXIT_STOPPED_UNSAVED
    return EXIT_STOPPED
