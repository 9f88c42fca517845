"""Expert parallelism over the FSDP shard group (Qwen3 MoE debug model on the CPU): EP alone,
with FSDP, with HSDP and with TP gives one process's gradients for every AC mode (the matrix is
`full_matrix`; test_layout_parity.py runs all but one layout by default), and leaves nothing
behind between steps.

Run as a script under torchrun (2 processes), this file is also the worker of the layout and
collective-count checks (`run_worker` launches it).
"""

import gc
import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.integration.workers import run_worker, shut_down
from tests.model_testing import init_on_cpu
from tests.parity import ParityRun, assert_parity, train_for_parity
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args
from torchtitan.distributed import activation_checkpoint as ac_module
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.moe import is_expert_matmul
from torchtitan.models.qwen3 import qwen3_flavors
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.parallelize import parallelize_qwen3
from torchtitan.tools.op_counter import BACKWARD, FORWARD, OpCounter, ops

pytestmark = pytest.mark.integration

CONFIG = ["--config", "qwen3_debug_model_moe.toml"]
MODEL_CONFIGS = {"qwen3 moe": "qwen3_debug_model_moe.toml", "deepseek_v3": "deepseek_v3_debug_model.toml"}
# Small and quick, fp32 so that parity holds to rounding; the configs' own learning rates.
SMALL = ["--training.seq_len", "64", "--training.mixed_precision_param", "float32"]
GLOBAL_BATCH = 4
EP2 = ["--parallelism.expert_parallel_degree", "2"]
REPLAY = ["--activation_checkpoint.full_ac_all_to_all", "replay"]
AC = {
    "none": ["--activation_checkpoint.mode", "none"],
    "full": ["--activation_checkpoint.mode", "full"],
    "full no early stop": ["--activation_checkpoint.mode", "full", "--activation_checkpoint.no_early_stop"],
    "full replay": ["--activation_checkpoint.mode", "full", *REPLAY],
    "selective op": ["--activation_checkpoint.mode", "selective",
                     "--activation_checkpoint.selective_ac_option", "op"],
}  # fmt: skip
# name: (processes, extra argv). "EP 2": the experts split over both ranks, nothing else holds
# them. "FSDP 4, EP 2": each expert FSDP-sharded over the 2 ranks holding it. "HSDP 2 x 2, EP 2":
# experts replicated over the 2 replicas.
# "EP 2 x TP 2": each EP rank's experts sharded over the hidden units of its TP pair.
TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "2"]
# "EP 2 over TP 2": expert_tensor_parallel_degree 1, the EP group is the TP pair, the experts stay
# whole and each TP rank dispatches half of the routed rows. "FSDP 2 x TP 2, EP 4 over TP": the EP
# group spans 2 FSDP ranks x the TP pair.
TP2_EP_OVER_TP = ["--parallelism.tensor_parallel_degree", "2",
                  "--parallelism.expert_tensor_parallel_degree", "1"]  # fmt: skip
EP4 = ["--parallelism.expert_parallel_degree", "4"]
REPLICATE2 = ["--parallelism.data_parallel_replicate_degree", "2"]
LAYOUTS = {
    "EP 2": (2, EP2),
    "FSDP 4, EP 2": (4, EP2),
    "HSDP 2 x 2, EP 2": (4, EP2 + REPLICATE2),
    "EP 2 x TP 2": (4, EP2 + TP2),
    # 8 processes: each TP-sharded expert slice also FSDP-sharded over the 2 ranks holding it.
    "FSDP 4 x EP 2 x TP 2": (8, EP2 + TP2),
    "EP 2 over TP 2": (2, EP2 + TP2_EP_OVER_TP),
    "FSDP 2 x TP 2, EP 4 over TP": (4, EP4 + TP2_EP_OVER_TP),
    # 8 processes: the EP-over-TP experts FSDP-sharded across the 2 replicas.
    "HSDP 2 x 2 x TP 2, EP 4 over TP": (8, EP4 + TP2_EP_OVER_TP + REPLICATE2),
}
# Layouts too slow on 2 cores for the whole AC matrix run these (model, AC) cases only.
ONLY_CASES = {
    "FSDP 4 x EP 2 x TP 2": {("qwen3 moe", "full"), ("deepseek_v3", "selective op")},
    "HSDP 2 x 2 x TP 2, EP 4 over TP": {("qwen3 moe", "selective op"), ("deepseek_v3", "full")},
}


