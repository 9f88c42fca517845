"""What the torchrun worker scripts share: building the debug model through Llama 3's
parallelize.py for a given AC mode, and launching a worker from a test."""

import gc
import json

import torch
import torch.distributed as dist

from tests.conftest import PROJECT_ROOT, launch_ranks
from tests.model_testing import init_on_cpu
from torchtitan.config.manager import parse_args
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import parallelize_llama

SEQ_LEN = 64
AC_MODES = {
    "none": ("none", "2"),
    "full": ("full", "2"),
    "selective 1": ("selective", "1"),
    "selective 2": ("selective", "2"),
    "selective op": ("selective", "op"),
}


def build_debug_model(parallel_dims, ac_mode: str, extra_args: tuple = ()) -> torch.nn.Module:
    """The seeded Llama 3 debug model with `ac_mode`, parallelized for `parallel_dims` (None:
    plain single-process model, no AC)."""
    mode, option = AC_MODES[ac_mode]
    argv = ["--activation_checkpoint.mode", mode, "--activation_checkpoint.selective_ac_option", option,
            "--training.mixed_precision_param", "float32", "--training.seq_len", str(SEQ_LEN)]  # fmt: skip
    argv += list(extra_args)
    cfg = parse_args(argv, env={})
    with torch.device("meta"):
        model = Transformer(llama3_flavors["debugmodel"])
    if parallel_dims is not None:
        parallelize_llama(model, parallel_dims, cfg, torch.device("cpu"))
    return init_on_cpu(model)


def shut_down() -> None:
    """End a worker's distributed work: free what still refers to collective work (models,
    autograd graphs), wait for every rank, then destroy the process groups. Collective work
    freed during interpreter teardown can abort the process ('terminate called without an active
    exception'; `torchtitan.distributed.process_exit.exit_skipping_interpreter_teardown` says why);
    the forked ranks skip that teardown, and under plain torchrun this makes it rarer."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def run_worker(name: str, nproc: int = 2, argv: list[str] | None = None) -> dict:
    """Run tests/integration/<name>.py with `argv` on `nproc` ranks, as torchrun would (see
    tests/forked_launcher.py), and return the JSON its rank 0 printed last."""
    script = PROJECT_ROOT / "tests" / "integration" / f"{name}.py"
    proc = launch_ranks(("script", str(script)), argv or [], nproc, {"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
