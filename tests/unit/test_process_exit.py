"""How a rank of a process group leaves: `exit_skipping_interpreter_teardown` does what a
normal exit does for the program (threads joined, atexit handlers, streams flushed) but not the
interpreter's final teardown, where gloo's worker threads could abort the rank."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXITING_PROGRAM = textwrap.dedent(
    """
    import atexit, concurrent.futures, pathlib, sys, threading, time
    from torchtitan.distributed.process_exit import exit_skipping_interpreter_teardown

    out = pathlib.Path(sys.argv[1])

    class Finalized:
        def __del__(self):
            (out / "finalized").write_text("yes")

    kept_until_teardown = Finalized()
    atexit.register(lambda: (out / "atexit").write_text("ran"))

    def slow_writer():
        time.sleep(0.3)
        (out / "thread").write_text("joined")

    threading.Thread(target=slow_writer).start()
    idle_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    idle_pool.submit(lambda: None).result()  # leaves a worker waiting for more
    sys.stdout.write("unflushed stdout")
    sys.stderr.write("unflushed stderr")
    exit_skipping_interpreter_teardown(5)
    """
)


@pytest.fixture(scope="module")
def exited(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The program above, run once; its process and the folder it wrote to."""
    out = tmp_path_factory.mktemp("exit")
    proc = subprocess.run([sys.executable, "-c", EXITING_PROGRAM, str(out)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    return proc, out


def test_the_exit_code_is_the_one_given(exited):
    proc, _ = exited
    assert proc.returncode == 5, proc.stderr


def test_an_idle_thread_pool_does_not_keep_the_process_alive(exited):
    """Its worker is a non-daemon thread waiting for work: joined without being told to stop,
    it kept a finished run from exiting."""
    assert exited[0].returncode == 5


def test_non_daemon_threads_finish_before_the_exit(exited):
    assert (exited[1] / "thread").read_text() == "joined"


def test_atexit_handlers_run(exited):
    assert (exited[1] / "atexit").read_text() == "ran"


def test_buffered_output_reaches_both_streams(exited):
    proc, _ = exited
    assert proc.stdout == "unflushed stdout" and proc.stderr == "unflushed stderr", proc.stderr


def test_objects_alive_at_the_exit_are_not_finalized(exited):
    """The teardown skipped is the one gloo's threads abort in; what must reach disk is closed
    before the exit, never left to a finalizer."""
    assert not (exited[1] / "finalized").exists()
