"""The trainer's exit codes, which the launcher and the SLURM script read to tell what happened."""

import signal

EXIT_BAD_INPUT = 2  # a config mistake or bad input, explained in one paragraph on stderr
EXIT_STOPPED = 128 + signal.SIGTERM  # stopped on request (SIGTERM, stop file), resumable as saved
EXIT_STOPPED_UNSAVED = 3  # stopped on request after training steps, with checkpointing off
EXIT_KILLED_UNSAVED = 4  # the launcher killed ranks that had not stopped by its deadline after SIGTERM
EXIT_INTERRUPTED = 128 + signal.SIGINT
