"""The tests' fork-server launcher (tests/forked_launcher.py) behaves like the real launch: the
same numbers as torchrun workers, each rank's own exit code and output, and timeouts."""

import os
import subprocess
import textwrap

import pytest

from tests.conftest import PROJECT_ROOT, python_path, read_metrics
from tests.forked_launcher import LAUNCH_ENV, launch

pytestmark = pytest.mark.integration

ARGV = ["--config", "debug_model.toml", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--training.steps", "3", "--metrics.log_freq", "1", "--checkpoint.no_enable"]  # fmt: skip


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(), **extra}


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_forked_ranks_train_bit_for_bit_like_torchrun_workers(tmp_path):
    def train(name, **env):
        argv = ARGV + ["--job.dump_folder", str(tmp_path / name)]
        proc = launch(("module", "torchtitan.train"), argv, 2, _env(**env), PROJECT_ROOT, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc, read_metrics(tmp_path / name)

    forked_proc, forked = train("forked")
    torchrun_proc, torchrun = train("torchrun", **{LAUNCH_ENV: "subprocess"})
    assert "torch.distributed.run" in torchrun_proc.args and "torch.distributed.run" not in forked_proc.args
    assert "[titan rank0]" in forked_proc.stderr and "[titan rank1]" in forked_proc.stderr
    assert [r["step"] for r in forked] == [1, 2, 3]
    for got, want in zip(forked, torchrun):
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"])


def test_each_rank_sees_torchruns_environment_and_its_own_output_file(tmp_path):
    script = _script(
        tmp_path,
        """
        import os, sys
        print(os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], sys.argv[1:])
        print("err", os.environ["RANK"], file=sys.stderr)
    """,
    )
    proc = launch(("script", script), ["--x", "1"], 2, _env(), tmp_path, timeout=60)
    assert proc.returncode == 0
    assert proc.stdout == "0 2 0 ['--x', '1']\n1 2 1 ['--x', '1']\n"
    assert proc.stderr == "err 0\nerr 1\n"


def test_one_process_returns_its_own_exit_code_and_several_return_torchruns_1(tmp_path):
    script = _script(
        tmp_path,
        """
        import os, sys
        sys.exit(3 if os.environ.get("RANK", "1") == "1" else 0)
    """,
    )
    assert launch(("script", script), [], 1, _env(), tmp_path, timeout=60).returncode == 3
    assert launch(("script", script), [], 2, _env(), tmp_path, timeout=60).returncode == 1


def test_a_failed_rank_stops_the_others_as_torchrun_does(tmp_path):
    # Rank 1 fails; rank 0 would wait forever, as in a collective with a rank that has left.
    script = _script(
        tmp_path,
        """
        import os, time
        if os.environ["RANK"] == "1":
            raise ValueError("rank 1 broke")
        time.sleep(600)
    """,
    )
    proc = launch(("script", script), [], 2, _env(), tmp_path, timeout=120)
    assert proc.returncode == 1 and "ValueError: rank 1 broke" in proc.stderr


def test_a_run_past_its_timeout_is_killed_and_raises(tmp_path):
    script = _script(tmp_path, "import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        launch(("script", script), [], 1, _env(), tmp_path, timeout=2)
    assert raised.value.output == "started\n"
