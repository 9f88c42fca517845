"""Launch the trainer (or a worker script) for the tests from an interpreter that has already
imported torch and torchtitan.

`python -m torchtitan.train` spends about 3 s of CPU importing torch, DTensor, DCP and the
models before it reads its config, and another second tearing the interpreter down; the suite
starts a few hundred such processes on 2 cores. A fork server pays the imports once: it imports
them, then forks one process per rank for each run. Each rank is still its own process with its
own environment, working directory, argv and output files, talks to the others through gloo
like a torchrun worker, and runs the module as `python -m` would (`runpy`, as `__main__`).

What this does not reproduce, and what the tests that need it launch for real:
  - torchrun itself (rendezvous, its summary of failed workers, signal forwarding): the
    run_train.sh, launcher, SIGTERM, multi-node and SLURM tests start torchrun themselves;
  - a hash seed per process: every forked rank shares the server's;
  - interpreter teardown at exit: a rank runs its atexit handlers, then `os._exit`.

`TORCHTITAN_TEST_LAUNCH=subprocess` runs every trainer as a plain subprocess (under torchrun for
several ranks), as the suite did before; the results must not differ.

The server is this file run as `python -m tests.forked_launcher`; it reads one JSON request per
line on stdin and answers one JSON line on stdout.
"""

import atexit
import json
import os
import random
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

LAUNCH_ENV = "TORCHTITAN_TEST_LAUNCH"
# torchrun's handling of a failed worker: SIGTERM to the others, SIGKILL once this has passed.
_GRACE_S = 15.0


# ---------------------------------------------------------------------------------------------
# Client: used by the tests (pytest's process)


class _Server:
    def __init__(self, cwd: Path, env: dict):
        self.python_path = env.get("PYTHONPATH")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forked_launcher"],
            cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        # The server enforces the run's timeout itself; this only guards against a dead server.
        ready, _, _ = select.select([self.proc.stdout], [], [], request["timeout"] + 2 * _GRACE_S + 30)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise RuntimeError(f"the test launcher's fork server stopped answering (exit {self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_server: _Server | None = None


def _get_server(cwd: Path, env: dict) -> _Server:
    global _server
    if _server is None or not _server.alive():
        _server = _Server(cwd, env)
        atexit.register(_server.close)
    return _server


def launch(target: tuple[str, str], argv: list[str], nproc: int, env: dict, cwd: Path, timeout: float):
    """Run `target` (("module", name) or ("script", path)) with `argv` on `nproc` ranks.

    Returns a `subprocess.CompletedProcess` whose stdout and stderr are the ranks' own, rank 0
    first, and whose returncode is the rank's for one process, else 0 or 1 as torchrun's.
    Raises `subprocess.TimeoutExpired` after `timeout` seconds, its ranks killed. With
    `env[LAUNCH_ENV] == "subprocess"` it runs a plain subprocess (torchrun for several ranks).
    """
    # The server imported its modules from its own PYTHONPATH; another one needs a fresh process.
    other_path = _server is not None and _server.python_path != env.get("PYTHONPATH")
    if env.get(LAUNCH_ENV) == "subprocess" or other_path:
        return _launch_subprocess(target, argv, nproc, env, cwd, timeout)
    server = _get_server(cwd, {**os.environ, "PYTHONPATH": env.get("PYTHONPATH", "")})
    with tempfile.TemporaryDirectory(prefix="forked_run_") as out_dir:
        request = {"target": list(target), "argv": argv, "nproc": nproc, "env": env, "cwd": str(cwd),
                   "timeout": timeout, "out_dir": out_dir}  # fmt: skip
        answer = server.run(request)
        streams = [(Path(out_dir) / f"rank{r}.out", Path(out_dir) / f"rank{r}.err") for r in range(nproc)]
        stdout = "".join(out.read_text(errors="replace") for out, _ in streams if out.exists())
        stderr = "".join(err.read_text(errors="replace") for _, err in streams if err.exists())
    args = [*target, *argv]
    if answer["timed_out"]:
        raise subprocess.TimeoutExpired(args, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(args, answer["returncode"], stdout, stderr)


def _launch_subprocess(target, argv, nproc, env, cwd, timeout):
    kind, name = target
    program = ["-m", name] if kind == "module" else [name]
    if nproc > 1:
        program = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend", "c10d",
                   "--rdzv_endpoint", "localhost:0", *program]  # fmt: skip
    cmd = [sys.executable, *program, *argv]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------------
# Server


def _preload() -> None:
    """What every trainer run imports anyway. Nothing here may start a Python thread: a fork
    copies only the forking thread."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (model init on the meta device imports it)

    import torchtitan.components.hf_io  # noqa: F401
    import torchtitan.components.tokenizer  # noqa: F401
    import torchtitan.models  # noqa: F401
    import torchtitan.train  # noqa: F401

    if threading.active_count() != 1:
        raise RuntimeError(f"the fork server started threads: {threading.enumerate()}")


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous (the OS picks it; a race with another
    process taking it first is possible, and unlikely)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(request: dict, rank: int, port: int) -> dict:
    env = dict(request["env"])
    nproc = request["nproc"]
    if nproc > 1:  # what torchrun sets for one node
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                   GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc),
                   ROLE_NAME="default", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    return env


def _redirect(fd: int, path: str, flags: int) -> None:
    target = os.open(path, flags, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _run_rank(request: dict, rank: int, port: int) -> None:
    """In the forked child: become rank `rank` of the run, run the target, exit. Never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group, so that a kill reaches compile workers too
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(_rank_env(request, rank, port))
        os.chdir(request["cwd"])
        out = Path(request["out_dir"])
        _redirect(0, os.devnull, os.O_RDONLY)
        _redirect(1, str(out / f"rank{rank}.out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        _redirect(2, str(out / f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        random.seed()
        import torch

        if os.environ.get("OMP_NUM_THREADS"):  # the server read its own at import
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        kind, name = request["target"]
        if kind == "module":
            sys.argv = [name, *request["argv"]]  # argv[0] becomes the module's file, as with -m
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [name, *request["argv"]]
            sys.path[0] = str(Path(name).parent)
            runpy.run_path(name, run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _kill(pids, sig) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig) if sig == signal.SIGKILL else os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _serve_one(request: dict) -> dict:
    nproc = request["nproc"]
    port = free_port() if nproc > 1 else 0
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _run_rank(request, rank, port)
        ranks[pid] = rank
    codes: dict[int, int] = {}
    deadline = time.monotonic() + request["timeout"]
    kill_at = None
    timed_out = False
    while len(codes) < nproc:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[ranks[pid]] = os.waitstatus_to_exitcode(status)
            if codes[ranks[pid]] != 0 and kill_at is None:
                _kill([p for p, r in ranks.items() if r not in codes], signal.SIGTERM)
                kill_at = time.monotonic() + _GRACE_S
            continue
        now = time.monotonic()
        if now > deadline and not timed_out:
            timed_out, kill_at = True, now
        if (kill_at is not None and now > kill_at) or os.getppid() == 1:
            _kill([p for p, r in ranks.items() if r not in codes], signal.SIGKILL)
            kill_at = now + 3600
        time.sleep(0.02)
    if nproc == 1:
        returncode = codes[0]
    else:
        returncode = 0 if all(c == 0 for c in codes.values()) else 1
    return {"returncode": returncode, "timed_out": timed_out, "rank_codes": [codes[r] for r in range(nproc)]}


def serve() -> None:
    _preload()
    for line in sys.stdin:
        answer = _serve_one(json.loads(line))
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
