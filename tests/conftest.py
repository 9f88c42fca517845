"""Shared test setup: a private token cache per session, and helpers to run the trainer."""

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

from tests.forked_launcher import launch
from torchtitan.distributed.activation_checkpoint import compiles_checkpointed_scalars

PROJECT_ROOT = Path(__file__).resolve().parents[1]


# torch < 2.12 refuses compile.capture_scalar_outputs with AC on MoE blocks (inductor fails there).
needs_checkpointed_scalar_capture = pytest.mark.skipif(
    not compiles_checkpointed_scalars(), reason="this torch refuses capture_scalar_outputs with AC on MoE"
)


def load_script(relative_path: str):
    """Import a script of this repo (say "scripts/estimate_memory.py") as a module, by path:
    scripts are not a package."""
    path = PROJECT_ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def python_path(*first: str | Path) -> str:
    """PYTHONPATH for a child process: `first`, the repo, then whatever the caller already had
    (on a node without network the dependencies may come from PYTHONPATH alone)."""
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return os.pathsep.join([*map(str, first), str(PROJECT_ROOT), *inherited])


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether a `-m` expression selects the GPU-marked tests and no CPU ones (unmarked or
    `integration`): `-m gpu` does, `-m "gpu or integration"` does not (its multi-rank runs
    need the CPU). Evaluated as pytest evaluates it."""
    if not markexpr.strip():
        return False
    expression = Expression.compile(markexpr)

    def selects(marks: set[str]) -> bool:
        return expression.evaluate(lambda name, **_: name in marks)

    return selects({"gpu"}) and not selects(set()) and not selects({"integration"})


def pytest_configure(config):
    # The default suite is the CPU's even on a GPU machine: its multi-rank runs would each take the
    # device of their LOCAL_RANK, which a one-GPU machine lacks, and its tolerances are fp32 CPU
    # ones. `-m gpu` (scripts/gpu_check.sh) keeps the GPU. Set before anything initializes CUDA.
    if not selects_gpu_tests(config.getoption("markexpr") or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(scope="session", autouse=True)
def _private_token_cache(tmp_path_factory):
    os.environ["TORCHTITAN_CACHE_DIR"] = str(tmp_path_factory.mktemp("token_cache"))


CUSTOM_MODEL_MODULE = "tests.unit.custom_model_registration"  # registers model "my_llama"


@pytest.fixture
def custom_model_module():
    """The name of a module that registers model "my_llama" when imported; the test may import
    it (say through job.custom_import), and afterwards the model is unregistered and the module
    forgotten, so that other tests see the registry as shipped."""
    from torchtitan.protocols import train_spec

    yield CUSTOM_MODEL_MODULE
    train_spec._REGISTRY.pop("my_llama", None)
    sys.modules.pop(CUSTOM_MODEL_MODULE, None)


def read_metrics(dump_folder: Path) -> list[dict]:
    """The training records of metrics.jsonl (validation-only records left out)."""
    lines = (Path(dump_folder) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


MOE_METRICS = ("loss", "grad_norm", "moe_imbalance")  # an MoE run: also the routing balance


def assert_metrics_match(got: list[dict], want: list[dict], *, steps: int = 5, keys=("loss", "grad_norm"),
                         rtol: float | dict[str, float] = 1e-4, context=None) -> None:  # fmt: skip
    """Both runs logged steps 1..`steps`, and at each step every metric in `keys` of `got` is
    within `rtol` (relative to `want`'s; one float, or one per key) of `want`'s."""
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, steps + 1)), context
    rtols = rtol if isinstance(rtol, dict) else dict.fromkeys(keys, rtol)
    for g, w in zip(got, want):
        for key in keys:
            assert abs(g[key] - w[key]) <= rtols[key] * abs(w[key]), (context, key, g["step"], g[key], w[key])


def launch_ranks(target: tuple[str, str], argv: list[str], nproc: int, env: dict | None = None,
                 timeout: float = 600, cwd: Path = PROJECT_ROOT):  # fmt: skip
    """Run `target` (("module", name) or ("script", path)) with `argv` on `nproc` ranks, as
    torchrun would, forked from the test launcher's pre-imported interpreter (see
    tests/forked_launcher.py); returns the finished process. The one way tests start ranks.

    The ranks get this process's environment, the repository on PYTHONPATH, one intra-op
    thread each when there are several (two cores hold two ranks), and `env` on top."""
    threads = "1" if nproc > 1 else "2"
    full_env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": python_path(), **(env or {})}
    return launch(target, argv, nproc, full_env, cwd, timeout)


def run_trainer(args: list[str], nproc: int = 1, timeout: int = 600, env: dict | None = None,
                uneven: str | None = None):  # fmt: skip
    """Run `python -m torchtitan.train` on `nproc` ranks (`launch_ranks`); returns the finished
    process.

    `uneven` makes one rank slower or different, as tests/integration/uneven_ranks_worker.py
    describes for each of its modes."""
    target = ("module", "torchtitan.train")
    if uneven is not None:
        target = ("script", str(PROJECT_ROOT / "tests" / "integration" / "uneven_ranks_worker.py"))
        args = [uneven, *args]
    return launch_ranks(target, args, nproc, env, timeout)


@contextlib.contextmanager
def read_only(folder):
    """`folder` made read-only for this process: by its mode bits, or, for root (whom mode bits
    do not stop), by the immutable attribute."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("root, and this file system has no immutable attribute (chattr +i)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
