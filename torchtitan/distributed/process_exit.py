"""How a rank ends: its exit code without the interpreter's teardown, and its error for
torchrun's summary."""

import atexit
import datetime
import json
import os
import sys
import threading
from typing import NoReturn


def exit_skipping_interpreter_teardown(code: int) -> NoReturn:
    """End the process with `code` the way the interpreter would, less its final teardown:
    non-daemon threads are joined, atexit handlers run (logging flushes its handlers), the
    standard streams are flushed, and then `os._exit(code)`. Call it from the main thread.

    For a rank that ran collectives, after `destroy_process_group`. A gloo worker thread frees
    a finished collective's tensors a moment after the collective has returned to Python; when
    that lands after the interpreter has begun finalizing, the thread cannot take the GIL, is
    ended inside C++, and the rank aborts with SIGABRT ("terminate called without an active
    exception", torch 2.13). A rank that exits right after a collective (every rank leaving on
    an agreed config error) hit it about once in 30 runs under torchrun, and torchrun then
    reported the abort rather than the error. Pitfall: objects still alive are not finalized,
    so whatever must reach disk is closed before this (the trainer's writers and checkpointer).
    """
    # The interpreter's own first two exit steps, in its order. `_shutdown` also wakes idle
    # thread-pool workers (its registered callbacks) before it joins them; joining threads
    # directly waited forever on a finished run's idle ThreadPoolExecutor.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to say there
            pass
    os._exit(code)


def report_to_torchrun(message: str) -> None:
    """Write `message` where torchrun's failure summary reads this rank's error
    (`$TORCHELASTIC_ERROR_FILE`), for an error the rank handles itself rather than raising:
    the summary then shows it even when `LOG_RANK` hides the rank's output. Outside torchrun
    there is no such file and nothing is written."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(datetime.datetime.now().timestamp())}, f)
