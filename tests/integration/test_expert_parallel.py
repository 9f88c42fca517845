"""Expert parallelism over the FSDP shard group (Qwen3 MoE debug model on the CPU): FSDP 2 x EP 2
matches one process for every AC mode, and leaves nothing behind between steps.

Run as a script under torchrun (2 processes), this file is also the worker of the layout and
collective-count checks (`run_worker` launches it).
"""

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import read_metrics, run_trainer
from tests.integration.workers import run_worker
from torchtitan.config.manager import ConfigError, parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.qwen3 import qwen3_flavors
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.parallelize import parallelize_qwen3

pytestmark = pytest.mark.integration

CONFIG = ["--config", "qwen3_debug_model_moe.toml"]
# Small and quick, fp32 so that parity holds to rounding.
SMALL = ["--training.seq_len", "64", "--training.steps", "3", "--metrics.log_freq", "1",
         "--lr_scheduler.warmup_steps", "2", "--training.mixed_precision_param", "float32"]  # fmt: skip
GLOBAL_BATCH = 4
EP2 = ["--parallelism.expert_parallel_degree", "2"]
AC = {
    "none": ["--activation_checkpoint.mode", "none"],
    "full": ["--activation_checkpoint.mode", "full"],
    "full early stop": ["--activation_checkpoint.mode", "full", "--activation_checkpoint.early_stop"],
    "selective op": ["--activation_checkpoint.mode", "selective",
                     "--activation_checkpoint.selective_ac_option", "op"],
}  # fmt: skip


def _run(tmp_path, name, nproc, extra=()) -> list[dict]:
    local = ["--training.local_batch_size", str(GLOBAL_BATCH // nproc)]
    dump = ["--job.dump_folder", str(tmp_path / name)]
    proc = run_trainer(CONFIG + SMALL + local + list(extra) + dump, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(tmp_path / name)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ep_single"), "single", 1, AC["none"])


# Two micro-batches per step: the experts' gradients accumulate like FSDP's.
ACCUM2 = ["--training.local_batch_size", "1", "--training.global_batch_size", str(GLOBAL_BATCH)]


@pytest.mark.parametrize("ac", [*AC, "none, 2 micro-batches"])
def test_fsdp2_ep2_matches_one_process(single_process, ac, tmp_path):
    extra = AC[ac] if ac in AC else AC["none"] + ACCUM2
    records = _run(tmp_path, "ep2", 2, EP2 + extra)
    assert [r["step"] for r in records] == [1, 2, 3]
    for got, want in zip(records, single_process):
        for key in ("loss", "grad_norm", "moe_imbalance"):
            assert abs(got[key] - want[key]) <= 1e-4 * abs(want[key]), (ac, key, got, want)


@pytest.mark.parametrize(
    "argv, match",
    [(["--parallelism.data_parallel_shard_degree", "4"],
      "expert_parallel_degree = data_parallel_shard_degree"),
     (["--parallelism.tensor_parallel_degree", "2"], "tensor_parallel_degree = 1"),
     (["--parallelism.data_parallel_replicate_degree", "2"], "data_parallel_replicate_degree = 1")],
)  # fmt: skip
def test_unsupported_ep_combinations_are_refused(argv, match):
    with pytest.raises(ConfigError, match=f"not supported yet.*{match}"):
        parse_args(CONFIG + EP2 + argv, env={})


@pytest.mark.parametrize(
    "dims, flavor, match",
    [((1, 4, 1, 4), "debugmodel_moe", "Only this combination is supported yet"),
     ((1, 2, 1, 2), "debugmodel", "needs a Mixture-of-Experts flavor")],
)  # fmt: skip
def test_resolved_degrees_and_flavor_are_checked_at_parallelize(dims, flavor, match):
    from types import SimpleNamespace

    from torchtitan.distributed.parallelize import check_ep_supported

    cfg = parse_args(CONFIG + EP2 + ["--model.flavor", flavor], env={})
    model = SimpleNamespace(args=qwen3_flavors[flavor])
    with pytest.raises(ConfigError, match=match):
        check_ep_supported(model, ParallelDims(*dims), cfg)


def test_ep_layout_and_collectives_leave_nothing_behind():
    report = run_worker("test_expert_parallel")
    # Each rank keeps half the experts as plain tensors; everything else is FSDP's.
    assert report["expert_shapes"] == [[4, 256, 256]] * 3, report
    assert report["experts_plain"] and report["others_dtensor"], report
    # Per MoE layer and step: 3 all-to-alls forward (counts, dispatch, combine), 2 backward.
    # op-SAC saves them all, so its recompute communicates no more than no AC.
    layers = report["moe_layers"]
    assert report["a2a_per_step"]["none"] == [5 * layers] * 2, report
    assert report["a2a_per_step"]["selective op"] == [5 * layers] * 2, report
    assert report["pending_contexts"] == 0, report


class _CountAllToAll(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _build(parallel_dims, ac: str):
    cfg = parse_args(CONFIG + EP2 + AC[ac] + ["--training.seq_len", "64"], env={})
    with torch.device("meta"):
        model = Qwen3Model(qwen3_flavors["debugmodel_moe"].update_from_config(cfg))
    parallelize_qwen3(model, parallel_dims, cfg, torch.device("cpu"))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


def _worker() -> None:
    """Under torchrun with 2 processes: rank 0 prints the layout and per-step collective counts."""
    dist.init_process_group("gloo")
    parallel_dims = ParallelDims(1, 2, 1, dist.get_world_size())
    parallel_dims.build_mesh("cpu")
    report = {"a2a_per_step": {}}
    tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(dist.get_rank()))
    for ac in ("none", "selective op"):
        model = _build(parallel_dims, ac)
        experts = [m for n, m in model.named_modules() if n.endswith("moe.experts")]
        counts = []
        for _ in range(2):
            with _CountAllToAll() as mode:
                logits = model(tokens[:, :-1])
                F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            counts.append(mode.count)
        report["a2a_per_step"][ac] = counts
        report["moe_layers"] = len(experts)
        report["pending_contexts"] = sum(e._ep_hooks._ctx is not None for e in experts)
        names = ("w1", "w2", "w3")
        report["expert_shapes"] = [list(getattr(experts[0], n).shape) for n in names]
        report["experts_plain"] = all(
            not isinstance(getattr(e, n), DTensor) and getattr(e, n)._ep_local for e in experts for n in names
        )
        report["others_dtensor"] = all(
            isinstance(p, DTensor) for n, p in model.named_parameters() if n.split(".")[-1] not in names
        )
    if dist.get_rank() == 0:
        print(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker()