# Every layout here but "HSDP 2 x 2 x TP 2, EP 4 over TP" (8 processes) runs by default in
# test_layout_parity.py, each with one AC mode; that one, and the rest of the model x layout x
# AC matrix here, are `-m full_matrix`.
def _cases():
    for model in MODEL_CONFIGS:
        for layout in LAYOUTS:
            for ac in AC:
                if layout in ONLY_CASES and (model, ac) not in ONLY_CASES[layout]:
                    continue
                yield pytest.param(model, layout, ac, id=f"{model}-{layout}-{ac}")


def _run(nproc: int, extra=(), config=CONFIG, global_batch: int = GLOBAL_BATCH) -> ParityRun:
    """2 steps of the trainer on `nproc` ranks (see tests/parity.py), the global batch split
    over the data-parallel ranks."""
    tp = int(extra[extra.index(TP2[0]) + 1]) if TP2[0] in extra else 1
    local = ["--training.local_batch_size", str(global_batch * tp // nproc)]
    batch = ["--training.global_batch_size", str(global_batch)]
    return train_for_parity(config + SMALL + local + batch + list(extra), nproc)


_references: dict = {}


def _reference(model: str, global_batch: int = GLOBAL_BATCH) -> ParityRun:
    if (model, global_batch) not in _references:
        _references[model, global_batch] = _run(
            1, AC["none"], ["--config", MODEL_CONFIGS[model]], global_batch
        )
    return _references[model, global_batch]


def _assert_trains_as_one_process(got: ParityRun, want: ParityRun) -> None:
    assert_parity(got, want)
    # A rank's load is the mean of its experts' loads: between balanced and the busiest expert's.
    assert all(1 <= m["moe_ep_imbalance"] <= m["moe_imbalance"] for m in got.step_metrics), got.step_metrics


@pytest.mark.full_matrix
@pytest.mark.parametrize("model, layout, ac", list(_cases()))
def test_expert_parallel_layout_gives_one_process_gradients(model, layout, ac):
    nproc, layout_argv = LAYOUTS[layout]
    config = ["--config", MODEL_CONFIGS[model]]
    _assert_trains_as_one_process(_run(nproc, layout_argv + AC[ac], config), _reference(model))


@pytest.mark.full_matrix
@pytest.mark.parametrize("layout", ["EP 2 x TP 2", "EP 2 over TP 2"])
def test_compiled_ep_with_tp_and_op_sac_gives_one_process_gradients(layout):
    """Compiled blocks around the EP hooks and the TP-sharded experts, or around the hooks that
    split the routed rows over the TP ranks."""
    nproc, argv = LAYOUTS[layout]
    got = _run(nproc, argv + AC["selective op"] + ["--compile.enable"])
    _assert_trains_as_one_process(got, _reference("qwen3 moe"))


@pytest.mark.full_matrix
def test_hsdp_with_ep_and_two_micro_batches_gives_one_process_gradients():
    """HSDP exchanges gradients across replicas on the last micro-batch only; the experts,
    FSDP-sharded across the replicas, accumulate like everything else."""
    accumulate = ["--training.local_batch_size", "1", "--training.global_batch_size", "8"]
    got = train_for_parity(CONFIG + SMALL + LAYOUTS["HSDP 2 x 2, EP 2"][1] + AC["none"] + accumulate, 4)
    _assert_trains_as_one_process(got, _reference("qwen3 moe", global_batch=8))


@pytest.mark.parametrize(
    "argv, match",
    [(["--parallelism.data_parallel_shard_degree", "3"], "does not divide data_parallel_shard_degree 3"),
     (["--parallelism.tensor_parallel_degree", "4"], "2 is not a multiple of tensor_parallel_degree 4"),
     (["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "4",
       "--parallelism.data_parallel_shard_degree", "3"],
      r"takes 2 \(ep 4 / tensor_parallel_degree 2\) ranks of the FSDP shard"),
     (["--parallelism.expert_tensor_parallel_degree", "2"], "must be 1 or the tensor_parallel_degree"),
     (["--parallelism.context_parallel_degree", "4"], "2 is not a multiple of context_parallel_degree 4"),
     (["--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "4",
       "--parallelism.data_parallel_shard_degree", "3"],
      r"takes 2 \(ep 4 / context_parallel_degree 2\) ranks")],
)  # fmt: skip
def test_unsupported_ep_combinations_are_refused(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(CONFIG + EP2 + argv, env={})


@pytest.mark.parametrize(
    "dims, match",
    [(dict(tp=1, world_size=3, ep=2), "takes 2 ranks of the FSDP shard group, which does not divide "
                                      "data_parallel_shard_degree 3"),
     (dict(tp=2, world_size=6, ep=4),
      r"takes 2 \(ep 4 / tensor_parallel_degree 2\) ranks of the FSDP shard group"),
     (dict(tp=4, world_size=8, ep=2), "2 is not a multiple of tensor_parallel_degree 4"),
     (dict(tp=1, world_size=8, ep=2, cp=4), "2 is not a multiple of context_parallel_degree 4"),
     (dict(tp=2, world_size=8, ep=2, cp=2, etp=1),
      "2 is not a multiple of context_parallel_degree 2 x tensor_parallel_degree 2")],
    ids=["ep from dp_shard", "ep over tp", "ep smaller than tp", "ep smaller than cp",
         "ep smaller than cp x tp"],
)  # fmt: skip
def test_resolved_degrees_that_ep_does_not_fit_are_refused(dims, match):
    with pytest.raises(ConfigError, match=match):
        ParallelDims(1, -1, **dims)


def test_ep_on_a_dense_flavor_is_refused_at_parallelize():
    from types import SimpleNamespace

    from torchtitan.distributed.parallelize import check_ep_supported

    cfg = parse_args(CONFIG + EP2 + ["--model.flavor", "debugmodel"], env={})
    model = SimpleNamespace(args=qwen3_flavors["debugmodel"])
    with pytest.raises(ConfigError, match="needs a Mixture-of-Experts flavor"):
        check_ep_supported(model, ParallelDims(1, 2, 1, 2, ep=2), cfg)


WORKER_AC = {
    "none": AC["none"],
    "full, reissue": AC["full"],
    "full, reissue, no early stop": AC["full no early stop"],
    "full, replay": AC["full"] + REPLAY,
    "full, replay, no early stop": AC["full no early stop"] + REPLAY,
    "selective op": AC["selective op"],
    "selective op, looped experts": AC["selective op"],
}
LOOPED = {"selective op, looped experts"}  # experts run as per-expert matmuls, not grouped mm
# Backward all-to-alls per MoE layer: autograd's two (the transposes of dispatch and combine),
# plus, when full AC re-issues them, the recomputed dispatch and combine. The split-size
# exchange is saved in every AC mode.
BACKWARD_A2A_PER_LAYER = {
    "none": 2, "full, reissue": 4, "full, reissue, no early stop": 4,
    "full, replay": 2, "full, replay, no early stop": 2, "selective op": 2,
    "selective op, looped experts": 2,
}  # fmt: skip
# Expert matmuls (w1, w3, w2) recomputed per MoE layer: where the combine all-to-all is replayed
# from the cache, w2, whose output feeds only that all-to-all, is skipped.
RECOMPUTED_EXPERT_MATMULS_PER_LAYER = {
    "none": 0, "full, reissue": 3, "full, reissue, no early stop": 3,
    "full, replay": 2, "full, replay, no early stop": 2, "selective op": 2,
    "selective op, looped experts": 2,
}  # fmt: skip
LEAK_STEPS = 6  # a leak adds 6 tensors a step (all_to_all under full AC without early stop)


@pytest.fixture(scope="module")
def ep_worker_report():
    return run_worker("test_expert_parallel")


def test_ep_layout_keeps_half_the_experts_as_plain_tensors(ep_worker_report):
    report = ep_worker_report
    assert report["expert_shapes"] == [[4, 256, 256]] * 3, report
    assert report["experts_plain"] and report["others_dtensor"], report


@pytest.mark.parametrize("ac", list(WORKER_AC))
def test_backward_issues_only_the_all_to_alls_the_ac_mode_needs(ep_worker_report, ac):
    layers = ep_worker_report["moe_layers"]
    counts = ep_worker_report["modes"][ac]
    assert counts["forward_a2a"] == 3 * layers, counts  # split sizes, dispatch, combine
    assert set(counts["backward_a2a"]) == {BACKWARD_A2A_PER_LAYER[ac] * layers}, counts


@pytest.mark.parametrize("ac", list(WORKER_AC))
def test_recompute_skips_the_expert_matmul_whose_output_only_the_replayed_all_to_all_reads(
    ep_worker_report, ac
):
    layers = ep_worker_report["moe_layers"]
    counts = ep_worker_report["modes"][ac]
    per_projection = counts["expert_mm_per_projection"]
    assert counts["forward_expert_mm"] == 3 * layers * per_projection, counts
    expected = RECOMPUTED_EXPERT_MATMULS_PER_LAYER[ac] * layers * per_projection
    assert counts["recomputed_expert_mm"] == expected, counts


@pytest.mark.parametrize("ac", sorted(set(WORKER_AC) - {"none"}))
def test_ac_under_ep_gives_the_gradients_of_no_ac_bit_for_bit(ep_worker_report, ac):
    """Recompute runs the same kernels on the same inputs, and what it skips (the combine
    all-to-all's input) never reaches backward."""
    assert ep_worker_report["modes"][ac]["grads_equal_no_ac"], ac


@pytest.mark.parametrize("ac", list(WORKER_AC))
def test_no_op_but_the_replayed_all_to_all_reads_a_skipped_matmuls_output(ep_worker_report, ac):
    """The recompute hands on uninitialized outputs for the matmuls it skips; filled with NaN
    instead, they leave every gradient as it was, bit for bit."""
    assert ep_worker_report["modes"][ac]["skipped_outputs_unread"], ac


@pytest.mark.parametrize("ac", list(WORKER_AC))
def test_memory_held_after_each_step_stays_flat(ep_worker_report, ac):
    held = ep_worker_report["modes"][ac]["held_after_step"]
    assert len(held) == LEAK_STEPS
    # From step 2 on nothing may accumulate. A buffer of an in-flight gloo collective is now and
    # then still alive at the check (at any step, the second included), so a step may show one
    # extra tensor; a leak would grow by several tensors every step and never come back down.
    steady = min(held[1:])
    assert min(held[-3:]) == steady, held
    assert all(count - steady[0] <= 1 for count, _ in held[1:]), held
    assert ep_worker_report["modes"][ac]["pending_contexts"] == 0


@pytest.mark.parametrize("ac", list(WORKER_AC))
def test_recompute_under_ep_replays_the_forward_routing(ep_worker_report, ac):
    """The expert bias is changed between forward and backward on every rank; the gradients
    must stay those of the forward's routing (equal to a run without the change)."""
    assert ep_worker_report["modes"][ac]["replayed_grads_equal"], ac


A2A = ops(torch.ops._c10d_functional.all_to_all_single.default)
COUNTED = {"a2a": A2A, "expert mm": is_expert_matmul}


def _build(parallel_dims, ac_argv: list[str], looped: bool = False):
    cfg = parse_args(CONFIG + EP2 + ac_argv + ["--training.seq_len", "64"], env={})
    with torch.device("meta"):
        # Two blocks keep the 20-step leak check quick; every count is per MoE layer.
        model = Qwen3Model(replace(qwen3_flavors["debugmodel_moe"], n_layers=2).update_from_config(cfg))
    for name, module in model.named_modules():
        if name.endswith("moe.experts"):
            module.use_grouped_mm = not looped
    parallelize_qwen3(model, parallel_dims, cfg, torch.device("cpu"))
    return init_on_cpu(model)


def _held_tensors() -> tuple[int, int]:
    """(count, bytes) of the tensors alive in this process, plus pending collective works."""
    gc.collect()
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    pending = torch._C._distributed_c10d._get_work_registry_size()
    return len(tensors) + pending, sum(
        t.untyped_storage().nbytes() for t in tensors if t.device.type != "meta"
    )


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _grads(model) -> list[torch.Tensor]:
    return [
        p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone() for p in model.parameters()
    ]


def _report_mode(parallel_dims, ac, tokens, looped: bool = False) -> dict:
    model = _build(parallel_dims, WORKER_AC[ac], looped)
    experts = [m for n, m in model.named_modules() if n.endswith("moe.experts")]
    # Entered before the step, so checkpoint's modes see every op first, and an op they skip
    # is not counted.
    with OpCounter(COUNTED) as counter:
        loss = _loss(model, tokens)
        counter.start_backward()
        loss.backward()
    forward_a2a = counter.count("a2a", phase=FORWARD)
    # Grad mode is on in forward and in recompute, off for the gradients' own matmuls.
    forward_expert_mm = counter.count("expert mm", phase=FORWARD, grad_enabled=True)
    recomputed_expert_mm = counter.count("expert mm", phase=BACKWARD, grad_enabled=True)
    first_grads = _grads(model)
    nan_filled = _grads_with_skipped_outputs_nan(model, tokens)
    skipped_unread = all(torch.equal(a, b) for a, b in zip(first_grads, nan_filled, strict=True))
    backward_a2a, held = [], []
    for _ in range(LEAK_STEPS):
        model.zero_grad(set_to_none=True)
        with OpCounter(A2A) as counter:
            loss = _loss(model, tokens)
            counter.start_backward()
            loss.backward()
        backward_a2a.append(counter.count(phase=BACKWARD))
        held.append(_held_tensors())
    reference = _grads(model)
    model.zero_grad(set_to_none=True)
    loss = _loss(model, tokens)
    moes = [m for n, m in model.named_modules() if n.endswith(".moe")]
    for moe in moes:
        moe.expert_bias.copy_(torch.arange(moe.expert_bias.numel(), dtype=torch.float32) * 100.0)
    loss.backward()
    replayed = _grads(model)
    return {
        "forward_a2a": forward_a2a,
        "backward_a2a": backward_a2a,
        "forward_expert_mm": forward_expert_mm,
        "recomputed_expert_mm": recomputed_expert_mm,
        # One grouped mm per projection, or one matmul per local expert.
        "expert_mm_per_projection": experts[0].w1.shape[0] if looped else 1,
        "first_grads": first_grads,
        "skipped_outputs_unread": skipped_unread,
        "held_after_step": held,
        "pending_contexts": sum(e._ep_hooks._ctx is not None for e in experts),
        "replayed_grads_equal": all(torch.equal(a, b) for a, b in zip(reference, replayed)),
        "moe_layers": len(experts),
        "model": model,
    }


def _grads_with_skipped_outputs_nan(model, tokens) -> list[torch.Tensor]:
    """The gradients of one more step whose recompute fills the outputs it skips
    (`all_to_all_input`) with NaN: were anything but the replayed all-to-all to read them, a
    NaN would reach a gradient."""
    skipped = ac_module._matmul_output

    def nan_filled(func, args, kwargs):
        out = skipped(func, args, kwargs)
        return None if out is None else out.fill_(float("nan"))

    ac_module._matmul_output = nan_filled
    try:
        model.zero_grad(set_to_none=True)
        _loss(model, tokens).backward()
        return _grads(model)
    finally:
        ac_module._matmul_output = skipped


def _compare_with_no_ac(report: dict) -> None:
    """Replace each mode's first gradients by whether they equal, bit for bit on every rank
    (its expert slices included), those of the run without AC on the same experts path."""
    first = {ac: report["modes"][ac].pop("first_grads") for ac in WORKER_AC}
    looped_reference = report["no_ac_looped"].pop("first_grads")
    for ac in WORKER_AC:
        reference = looped_reference if ac in LOOPED else first["none"]
        equal = torch.tensor(float(all(torch.equal(a, b) for a, b in zip(first[ac], reference, strict=True))))
        dist.all_reduce(equal, op=dist.ReduceOp.MIN)
        report["modes"][ac]["grads_equal_no_ac"] = bool(equal.item())
        unread = torch.tensor(float(report["modes"][ac].pop("skipped_outputs_unread")))
        dist.all_reduce(unread, op=dist.ReduceOp.MIN)
        report["modes"][ac]["skipped_outputs_unread"] = bool(unread.item())


def _worker() -> None:
    """Under torchrun with 2 processes: rank 0 prints the layout, and per AC mode the
    all-to-all counts, the memory held after each of LEAK_STEPS steps and the routing-replay check."""
    dist.init_process_group("gloo")
    parallel_dims = ParallelDims(1, 2, 1, dist.get_world_size(), ep=2)
    parallel_dims.build_mesh("cpu")
    report = {"modes": {}}
    tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(dist.get_rank()))
    model = None
    for ac in WORKER_AC:
        del model  # so that the held-tensor counts of each mode see one model only
        mode_report = _report_mode(parallel_dims, ac, tokens, looped=ac in LOOPED)
        model = mode_report.pop("model")
        report["moe_layers"] = mode_report.pop("moe_layers")
        report["modes"][ac] = mode_report
    del model
    report["no_ac_looped"] = _report_mode(parallel_dims, "none", tokens, looped=True)
    model = report["no_ac_looped"].pop("model")
    experts = [m for n, m in model.named_modules() if n.endswith("moe.experts")]
    names = ("w1", "w2", "w3")
    _compare_with_no_ac(report)
    report["expert_shapes"] = [list(getattr(experts[0], n).shape) for n in names]
    report["experts_plain"] = all(
        not isinstance(getattr(e, n), DTensor) and getattr(e, n)._ep_local for e in experts for n in names
    )
    report["others_dtensor"] = all(
        isinstance(p, DTensor) for n, p in model.named_parameters() if n.split(".")[-1] not in names
    )
    if dist.get_rank() == 0:
        print(json.dumps(report))
    del model, experts
    shut_down()


if __name__ == "__main__":
    _worker()
